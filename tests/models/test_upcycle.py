from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from occult.models.gguf import GGUFError
from occult.models.moe import moe_layers
from occult.models.upcycle import dense_from_gguf, upcycle_gguf
from tests.models.gguf_writer import encode_tensor, write_gguf

IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter layout for Q/K rows: per head, rows i and i + hd/2 become adjacent."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _reference_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                      tie_word_embeddings=tied, **IDS)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():          # random norms too, so a norm mix-up shows
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _round_linear_weights(model, kind: str) -> None:
    """Replace every attention and FFN weight by the values it decodes to in `kind`, so that a
    file written in `kind` holds the model exactly (re-quantising decoded blocks is lossless)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in (*(getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.weight.copy_(torch.from_numpy(encode_tensor(lin.weight.numpy(), kind)[1]))


def _to_gguf(model, path, kind: str = "F32"):
    """The llama model as a GGUF file; attention and FFN weights in `kind`."""
    c = model.config
    g = lambda t: t.detach().numpy().astype(np.float32)  # noqa: E731
    tensors = {"token_embd.weight": (g(model.model.embed_tokens.weight), "F32"),
               "output_norm.weight": (g(model.model.norm.weight), "F32")}
    if not c.tie_word_embeddings:
        tensors["output.weight"] = (g(model.lm_head.weight), "F32")
    for i, layer in enumerate(model.model.layers):
        b, a, m = f"blk.{i}.", layer.self_attn, layer.mlp
        tensors.update({
            b + "attn_norm.weight": (g(layer.input_layernorm.weight), "F32"),
            b + "ffn_norm.weight": (g(layer.post_attention_layernorm.weight), "F32"),
            b + "attn_q.weight": (_llama_cpp_permute(g(a.q_proj.weight), c.num_attention_heads), kind),
            b + "attn_k.weight": (_llama_cpp_permute(g(a.k_proj.weight), c.num_key_value_heads), kind),
            b + "attn_v.weight": (g(a.v_proj.weight), kind),
            b + "attn_output.weight": (g(a.o_proj.weight), kind),
            b + "ffn_gate.weight": (g(m.gate_proj.weight), kind),
            b + "ffn_up.weight": (g(m.up_proj.weight), kind),
            b + "ffn_down.weight": (g(m.down_proj.weight), kind),
        })
    meta = {"general.architecture": "llama", "llama.block_count": c.num_hidden_layers,
            "llama.context_length": 64, "llama.embedding_length": c.hidden_size,
            "llama.feed_forward_length": c.intermediate_size, "llama.attention.head_count": c.num_attention_heads,
            "llama.attention.head_count_kv": c.num_key_value_heads, "llama.rope.freq_base": 1e4,
            "llama.rope.dimension_count": 16, "llama.attention.layer_norm_rms_epsilon": 1e-5}
    write_gguf(path, meta, tensors)


@pytest.mark.parametrize("tied, kind", [(True, "F32"), (False, "F32"), (True, "Q4_0"), (False, "Q4_1")])
def test_dense_and_upcycled_models_equal_the_source(tmp_path, tied, kind):
    ref = _reference_llama(tied)
    _round_linear_weights(ref, kind)
    _to_gguf(ref, tmp_path / "m.gguf", kind)
    x = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x).logits
        dense = dense_from_gguf(tmp_path / "m.gguf", max_seq_len=64, token_ids=IDS)
        torch.testing.assert_close(dense(x).logits, want, atol=1e-5, rtol=1e-5)
        moe = upcycle_gguf(tmp_path / "m.gguf", num_experts=16, top_k=4, max_seq_len=64, token_ids=IDS, seed=3).eval()
        torch.testing.assert_close(moe(x).logits, want, atol=1e-4, rtol=1e-4)
    layers = moe_layers(moe)
    assert len(layers) == 2 and layers[0].num_experts == 16 and layers[0].expert_ffn == 24
    assert layers[0].rule.norm_topk_prob        # Mixtral renormalises its top-k
    # the router picks whole virtual groups: expert j belongs to group j % 4
    h = torch.randn(50, 64)
    _, ids = layers[0].topk(layers[0].router(h)[0] if isinstance(layers[0].router(h), tuple) else layers[0].router(h))
    groups = ids % 4
    assert (groups == groups[:, :1]).all()
    assert sorted((ids // 4)[0].tolist()) == [0, 1, 2, 3]   # one copy of every shard


def test_router_noise_breaks_exactness_and_bad_sizes_fail(tmp_path):
    ref = _reference_llama(True)
    _to_gguf(ref, tmp_path / "m.gguf")
    x = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        noisy = upcycle_gguf(tmp_path / "m.gguf", num_experts=16, top_k=4, max_seq_len=64, token_ids=IDS,
                             seed=3, router_noise=5.0).eval()
        assert (noisy(x).logits - ref(x).logits).abs().max() > 1e-3
    with pytest.raises(ValueError, match="model.num_experts: 18 is not a multiple of model.top_k 4"):
        upcycle_gguf(tmp_path / "m.gguf", num_experts=18, top_k=4, max_seq_len=64, token_ids=IDS, seed=0)
    with pytest.raises(ValueError, match="model.top_k: 5 does not divide the dense FFN width 96"):
        upcycle_gguf(tmp_path / "m.gguf", num_experts=20, top_k=5, max_seq_len=64, token_ids=IDS, seed=0)
    write_gguf(tmp_path / "g.gguf", {"general.architecture": "gpt2"}, {"x": (np.zeros((1, 32), np.float32), "F32")})
    with pytest.raises(GGUFError, match="general.architecture is 'gpt2'"):
        upcycle_gguf(tmp_path / "g.gguf", num_experts=16, top_k=4, max_seq_len=64, token_ids=IDS, seed=0)


# --------------------------------------------------------------------------- the pipeline's upcycle path


def _upcycle_config(gguf: Path, steps: int = 6, **model_changes):
    from occult.config import load_config
    repo = Path(__file__).resolve().parents[2]
    model = {"source": "upcycle", "checkpoint": str(gguf), "hidden_size": 64, "num_layers": 2, "num_heads": 4,
             "num_experts": 16, "top_k": 4, "expert_ffn": 24, "max_seq_len": 64, **model_changes}
    return load_config(repo / "config" / "config.yaml", overrides={
        "model": model,
        "pretrain": {"steps": steps, "batch_size": 4, "seq_len": 32, "lr": 1e-3, "warmup_steps": 2,
                     "router_aux_loss": 0.01},
        "placement": {"devices": [2, 4]}, "finetune": {"devices": 4}, "bench": {"devices": 2},
    })


def test_config_checks_the_gguf_sizes(tmp_path):
    from occult.config import ConfigError
    _to_gguf(_reference_llama(True), tmp_path / "m.gguf")
    cfg = _upcycle_config(tmp_path / "m.gguf")
    assert (cfg.num_experts, cfg.top_k) == (16, 4)
    with pytest.raises(ConfigError, match=r"model.expert_ffn: expert_ffn \* top_k = 128, but .*m.gguf gives 96"):
        _upcycle_config(tmp_path / "m.gguf", expert_ffn=32)
    with pytest.raises(ConfigError, match="model.num_layers: 3, but"):
        _upcycle_config(tmp_path / "m.gguf", num_layers=3)
    with pytest.raises(ConfigError, match="nope.gguf: no such file"):
        _upcycle_config(tmp_path / "nope.gguf")


def test_pretrain_continues_from_the_upcycled_model(tmp_path):
    import json

    from occult.models.moe import load_checkpoint
    from occult.stages.pretrain import pretrain
    from tests.models.test_moe import write_standin_data

    data_dir = write_standin_data(tmp_path / "data")
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(data_dir / "tokenizer"))
    ref = _reference_llama(True)
    ref.resize_token_embeddings(vocab)
    _to_gguf(ref, tmp_path / "m.gguf")
    cfg = _upcycle_config(tmp_path / "m.gguf")
    out = tmp_path / "out"
    pretrain(cfg, data_dir, out / "model", out / "log.csv", out / "structure.json")
    model, _ = load_checkpoint(out / "model")
    assert model.config.model_type == "mixtral" and len(moe_layers(model)) == 2
    log = pd.read_csv(out / "log.csv", comment="#")
    assert len(log) == 6 and np.isfinite(log["train_loss"]).all()
    inheritance = json.loads((out / "structure.json").read_text())["inheritance"]
    assert inheritance["before_training"]["basis"] == "inherited"
    assert inheritance["before_training"]["inheritance_index"] == 1.0      # every token in one whole group
    # a tokenizer of another size is refused with the field to fix
    ref.resize_token_embeddings(vocab + 8)
    _to_gguf(ref, tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=r"data.tokenizer_from: the tokenizer has \d+ tokens but"):
        pretrain(cfg, data_dir, out / "model2", out / "log2.csv", out / "structure2.json")


def test_fused_experts_kernel_equals_grouped_on_the_upcycled_model(tmp_path):
    import occult.ep.experts  # noqa: F401  (registers model.experts_kernel "triton")
    from occult.models.moe import use_experts_kernel
    _to_gguf(_reference_llama(True), tmp_path / "m.gguf")
    moe = upcycle_gguf(tmp_path / "m.gguf", num_experts=16, top_k=4, max_seq_len=64, token_ids=IDS, seed=3,
                       router_noise=1.0)
    x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    use_experts_kernel(moe, "grouped")
    loss = moe(x, labels=x).loss
    loss.backward()
    want = (loss.detach(), moe.model.layers[0].mlp.experts.gate_up_proj.grad.clone())
    moe.zero_grad()
    use_experts_kernel(moe, "triton")
    loss = moe(x, labels=x).loss
    loss.backward()
    torch.testing.assert_close(loss.detach(), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moe.model.layers[0].mlp.experts.gate_up_proj.grad, want[1], atol=1e-5, rtol=1e-4)


def test_quality_arms_keep_the_gate_ablation_for_a_renormalising_router(tmp_path):
    """`keep` and `renormalise` differ on a router that normalises its top-k (occult.routing.pruning), so
    the upcycled model gets the ablation arms too."""
    from occult.routing.variants import quality_arms
    _to_gguf(_reference_llama(True), tmp_path / "m.gguf")
    arms = quality_arms(_upcycle_config(tmp_path / "m.gguf"))
    assert {"raw", "sft", "prune1-sim", "prune2-router"} <= {a.variant for a in arms}
    assert {a.name for a in arms if a.gate_weights == "renormalise"} == {"prune2-sim-D4-renormalise-moe",
                                                                         "prune1-sim-D4-renormalise-moe"}


# --------------------------------------------------------------------------- drop-upcycling: no initial groups


def _dense_units(row: torch.Tensor, dense_rows: torch.Tensor) -> list[int]:
    """Units of the dense matrix whose row equals `row` exactly."""
    return torch.nonzero((dense_rows == row).all(dim=1)).flatten().tolist()


def test_drop_upcycling_takes_random_units_and_redraws_a_share_of_each_expert(tmp_path):
    ref = _reference_llama(True)
    _to_gguf(ref, tmp_path / "m.gguf")
    moe = upcycle_gguf(tmp_path / "m.gguf", num_experts=16, top_k=4, max_seq_len=64, token_ids=IDS, seed=5,
                       init="drop", drop_ratio=0.25)
    assert moe.config.occult_upcycle["init"] == "drop" and moe.config.occult_upcycle["drop_ratio"] == 0.25
    mlp, experts = ref.model.layers[1].mlp, moe.model.layers[1].mlp.experts
    unit_sets = []
    for j in range(16):
        gate_up, down = experts.gate_up_proj[j].detach(), experts.down_proj[j].detach()
        kept = []
        for r in range(24):                      # F/k = 96/4 units per expert
            units = _dense_units(gate_up[r], mlp.gate_proj.weight)
            if units:
                (u,) = units
                torch.testing.assert_close(gate_up[24 + r], mlp.up_proj.weight[u], rtol=0, atol=0)
                torch.testing.assert_close(down[:, r], mlp.down_proj.weight[:, u] * 4, rtol=1e-6, atol=1e-7)
                kept.append(u)
        assert len(kept) == 24 - 6 == len(set(kept))      # round(0.25 * 24) units redrawn, the rest dense
        unit_sets.append(frozenset(kept))
    assert len(set(unit_sets)) == 16                      # every expert its own units
    router = moe.model.layers[1].mlp.gate.weight.detach()
    assert torch.cdist(router, router).add(torch.eye(16) * 1e9).min() > 1e-3      # no two router rows tied
    # the redrawn values follow the statistics of what they replace: not copies, same scale
    redrawn = [r for r in range(24) if not _dense_units(experts.gate_up_proj[0][r].detach(), mlp.gate_proj.weight)]
    values = experts.gate_up_proj[0][redrawn].detach()
    assert 0.3 < float(values.std() / mlp.gate_proj.weight.detach().std()) < 3.0


def test_drop_model_keeps_part_of_the_dense_function(tmp_path):
    """Drop-upcycling is not exact: each expert holds a random F/k of the units, so a token's k
    experts cover the FFN unevenly, and a share of each expert is redrawn. The bound tested: the
    next-token distributions move away from the dense model's as more units are redrawn, and at
    drop_ratio 0.5 stay well closer (KL below 0.8 of it; 0.62 +- 0.03 over seeds) than with every
    unit redrawn (drop_ratio 1: the dense model's statistics, none of its knowledge). On
    SmolLM2-135M: dense loss 4.62, drop 0 10.9, drop 0.5 14.8, drop 1 22.2, FFN removed 27.4
    (docs/notes/learned-groups.md)."""
    ref = _reference_llama(True)
    _to_gguf(ref, tmp_path / "m.gguf")
    x = torch.randint(0, 96, (4, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = torch.log_softmax(ref(x).logits, -1)

        def kl_to_dense(ratio: float) -> float:
            moe = upcycle_gguf(tmp_path / "m.gguf", num_experts=16, top_k=4, max_seq_len=64, token_ids=IDS, seed=7,
                               init="drop", drop_ratio=ratio).eval()
            out = moe(x, labels=x)
            assert torch.isfinite(out.loss)
            got = torch.log_softmax(out.logits, -1)
            return float((want.exp() * (want - got)).sum(-1).mean())

        kl = {ratio: kl_to_dense(ratio) for ratio in (0.0, 0.5, 1.0)}
    assert 0 < kl[0.0] < kl[0.5] < 0.8 * kl[1.0], kl


def _routing_of(moe, x: torch.Tensor) -> np.ndarray:
    """[layers, tokens, k] expert ids of `moe`'s routers on the tokens of `x`."""
    from occult.routing.profiling import TokenWindows, route_windows

    windows = TokenWindows(x, torch.ones_like(x), torch.zeros_like(x), ("x",))
    return route_windows(moe, windows, logit_stats=False, desc="test").ids_LNK


def test_drop_routing_starts_near_random_group_structure_and_virtual_groups_do_not(tmp_path):
    """Right after upcycling, on the virtual-group map (expert j in group j mod E/k): virtual groups
    route every token to one whole group (inheritance index 1); drop routing sits at the random value
    (index within 0.05 of 0, main-group share within 0.03 of the exact random expectation)."""
    from occult.routing.inheritance import group_inheritance, group_map_of_model, virtual_group_map

    ref = _reference_llama(True)
    _to_gguf(ref, tmp_path / "m.gguf")
    x = torch.randint(0, 96, (16, 64), generator=torch.Generator().manual_seed(8))
    tables = {}
    for init in ("virtual_groups", "drop"):
        moe = upcycle_gguf(tmp_path / "m.gguf", num_experts=32, top_k=4, max_seq_len=64, token_ids=IDS, seed=9,
                           init=init, drop_ratio=0.5, router_noise=0.0).eval()
        group_of, basis = group_map_of_model(moe.config.to_dict())
        assert np.array_equal(group_of, virtual_group_map(32, 4))
        assert basis == ("inherited" if init == "virtual_groups" else "reference")
        tables[init] = group_inheritance(_routing_of(moe, x), group_of).set_index("layer").loc["mean"]
    assert tables["virtual_groups"]["inheritance_index"] == 1.0
    drop = tables["drop"]
    assert abs(drop["inheritance_index"]) < 0.05
    assert abs(drop["main_group_share"] - drop["main_group_share_random"]) < 0.03


def test_bad_drop_settings_fail_with_their_field(tmp_path):
    _to_gguf(_reference_llama(True), tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="model.upcycle_init: 'copies'"):
        upcycle_gguf(tmp_path / "m.gguf", num_experts=16, top_k=4, max_seq_len=64, token_ids=IDS, seed=0, init="copies")
    with pytest.raises(ValueError, match="model.drop_ratio: 1.5"):
        upcycle_gguf(tmp_path / "m.gguf", num_experts=16, top_k=4, max_seq_len=64, token_ids=IDS, seed=0,
                     init="drop", drop_ratio=1.5)
    from occult.config import ConfigError
    with pytest.raises(ConfigError, match="model.router_noise: only for model.upcycle_init: virtual_groups"):
        _upcycle_config(tmp_path / "m.gguf", upcycle_init="drop", router_noise=1.0)
    with pytest.raises(ConfigError, match="model.upcycle_init: drop needs model.source: upcycle"):
        from occult.config import load_config
        repo = Path(__file__).resolve().parents[2]
        load_config(repo / "config" / "config.yaml", overrides={"model": {"upcycle_init": "drop"}})
    cfg = _upcycle_config(tmp_path / "m.gguf", upcycle_init="drop", drop_ratio=0.25)
    assert (cfg.model.upcycle_init, cfg.model.drop_ratio) == ("drop", 0.25)


def test_pretrain_continues_a_drop_upcycled_model_until_its_target(tmp_path):
    """The pipeline's path for the drop family: upcycled with `drop` from the base model's own seed,
    pre-trained until the held-out perplexity target, saved with its initialisation recorded."""
    import json

    from occult.config import load_config, merge
    from occult.models.moe import load_checkpoint
    from occult.routing.inheritance import group_map_of_model
    from occult.stages.pretrain import pretrain
    from tests.models.test_moe import write_standin_data

    data_dir = write_standin_data(tmp_path / "data")
    from transformers import AutoTokenizer
    ref = _reference_llama(True)
    ref.resize_token_embeddings(len(AutoTokenizer.from_pretrained(data_dir / "tokenizer")))
    _to_gguf(ref, tmp_path / "m.gguf")
    cfg = _upcycle_config(tmp_path / "m.gguf", steps=12, upcycle_init="drop", drop_ratio=0.5)
    cfg = load_config(merge(cfg.raw, {"pretrain": {"seed": 4, "eval_every": 2, "target_heldout_ppl": 1e9}}))
    out = tmp_path / "out"
    pretrain(cfg, data_dir, out / "model", out / "log.csv", out / "structure.json")
    structure = json.loads((out / "structure.json").read_text())
    assert structure["train"]["steps"] == 2 and structure["train"]["reached_target"]       # any perplexity will do
    start = structure["inheritance"]["before_training"]
    assert start["basis"] == "reference" and abs(start["inheritance_index"]) < 0.1
    model, _ = load_checkpoint(out / "model")
    record = model.config.occult_upcycle
    assert (record["init"], record["drop_ratio"], record["seed"]) == ("drop", 0.5, 4)
    assert group_map_of_model(model.config.to_dict())[1] == "reference"
