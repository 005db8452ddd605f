"""The quality study's preparation: grouped expert compute, resumable pre-training, the arms,
the batched lm-eval scorer, the ShareGPT reader and the summary."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from occult.config import load_config, merge
from occult.ep.experts import FUSED_IMPLEMENTATION, fused_experts_forward
from occult.models.moe import (
    EXPERTS_IMPLEMENTATION,
    _looped_experts_forward,
    build_tiny_olmoe,
    grouped_experts_forward,
    load_checkpoint,
    use_experts_kernel,
)
from occult.routing.variants import Arm, arm_config, quality_arms

REPO = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((REPO / "config" / "config.yaml").read_text())

MICRO = {
    "run": "micro-quality",
    "data": {"sources": ["chitchat", "kjv"], "max_chars_per_source": 40000, "vocab_size": 400,
             "instruction_pairs": 40, "eval_tasks": ["copa", "sst2"], "eval_examples": 6},
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_experts": 16, "top_k": 4,
              "expert_ffn": 16, "max_seq_len": 128},
    "pretrain": {"steps": 6, "batch_size": 4, "seq_len": 32, "warmup_steps": 1},
    "profile": {"calibration_tokens": 1500, "heldout_tokens": 1500, "seq_len": 32},
    "placement": {"devices": [2, 4, 8], "methods": ["contiguous", "greedy"], "swap_rounds": 1},
    "finetune": {"steps": 2, "batch_size": 4, "seq_len": 48},
    "evaluate": {"batch_size": 8},
    "bench": {"tokens_per_rank": [16], "repeats": 1, "warmup": 0},
}


def micro_config(**overrides):
    return load_config(merge(merge(BASE, MICRO), overrides))


# --------------------------------------------------------------------------- expert compute


def experts_case(tokens: int, experts: int, top_k: int, *, hot: bool = False):
    """A micro model's first experts module and random inputs: (block, x_TD, ids_TK, w_TK); with
    `hot`, the first half of the tokens all pick expert 0 (k distinct experts per token still)."""
    model_cfg = dataclasses.replace(micro_config().model, num_experts=experts, top_k=top_k)
    model = build_tiny_olmoe(model_cfg, 64, pad_token_id=None, bos_token_id=0, eos_token_id=0, seed=0)
    x_TD = torch.randn(tokens, model_cfg.hidden_size, requires_grad=True)
    ids_TK = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    if hot:
        for t in range(tokens // 2):
            ids_TK[t] = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(experts - 1)[: top_k - 1] + 1])
    return model.model.layers[0].mlp.experts, x_TD, ids_TK, torch.rand(tokens, top_k, requires_grad=True)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 1), (37, 16, 4), (64, 64, 8)])
def test_grouped_experts_equal_the_loop_forward_and_backward(tokens, experts, top_k):
    torch.manual_seed(0)
    block, x_TD, ids_TK, w_TK = experts_case(tokens, experts, top_k)
    got = grouped_experts_forward(block, x_TD, ids_TK, w_TK)
    ref = _looped_experts_forward(block, x_TD, ids_TK, w_TK)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(got.square().sum(), (x_TD, w_TK, block.gate_up_proj, block.down_proj))
    refs = torch.autograd.grad(ref.square().sum(), (x_TD, w_TK, block.gate_up_proj, block.down_proj))
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_models_use_the_grouped_path_and_match_transformers_eager():
    cfg = micro_config()
    model = build_tiny_olmoe(cfg.model, 128, pad_token_id=None, bos_token_id=0, eos_token_id=0, seed=1)
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION
    ids = torch.randint(0, 128, (3, 20))
    with torch.no_grad():
        got = model(input_ids=ids).logits
        model.set_experts_implementation("eager")
        ref = model(input_ids=ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 1), (37, 16, 4), (64, 64, 8)])
def test_fused_experts_equal_the_grouped_path_forward_and_backward(tokens, experts, top_k):
    """model.experts_kernel=triton: the EP runtime's kernels on one device (TRITON_INTERPRET=1 here,
    fp32), against the grouped path, output and every gradient (router weights included)."""
    torch.manual_seed(1)
    block, x_TD, ids_TK, w_TK = experts_case(tokens, experts, top_k, hot=True)
    got = fused_experts_forward(block, x_TD, ids_TK, w_TK)
    ref = grouped_experts_forward(block, x_TD, ids_TK, w_TK)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    inputs = (x_TD, w_TK, block.gate_up_proj, block.down_proj)
    upstream = torch.randn_like(ref)
    for g, r in zip(torch.autograd.grad(got, inputs, upstream), torch.autograd.grad(ref, inputs, upstream)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_a_model_on_the_fused_kernels_gives_the_same_logits_and_loads_so(tmp_path):
    cfg = micro_config()
    model = build_tiny_olmoe(cfg.model, 128, pad_token_id=None, bos_token_id=0, eos_token_id=0, seed=1)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        use_experts_kernel(model, "triton")
        assert model.config._experts_implementation == FUSED_IMPLEMENTATION
        torch.testing.assert_close(model(input_ids=ids).logits, ref, atol=1e-5, rtol=1e-4)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(tmp_path)           # a checkpoint written while on the fused path loads either way
    words = Tokenizer(models.WordLevel({"<eos>": 0, "a": 1}, unk_token="<eos>"))
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>").save_pretrained(tmp_path)
    for kernel, name in (("grouped", EXPERTS_IMPLEMENTATION), ("triton", FUSED_IMPLEMENTATION)):
        loaded, _ = load_checkpoint(tmp_path, experts_kernel=kernel)
        assert loaded.config._experts_implementation == name
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, ref, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="model.experts_kernel"):
        use_experts_kernel(model, "cuda")


def test_the_fused_kernels_refuse_a_cpu_without_the_interpreter(monkeypatch):
    cfg = micro_config()
    model = build_tiny_olmoe(cfg.model, 64, pad_token_id=None, bos_token_id=0, eos_token_id=0, seed=0)
    monkeypatch.delenv("TRITON_INTERPRET")
    block = model.model.layers[0].mlp.experts
    with pytest.raises(RuntimeError, match="model.experts_kernel: 'triton' needs a CUDA device"):
        fused_experts_forward(block, torch.randn(3, 32), torch.zeros(3, 4, dtype=torch.long), torch.rand(3, 4))


# --------------------------------------------------------------------------- the arms


def test_quality_arms_cover_the_study_and_respect_the_pruning_bound():
    cfg = load_config(merge(BASE, yaml.safe_load((REPO / "config/presets/mini.yaml").read_text())))
    arms = quality_arms(cfg)
    names = [a.name for a in arms]
    assert len(names) == len(set(names)) == 16
    assert names[:2] == ["raw", "sft-moe"]
    pruned = {(a.variant, a.devices) for a in arms if a.variant.startswith("prune") and a.gate_weights == "keep"
              and a.train_modules == "moe"}
    assert pruned == {(f"prune{n}-{m}", d) for d in (4, 8) for n in (1, 2, 4) if n < d for m in ("router", "sim")}
    assert {a.name for a in arms if a.gate_weights == "renormalise"} == {"prune2-sim-D8-renormalise-moe",
                                                                         "prune1-sim-D8-renormalise-moe"}
    assert {a.name for a in arms if a.train_modules == "all"} == {"sft-all", "prune2-sim-D8-keep-all"}
    for arm in arms:        # every arm is a valid config of its own
        arm_cfg = arm_config(cfg, arm)
        assert arm_cfg.finetune.devices == arm.devices and arm_cfg.finetune.variants == (arm.variant,)


def test_quality_arms_drop_settings_a_small_model_cannot_prune():
    cfg = micro_config()                        # E=16, k=4: at D=8 only N_d >= 2 keeps k experts
    arms = quality_arms(cfg)
    assert all(int(a.variant[5]) * 16 // a.devices >= 4 for a in arms if a.variant.startswith("prune"))
    assert Arm("prune1-sim", 8).name not in {a.name for a in arms}


# --------------------------------------------------------------------------- resumable pre-training


@pytest.fixture(scope="module")
def micro_data(tmp_path_factory):
    from occult.stages.data import build_data

    out = tmp_path_factory.mktemp("data")
    cfg = micro_config()
    build_data(cfg.data, cfg.seed, out)
    return out


def test_pretraining_resumes_to_the_same_weights(micro_data, tmp_path):
    from occult.stages.pretrain import PretrainPaused, pretrain, resume_dir_of

    cfg = micro_config()
    straight = tmp_path / "straight" / "base"
    pretrain(cfg, micro_data, straight, tmp_path / "straight.csv", tmp_path / "straight.json")
    paused = tmp_path / "paused" / "base"
    with pytest.raises(PretrainPaused):
        pretrain(cfg, micro_data, paused, tmp_path / "paused.csv", tmp_path / "paused.json", time_limit_s=0.0)
    assert (resume_dir_of(paused) / "state.pt").is_file() and not paused.exists()
    pretrain(cfg, micro_data, paused, tmp_path / "paused.csv", tmp_path / "paused.json")
    assert paused.is_dir() and not resume_dir_of(paused).exists()
    from safetensors.torch import load_file

    a, b = load_file(straight / "model.safetensors"), load_file(paused / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log_a = np.genfromtxt(tmp_path / "straight.csv", delimiter=",", names=True)
    log_b = np.genfromtxt(tmp_path / "paused.csv", delimiter=",", names=True)
    assert np.array_equal(log_a["train_loss"], log_b["train_loss"]) and len(log_b) == cfg.pretrain.steps


def test_resume_state_of_another_config_is_refused(micro_data, tmp_path):
    from occult.stages.pretrain import PretrainPaused, pretrain

    out = tmp_path / "base"
    with pytest.raises(PretrainPaused):
        pretrain(micro_config(), micro_data, out, tmp_path / "l.csv", tmp_path / "s.json", time_limit_s=0.0)
    with pytest.raises(ValueError, match="resume state of config"):
        pretrain(micro_config(seed=1), micro_data, out, tmp_path / "l.csv", tmp_path / "s.json")


# --------------------------------------------------------------------------- the batched scorer


def test_batched_scorer_equals_hflm(micro_data, tmp_path):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from occult.stages.evaluate import fast_lm
    from occult.stages.pretrain import load_tokenizer

    cfg = micro_config()
    tokenizer = load_tokenizer(micro_data / "tokenizer")
    model = build_tiny_olmoe(cfg.model, len(tokenizer), pad_token_id=None, bos_token_id=tokenizer.eos_token_id,
                             eos_token_id=tokenizer.eos_token_id, seed=3).eval()
    requests = []
    for n, line in enumerate((micro_data / "eval" / "sst2.jsonl").read_text().splitlines()):
        doc = json.loads(line)
        context = doc["sentence"] + "\nQuestion: Is this sentence positive or negative?\nAnswer:"
        requests += [Instance("loglikelihood", doc, (context, f" {c}"), n) for c in ("negative", "positive")]
    requests.append(Instance("loglikelihood", {}, ("", "the end of it all"), 99))
    requests.append(Instance("loglikelihood", {}, ("a " * 200, " long context"), 100))   # left-truncated
    ref = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4, max_length=64).loglikelihood(requests)
    got = fast_lm(model, tokenizer, max_length=64, batch_tokens=300).loglikelihood(requests)
    assert [g for _, g in got] == [g for _, g in ref]
    np.testing.assert_allclose([x for x, _ in got], [x for x, _ in ref], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("arch", ["olmoe", "qwen2_moe", "deepseek_v2", "mixtral"])
def test_continuation_logits_equal_the_full_forward(arch):
    from tests.models.test_moe import tiny_hf_model

    from occult.stages.evaluate import continuation_logits

    model = tiny_hf_model(arch, vocab_size=97, seed=4).eval()
    ids_BS = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(5))
    pos_b, pos_s = torch.tensor([0, 0, 1, 2, 2, 2]), torch.tensor([3, 10, 0, 5, 6, 10])
    with torch.no_grad():
        want = model(input_ids=ids_BS, use_cache=False).logits[pos_b, pos_s]
        head_inputs = []
        hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: head_inputs.append(args[0].shape))
        got = continuation_logits(model, ids_BS, pos_b, pos_s)
        hook.remove()
    assert head_inputs == [torch.Size([6, model.config.hidden_size])]      # the head saw the picked rows only
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- ShareGPT, the summary


def test_sharegpt_reader_decodes_a_truncated_array_and_builds_first_turn_pairs(tmp_path):
    from occult.stages.corpus import Document, sharegpt_conversations
    from occult.stages.instructions import sharegpt_pairs

    good = {"id": "a_0", "conversations": [{"from": "human", "value": "What is a noun used for?"},
                                           {"from": "gpt", "value": "A noun names a person, place or thing."}]}
    path = tmp_path / "share.json"
    path.write_text("[\n" + json.dumps(good) + ",\n" + json.dumps({**good, "id": "b_0"}) + ',\n {"id": "c_0", "conv')
    assert [c["id"] for c in sharegpt_conversations(path)] == ["a_0", "b_0"]
    turns = (("turn", "User", "What is a noun used for?"), ("turn", "Assistant", "A noun names a person, place or thing."))
    doc = Document("sharegpt", "sharegpt:a_0", "\n".join(f"{w}: {t}" for _, w, t in turns), turns)
    (pair,) = sharegpt_pairs(doc, None)
    assert (pair.instruction, pair.response) == (turns[0][2], turns[1][2])
    assert sharegpt_pairs(Document("sharegpt", "x", doc.text, turns[::-1]), None) == []   # must start with the user


def _fake_summary(arm: Arm, accs: dict[str, float]) -> dict:
    return {"variant": arm.variant, "arm": arm.name,
            "setting": {"devices": arm.devices, "gate_weights": arm.gate_weights, "train_modules": arm.train_modules},
            "scores": [{"task": t, "acc": a, "acc_stderr": 0.01, "chance": 0.5} for t, a in accs.items()]}


def test_summary_table_is_in_paper_order_and_verdicts_follow_the_numbers(tmp_path):
    from occult.report.quality import claim_verdicts, summarise_arms

    arms = {"raw": (Arm("raw", 8), 0.55), "sft": (Arm("sft", 8), 0.70),
            "p2r": (Arm("prune2-router", 8), 0.66), "p2s": (Arm("prune2-sim", 8), 0.695),
            "p1r": (Arm("prune1-router", 8), 0.58), "p1s": (Arm("prune1-sim", 8), 0.62)}
    (tmp_path / "evaluate").mkdir()
    for arm, acc in arms.values():
        (tmp_path / "evaluate" / f"{arm.name}.json").write_text(json.dumps(_fake_summary(arm, {"copa": acc, "piqa": acc})))
    summarise_arms(tmp_path, tmp_path / "figures")
    import pandas as pd

    table = pd.read_csv(tmp_path / "tables" / "accuracy.csv")
    assert list(table["arm"]) == ["raw", "sft-moe", "prune2-router-D8-keep-moe", "prune2-sim-D8-keep-moe",
                                  "prune1-router-D8-keep-moe", "prune1-sim-D8-keep-moe", "chance"]
    assert table.set_index("arm").at["sft-moe", "average"] == pytest.approx(0.70)
    # the paper's benchmarks the offline data lacks are in the table, said to be missing, not averaged
    assert all((table[t] == "not available offline").all() for t in ("wsc273", "race", "mathqa"))
    verdicts = {v["claim"]: v["verdict"] for v in claim_verdicts(table)}
    assert verdicts["pruning within 2 devices is about as good as standard fine-tuning"] == "does not hold"  # router: -4 pts
    assert verdicts["pruning within 1 device hurts"] == "holds"
    assert verdicts["similarity-based pruning beats router-score-based pruning"] == "holds"
    assert (tmp_path / "figures" / "accuracy.png").stat().st_size > 1000


def _bits(values) -> str:
    return "".join("1" if v else "0" for v in values)


def test_paired_difference_is_the_mean_per_document_difference():
    from occult.report.quality import paired_difference

    rng = np.random.default_rng(0)
    a = {"copa": rng.random(100) < 0.6, "piqa": rng.random(400) < 0.7}
    b = {t: np.where(rng.random(len(v)) < 0.1, ~v, v) for t, v in a.items()}     # b flips 10% of a's answers
    diff, stderr = paired_difference([({t: _bits(v) for t, v in a.items()}, {t: _bits(v) for t, v in b.items()})],
                                     ["copa", "piqa"])
    d = {t: a[t].astype(float) - b[t] for t in a}
    assert diff == pytest.approx(np.mean([d[t].mean() for t in d]))
    assert stderr == pytest.approx(np.sqrt(sum(d[t].var(ddof=1) / len(d[t]) for t in d)) / 2)
    independent = np.sqrt(sum(v.mean() * (1 - v.mean()) / len(v) for arm in (a, b) for v in arm.values())) / 2
    assert stderr < independent / 2            # agreeing arms: the paired error is far smaller
    assert paired_difference([({"copa": "01"}, {"copa": "011"})], ["copa"]) is None     # other documents
    assert paired_difference([({"copa": "01"}, {"copa": "01"})], ["copa", "piqa"]) is None   # a task missing


def test_task_scores_keep_documents_and_check_them_against_the_aggregate():
    from occult.stages.eval_tasks import TASK_NAMES
    from occult.stages.evaluate import task_scores

    name = TASK_NAMES["copa"]
    out = {"results": {name: {"acc,none": 0.5, "acc_stderr,none": 0.29}}, "n-samples": {name: {"effective": 4}},
           "samples": {name: [{"doc_id": i, "acc": acc} for i, acc in [(2, 1.0), (0, 0.0), (3, 0.0), (1, 1.0)]]}}
    scores, per_doc = task_scores(out, ["copa"])
    assert per_doc == {"copa": "0110"} and scores[0]["acc"] == 0.5 and scores[0]["n"] == 4
    out["results"][name]["acc,none"] = 0.75
    with pytest.raises(RuntimeError, match="copa"):
        task_scores(out, ["copa"])


def test_verdicts_use_the_paired_error_when_documents_are_kept(tmp_path):
    """The same accuracies: a 1.5-point gain of similarity over router pruning is within 2 errors of
    independent averages but far outside the paired error (the arms differ on 1.5% of documents)."""
    from occult.report.quality import claim_verdicts, summarise_arms

    n = 2000
    base = np.arange(n) % 3 == 0                                 # 33.3% correct
    better = base.copy()
    better[1:int(0.015 * n) * 3:3] = True                        # 30 more documents right
    arms = {Arm("raw", 8): base, Arm("sft", 8): better, Arm("prune2-router", 8): base, Arm("prune2-sim", 8): better}
    (tmp_path / "evaluate").mkdir()
    for arm, correct in arms.items():
        summary = _fake_summary(arm, {"piqa": float(correct.mean())})
        summary["scores"][0]["acc_stderr"] = float(np.sqrt(correct.mean() * (1 - correct.mean()) / n))
        summary["per_doc"] = {"piqa": _bits(correct)}
        (tmp_path / "evaluate" / f"{arm.name}.json").write_text(json.dumps(summary))
    summarise_arms(tmp_path, tmp_path / "figures")
    verdicts = {v["claim"]: v for v in json.loads((tmp_path / "tables" / "verdicts.json").read_text())["verdicts"]}
    sim = verdicts["similarity-based pruning beats router-score-based pruning"]
    (pair,) = sim["comparisons"]
    assert pair["stderr_basis"] == "paired documents" and pair["diff"] == pytest.approx(0.015)
    assert pair["diff"] < 2 * pair["stderr_independent"] and pair["diff"] > 2 * pair["stderr"]
    assert sim["verdict"] == "holds"
    import pandas as pd

    table = pd.read_csv(tmp_path / "tables" / "accuracy.csv")
    assert claim_verdicts(table)[2]["verdict"].startswith("inconclusive")      # without the documents


def test_ablation_verdicts_and_the_task_that_decides_a_difference(tmp_path):
    """Full vs MoE-only fine-tuning and renormalised vs kept gates get a verdict each; every
    comparison names the task that moves it most and the difference without that task."""
    from occult.report.quality import claim_verdicts, summarise_arms

    accs = {Arm("sft", 8): {"copa": 0.70, "piqa": 0.70}, Arm("sft", 8, train_modules="all"): {"copa": 0.80, "piqa": 0.72},
            Arm("prune2-sim", 8): {"copa": 0.69, "piqa": 0.69},
            Arm("prune2-sim", 8, gate_weights="renormalise"): {"copa": 0.60, "piqa": 0.62}}
    (tmp_path / "evaluate").mkdir()
    for arm, acc in accs.items():
        (tmp_path / "evaluate" / f"{arm.name}.json").write_text(json.dumps(_fake_summary(arm, acc)))
    summarise_arms(tmp_path, tmp_path / "figures")
    verdicts = {v["claim"]: v for v in json.loads((tmp_path / "tables" / "verdicts.json").read_text())["verdicts"]}
    full = verdicts["full fine-tuning against MoE-only fine-tuning (same variant)"]
    (pair,) = full["comparisons"]
    assert (pair["a"], pair["b"]) == ("sft-all", "sft-moe") and pair["diff"] == pytest.approx(0.06)
    assert pair["decisive_task"] == "copa" and pair["diff_without_decisive_task"] == pytest.approx(0.02)
    assert full["verdict"] == "full fine-tuning better"
    gates = verdicts["gate weights renormalised after pruning against kept as they are"]
    assert [d["a"] for d in gates["comparisons"]] == ["prune2-sim-D8-renormalise-moe"]
    assert gates["verdict"] == "kept gates better"
    import pandas as pd

    table = pd.read_csv(tmp_path / "tables" / "accuracy.csv")
    table = table[table["gate_weights"] != "renormalise"]
    assert claim_verdicts(table)[-1]["verdict"] == "not measured"


def test_replicate_table_pairs_two_runs_document_by_document(tmp_path):
    """Two runs of one recipe: each arm's change between runs and the change of its difference from
    the reference arm, with errors from the per-document contrasts of all arms involved; the same
    numbers computed directly from the bits. Arms are matched by the spec's names, not by file name."""
    import yaml

    from occult.report.quality import replicate_table

    rng = np.random.default_rng(1)
    sizes = {"copa": 100, "piqa": 300}

    def run(folder: Path, names: list[str]) -> dict:
        (folder / "evaluate").mkdir(parents=True)
        bits = {}
        for name in names:
            bits[name] = {t: rng.random(n) < rng.uniform(0.5, 0.8) for t, n in sizes.items()}
            summary = _fake_summary(Arm("sft", 8), {t: float(v.mean()) for t, v in bits[name].items()})
            summary["arm"], summary["per_doc"] = name, {t: _bits(v) for t, v in bits[name].items()}
            (folder / "evaluate" / f"{name}.json").write_text(json.dumps(summary))
        return bits

    one = run(tmp_path / "v1", ["sft-moe", "prune1-sim-D8-keep-moe", "prune1-router-D8-keep-moe"])
    two = run(tmp_path / "v2", ["sft-moe", "prune1-sim-D8-renormalise-moe"])
    spec = {"first": str(tmp_path / "v1"), "reference": "sft-moe",
            "same_arms": {"sft-moe": "sft-moe", "prune1-sim-D8-keep-moe": "prune1-sim-D8-renormalise-moe"}}
    (tmp_path / "v2" / "replicate_of.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    table = replicate_table(tmp_path / "v2" / "replicate_of.yaml").set_index(["kind", "arm"])
    assert list(table.index) == [("accuracy", "sft-moe"), ("accuracy", "prune1-sim-D8-renormalise-moe"),
                                 ("minus sft-moe", "prune1-sim-D8-renormalise-moe")]

    def direct(per_task):            # mean over tasks of the per-document contrast, and its error
        means = [c.mean() for c in per_task.values()]
        return np.mean(means), np.sqrt(sum(c.var(ddof=1) / len(c) for c in per_task.values())) / len(per_task)

    f = lambda bits, t: bits[t].astype(float)      # noqa: E731
    did = {t: (f(two["prune1-sim-D8-renormalise-moe"], t) - f(two["sft-moe"], t))
           - (f(one["prune1-sim-D8-keep-moe"], t) - f(one["sft-moe"], t)) for t in sizes}
    row = table.loc[("minus sft-moe", "prune1-sim-D8-renormalise-moe")]
    assert (row["change"], row["change_stderr"]) == pytest.approx(direct(did))
    assert row["z"] == pytest.approx(row["change"] / row["change_stderr"])
    assert row["first"] == pytest.approx(direct({t: f(one["prune1-sim-D8-keep-moe"], t) - f(one["sft-moe"], t)
                                                 for t in sizes})[0])
    pooled = {t: (f(two["prune1-sim-D8-renormalise-moe"], t) - f(two["sft-moe"], t)
                  + f(one["prune1-sim-D8-keep-moe"], t) - f(one["sft-moe"], t)) / 2 for t in sizes}
    assert (row["pooled"], row["pooled_stderr"]) == pytest.approx(direct(pooled))
    from occult.report.quality import plot_replicates

    plot_replicates(table.reset_index(), tmp_path / "replicates.png")
    assert (tmp_path / "replicates.png").stat().st_size > 1000
    acc = table.loc[("accuracy", "sft-moe")]
    a, b = one["sft-moe"], two["sft-moe"]
    assert acc["agreement"] == pytest.approx(np.mean([np.mean(a[t] == b[t]) for t in sizes]))
    assert acc["agreement_if_independent"] == pytest.approx(np.mean(
        [a[t].mean() * b[t].mean() + (1 - a[t].mean()) * (1 - b[t].mean()) for t in sizes]))
    assert acc["change"] == pytest.approx(direct({t: f(two["sft-moe"], t) - f(one["sft-moe"], t) for t in sizes})[0])
    # a spec naming an arm a run did not score, or missing a field: one error naming the file and the arm
    spec["same_arms"]["prune2-sim-D8-keep-moe"] = "prune2-sim-D8-renormalise-moe"
    (tmp_path / "v2" / "replicate_of.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(ValueError, match="replicate_of.yaml.*prune2-sim-D8-keep-moe"):
        replicate_table(tmp_path / "v2" / "replicate_of.yaml")
    (tmp_path / "v2" / "replicate_of.yaml").write_text(yaml.safe_dump({"first": spec["first"]}))
    with pytest.raises(ValueError, match="'reference'"):
        replicate_table(tmp_path / "v2" / "replicate_of.yaml")


def test_processes_sharing_a_gpu_cap_their_allocator(monkeypatch):
    from occult.routing.variants import cap_gpu_memory_share

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f: calls.append(f))
    assert cap_gpu_memory_share({}) is None and cap_gpu_memory_share({"OCCULT_PROCESSES_PER_GPU": "1"}) is None
    assert cap_gpu_memory_share({"OCCULT_PROCESSES_PER_GPU": "3"}) == pytest.approx(0.95 / 3)
    assert calls == [pytest.approx(0.95 / 3)]
    for bad in ("0", "two"):
        with pytest.raises(ValueError, match="OCCULT_PROCESSES_PER_GPU"):
            cap_gpu_memory_share({"OCCULT_PROCESSES_PER_GPU": bad})
