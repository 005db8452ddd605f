"""occult.models.moe: tiny OLMoE, checkpoint loading, MoE adapters, routing override and capture.

Also home of the stand-in data used by the pretrain and profiling tests (`write_standin_data`):
a few jsonl documents from two synthetic "sources" and a 300-token byte-level BPE tokenizer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from occult.config import ModelConfig
from occult.models.moe import (
    CheckpointError,
    build_tiny_olmoe,
    capture_routing,
    default_topk,
    get_routing,
    load_checkpoint,
    moe_layers,
    routing_override,
    set_routing,
)

EOT = "<|endoftext|>"
WORDS_PROSE = "the a man woman king house light dark river walked spoke saw gave and then said unto".split()
WORDS_CODE = "def return import self if else for in range print None True lambda class (x) [i] = +".split()


def write_standin_data(root: Path, docs_per_source: int = 120, seed: int = 0) -> Path:
    """A data_dir like the data stage writes: corpus/{train,heldout}.jsonl and tokenizer/."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    docs = []
    for source, words in (("prose", WORDS_PROSE), ("code", WORDS_CODE)):
        for _ in range(docs_per_source):
            length = rng.randint(20, 80)
            docs.append({"source": source, "text": " ".join(rng.choice(words) for _ in range(length))})
    rng.shuffle(docs)
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    split = len(docs) // 6
    for name, part in (("heldout", docs[:split]), ("train", docs[split:])):
        (corpus / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in part))

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator((d["text"] for d in docs), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOT, eos_token=EOT, pad_token=EOT)
    tokenizer.save_pretrained(root / "tokenizer")
    return root


def tiny_model_cfg(**changes) -> ModelConfig:
    fields = dict(
        source="scratch", checkpoint=None, hidden_size=32, num_layers=2, num_heads=2,
        num_experts=8, top_k=2, expert_ffn=16, max_seq_len=64,
    )
    fields.update(changes)
    return ModelConfig(**fields)


