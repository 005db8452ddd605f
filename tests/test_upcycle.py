import numpy as np
import pytest
import torch

from occult.gguf import GGUFError
from occult.models import moe_layers
from occult.upcycle import dense_from_gguf, upcycle_gguf
from tests.gguf_writer import write_gguf

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


def _to_gguf(model, path):
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
            b + "attn_q.weight": (_llama_cpp_permute(g(a.q_proj.weight), c.num_attention_heads), "F32"),
            b + "attn_k.weight": (_llama_cpp_permute(g(a.k_proj.weight), c.num_key_value_heads), "F32"),
            b + "attn_v.weight": (g(a.v_proj.weight), "F32"),
            b + "attn_output.weight": (g(a.o_proj.weight), "F32"),
            b + "ffn_gate.weight": (g(m.gate_proj.weight), "F32"),
            b + "ffn_up.weight": (g(m.up_proj.weight), "F32"),
            b + "ffn_down.weight": (g(m.down_proj.weight), "F32"),
        })
    meta = {"general.architecture": "llama", "llama.block_count": c.num_hidden_layers,
            "llama.context_length": 64, "llama.embedding_length": c.hidden_size,
            "llama.feed_forward_length": c.intermediate_size, "llama.attention.head_count": c.num_attention_heads,
            "llama.attention.head_count_kv": c.num_key_value_heads, "llama.rope.freq_base": 1e4,
            "llama.rope.dimension_count": 16, "llama.attention.layer_norm_rms_epsilon": 1e-5}
    write_gguf(path, meta, tensors)


@pytest.mark.parametrize("tied", [True, False])
def test_dense_and_upcycled_models_equal_the_source(tmp_path, tied):
    ref = _reference_llama(tied)
    _to_gguf(ref, tmp_path / "m.gguf")
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