def tiny_hf_model(arch: str, vocab_size: int, seed: int = 0):
    """A randomly initialised tiny model of each supported architecture."""
    import transformers as tf

    common = dict(
        vocab_size=vocab_size, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
        num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )
    if arch == "olmoe":
        cfg = tf.OlmoeConfig(num_hidden_layers=2, num_experts=8, intermediate_size=16, **common)
        cls = tf.OlmoeForCausalLM
    elif arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            num_hidden_layers=3, num_experts=8, moe_intermediate_size=16, intermediate_size=32,
            shared_expert_intermediate_size=24, mlp_only_layers=[1], norm_topk_prob=True, **common,
        )
        cls = tf.Qwen2MoeForCausalLM
    elif arch == "mixtral":      # the upcycled model's family (occult.models.upcycle): renormalised top-k
        cfg = tf.MixtralConfig(num_hidden_layers=2, num_local_experts=8, intermediate_size=16, **common)
        cls = tf.MixtralForCausalLM
    elif arch == "deepseek_v2":
        cfg = tf.DeepseekV2Config(
            num_hidden_layers=3, n_routed_experts=8, moe_intermediate_size=16, intermediate_size=32,
            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, topk_method="group_limited_greedy",
            n_group=4, topk_group=1, routed_scaling_factor=1.5, **common,
        )
        cls = tf.DeepseekV2ForCausalLM
    else:
        raise ValueError(arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(cfg).eval()


ARCHS = ["olmoe", "qwen2_moe", "deepseek_v2", "mixtral"]
EXPECTED_MOE_LAYERS = {"olmoe": [0, 1], "qwen2_moe": [0, 2], "deepseek_v2": [1, 2], "mixtral": [0, 1]}


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    return write_standin_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def tokenizer(standin):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(standin / "tokenizer")


def sample_ids(vocab_size: int, batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_build_tiny_olmoe_matches_config_and_is_seeded(tokenizer):
    cfg = tiny_model_cfg()
    eot = tokenizer.convert_tokens_to_ids(EOT)
    state = torch.get_rng_state()
    a = build_tiny_olmoe(cfg, len(tokenizer), pad_token_id=eot, bos_token_id=eot, eos_token_id=eot, seed=3)
    assert torch.equal(state, torch.get_rng_state()), "building must not move the global RNG"
    b = build_tiny_olmoe(cfg, len(tokenizer), pad_token_id=eot, bos_token_id=eot, eos_token_id=eot, seed=3)
    c = build_tiny_olmoe(cfg, len(tokenizer), pad_token_id=eot, bos_token_id=eot, eos_token_id=eot, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.model.layers[0].mlp.gate.weight, c.model.layers[0].mlp.gate.weight)
    layers = moe_layers(a)
    assert [l.layer_index for l in layers] == [0, 1]
    layer = layers[0]
    assert (layer.num_experts, layer.top_k, layer.expert_ffn) == (8, 2, 16)
    assert layer.w_gate_up.shape == (8, 32, 32) and layer.w_down.shape == (8, 32, 16)
    assert layer.router_weight.shape == (8, 32)
    assert layer.rule.norm_topk_prob is False and layer.shared_expert is None
    assert a.config.vocab_size == len(tokenizer)


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_roundtrip_adapters_and_default_override(arch, tokenizer, tmp_path):
    model = tiny_hf_model(arch, len(tokenizer))
    model.save_pretrained(tmp_path / arch)
    tokenizer.save_pretrained(tmp_path / arch)
    loaded, tok = load_checkpoint(tmp_path / arch)
    assert tok.eos_token == EOT and not loaded.training
    ids = sample_ids(len(tokenizer))
    with torch.no_grad():
        reference = model(ids).logits
        assert torch.equal(loaded(ids).logits, reference)

    layers = moe_layers(loaded)
    assert [l.layer_index for l in layers] == EXPECTED_MOE_LAYERS[arch]
    for layer in layers:
        assert layer.w_gate_up is layer.experts.gate_up_proj
        assert layer.w_gate_up.shape == (8, 2 * 16, 32) and layer.w_down.shape == (8, 32, 16)
        assert (layer.shared_expert is not None) == (arch in ("qwen2_moe", "deepseek_v2"))
        assert (layer.shared_expert_gate is not None) == (arch == "qwen2_moe")

    rules = {l.layer_index: l.rule for l in layers}

    def own_rule(layer_index, logits):
        r = rules[layer_index]
        return default_topk(logits, r.top_k, r.norm_topk_prob, scaling=r.scaling, sorted=r.sorted,
                            num_group=r.num_group, topk_group=r.topk_group)

    set_routing(loaded, own_rule)
    assert get_routing(loaded) is own_rule
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference), "default_topk override must be bit-identical"
    set_routing(loaded, None)
    assert get_routing(loaded) is None
    assert all(not l.router._forward_hooks for l in layers)


@pytest.mark.parametrize("arch", ARCHS)
def test_custom_override_changes_experts_and_capture_sees_them(arch, tokenizer):
    model = tiny_hf_model(arch, len(tokenizer))
    ids = sample_ids(len(tokenizer), batch=3, length=10)
    with torch.no_grad(), capture_routing(model, keep_logits=True) as cap:
        reference = model(ids).logits
    free_ids, free_logits = cap.ids(), cap.logits()
    for layer, ids_NK, logits_NE in zip(moe_layers(model), free_ids, free_logits):
        assert ids_NK.shape == (30, 2) and logits_NE.shape == (30, 8)
        expected = layer.topk(logits_NE)[1]
        assert torch.equal(ids_NK.sort(-1).values, expected.sort(-1).values)
    assert (torch.cat(free_ids) >= 4).any(), "random routing should use the upper experts somewhere"

    def lower_half_only(layer_index, logits_TE):
        masked = logits_TE.masked_fill(torch.arange(logits_TE.shape[-1]) >= 4, float("-inf"))
        return default_topk(masked, 2)

    with routing_override(model, lower_half_only), capture_routing(model) as cap:
        out = model(ids)
        out.logits.square().mean().backward()
    assert get_routing(model) is None
    forced = cap.ids()
    assert all(f.shape == (30, 2) and (f < 4).all() for f in forced)
    assert not torch.equal(out.logits.detach(), reference)
    router = moe_layers(model)[0].router_weight
    assert router.grad is not None and router.grad[:4].abs().sum() > 0, "gradients must reach the router"
    with pytest.raises(RuntimeError, match="keep_logits"):
        cap.logits()


def test_capture_excludes_padding_and_checks_mask(tokenizer):
    model = tiny_hf_model("olmoe", len(tokenizer))
    ids = sample_ids(len(tokenizer), batch=2, length=8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad(), capture_routing(model, keep_logits=True) as cap:
        cap.attention_mask = mask
        model(ids, attention_mask=mask)
        assert [t.shape[0] for t in cap.ids()] == [13, 13]
        assert cap.logits()[0].shape == (13, 8)
        cap.clear()
        assert cap.ids()[0].numel() == 0
        cap.attention_mask = torch.ones(3)
        with pytest.raises(ValueError, match="attention_mask has 3 entries"):
            model(ids)
    assert all(not l.experts._forward_pre_hooks for l in moe_layers(model))


def test_load_checkpoint_errors_name_the_path(tokenizer, tmp_path):
    import transformers as tf
    from safetensors.torch import save_file

    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "absent")

    good = tmp_path / "olmoe"
    model = tiny_hf_model("olmoe", len(tokenizer))
    model.save_pretrained(good)
    with pytest.raises(CheckpointError, match="tokenizer cannot be loaded"):
        load_checkpoint(good)
    tokenizer.save_pretrained(good)

    partial = tmp_path / "partial"
    model.save_pretrained(partial)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.layers.1.mlp.gate.weight"}
    save_file(state, partial / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 weights are missing .*layers.1.mlp.gate.weight"):
        load_checkpoint(partial)

    weights = good / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=str(good)):
        load_checkpoint(good)
    weights.unlink()
    with pytest.raises(CheckpointError, match="no weight files"):
        load_checkpoint(good)
    (good / "config.json").write_text("{ truncated")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(good)

    dense = tmp_path / "dense"
    tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2,
    )).save_pretrained(dense)
    with pytest.raises(CheckpointError, match=f"{dense}.*not a Mixture-of-Experts"):
        load_checkpoint(dense)


def test_training_gradients_are_bitwise_reproducible_with_two_threads():
    """Two backward passes of the default-sized model on the same batch give identical gradients
    with 2 CPU threads (the expert gather once used index_put_ accumulation, whose parallel CPU
    kernel adds in a thread-dependent order: runs of the pipeline then drifted apart by step 25)."""
    from occult.config import load_config
    from occult.models.moe import use_grouped_experts

    cfg = load_config(Path(__file__).resolve().parents[2] / "config" / "config.yaml").model
    model = build_tiny_olmoe(cfg, 2048, pad_token_id=0, bos_token_id=1, eos_token_id=1, seed=0)
    use_grouped_experts(model)
    model.train()
    ids = torch.randint(3, 2048, (16, 128), generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for _ in range(3):
            model.zero_grad()
            out = model(input_ids=ids, labels=ids, output_router_logits=True)
            (out.loss + 0.01 * out.aux_loss).backward()
            runs.append([p.grad.clone() for p in model.parameters()])
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_model_code_runs_without_the_ep_runtime_and_the_runtime_registers_its_kernel():
    """occult.models.moe imports nothing of the EP runtime or its kernels; "triton" becomes a choice
    of model.experts_kernel once occult.ep.experts is imported, and until then asking for it names
    the module to import."""
    import subprocess
    import sys

    script = """
import sys
import occult.models.moe as moe
assert not [n for n in sys.modules if n.startswith(("occult.ep", "occult.kernels"))], sorted(sys.modules)
assert list(moe.EXPERTS_KERNELS) == ["grouped"]
from occult.config import ModelConfig
cfg = ModelConfig(source="scratch", checkpoint=None, hidden_size=16, num_layers=1, num_heads=2, num_experts=4,
                  top_k=2, expert_ffn=8, max_seq_len=16)
model = moe.build_tiny_olmoe(cfg, 32, pad_token_id=0, bos_token_id=0, eos_token_id=0, seed=0)
try:
    moe.use_experts_kernel(model, "triton")
except ValueError as err:
    assert "occult.ep.experts" in str(err), err
else:
    raise AssertionError("triton was selectable before occult.ep.experts was imported")
import occult.ep.experts
assert list(moe.EXPERTS_KERNELS) == ["grouped", "triton"]
moe.use_experts_kernel(model, "triton")
assert model.config._experts_implementation == occult.ep.experts.FUSED_IMPLEMENTATION
print("registered")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "registered" in done.stdout
