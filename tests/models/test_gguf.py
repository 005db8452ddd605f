import numpy as np
import pytest

from occult.models.gguf import GGUFError, GGUFReader, find_gguf, gguf_tokenizer
from tests.models.gguf_writer import write_gguf


def test_metadata_and_tensors_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a.f32": (rng.standard_normal((3, 64)).astype(np.float32), "F32"),
        "b.f16": (rng.standard_normal((2, 5, 32)).astype(np.float32), "F16"),
        "c.q8": (rng.standard_normal((4, 96)).astype(np.float32), "Q8_0"),
        "d.q41": (rng.standard_normal((6, 64)).astype(np.float32) * 3 + 1, "Q4_1"),
        "e.q40": (rng.standard_normal((5, 64)).astype(np.float32) * 2 - 1, "Q4_0"),
    }
    meta = {"general.architecture": "llama", "x.count": 7, "x.big": 2**40, "x.eps": 1e-5, "x.flag": True,
            "x.names": ["a", "bé", "c d"], "x.types": np.array([1, 3, 4], dtype=np.int32)}
    expected = write_gguf(tmp_path / "m.gguf", meta, tensors, alignment=64)
    r = GGUFReader(tmp_path / "m.gguf")
    assert r.version == 3
    assert r.field("x.count") == 7 and r.field("x.big") == 2**40 and r.field("x.flag") is True
    assert r.field("x.eps") == pytest.approx(1e-5)
    assert r.field("x.names") == ["a", "bé", "c d"]
    assert r.field("x.types") == [1, 3, 4]
    assert r.field("missing", None) is None
    for name, (x, kind) in tensors.items():
        got = r.tensor(name)
        assert got.shape == x.shape and got.dtype == np.float32
        np.testing.assert_array_equal(got, expected[name])
        assert r.tensors[name].type_name == kind
    # quantisation errors are within half a step of each block
    q4 = r.tensor("d.q41").reshape(-1, 32)
    x4 = tensors["d.q41"][0].reshape(-1, 32)
    step = (x4.max(1) - x4.min(1)) / 15
    assert (np.abs(q4 - x4) <= step[:, None] * 0.51 + 2e-3 * np.abs(x4).max()).all()
    # Q4_0 (a type the reader gets from `gguf`): scale max|x| / 8 per block, error within a step
    q0 = r.tensor("e.q40").reshape(-1, 32)
    x0 = tensors["e.q40"][0].reshape(-1, 32)
    assert (np.abs(q0 - x0) <= np.abs(x0).max(1, keepdims=True) / 8 * 0.51 + 1e-3).all()


def test_q4_1_nibble_order(tmp_path):
    # one block: d = 1, m = -8; byte j holds element j (low nibble) and element j + 16 (high nibble)
    import gguf

    d, m = np.float16(1).tobytes(), np.float16(-8).tobytes()
    qs = bytes((j & 0xF) | (((15 - j) & 0xF) << 4) for j in range(16))
    writer = gguf.GGUFWriter(tmp_path / "n.gguf", "llama")
    writer.add_tensor("q", np.frombuffer(d + m + qs, dtype=np.uint8).reshape(1, 20),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    want = np.array([j - 8 for j in range(16)] + [15 - j - 8 for j in range(16)], dtype=np.float32)
    r = GGUFReader(tmp_path / "n.gguf")
    assert r.tensors["q"].shape == (1, 32) and r.tensors["q"].type_name == "Q4_1"
    np.testing.assert_array_equal(r.tensor("q"), want[None])


def test_bad_files_name_the_file_and_field(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 40)
    with pytest.raises(GGUFError, match="bad.gguf.*not a GGUF"):
        GGUFReader(bad)
    write_gguf(tmp_path / "ok.gguf", {"k": 1}, {"t": (np.ones((2, 32), np.float32), "Q8_0")})
    data = (tmp_path / "ok.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-40])  # 68 bytes of blocks padded to 96
    with pytest.raises(GGUFError, match="cut.gguf: truncated or malformed"):
        GGUFReader(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:30])
    with pytest.raises(GGUFError, match="head.gguf: truncated or malformed"):
        GGUFReader(tmp_path / "head.gguf")
    r = GGUFReader(tmp_path / "ok.gguf")
    with pytest.raises(GGUFError, match="metadata key 'nope' is missing"):
        r.field("nope")
    with pytest.raises(GGUFError, match="no tensor 'u'"):
        r.tensor("u")
    with pytest.raises(GGUFError, match="missing.gguf: no such file"):
        find_gguf(str(tmp_path / "missing.gguf"))
    with pytest.raises(GGUFError, match="model.checkpoint: 'no-such-dist-xyz'"):
        find_gguf("no-such-dist-xyz")


def _byte_level_tokens():
    from tokenizers import pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "1 2"]
    return ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + ["Ġt", "he", "Ġthe", "12"], merges


@pytest.mark.parametrize("pre, digits", [("smollm", ["1", "2", "3"]), ("gpt2", ["12", "3"])])
def test_tokenizer_from_metadata(tmp_path, pre, digits):
    tokens, merges = _byte_level_tokens()
    types = np.array([3, 3, 3] + [1] * (len(tokens) - 3), dtype=np.int32)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    write_gguf(tmp_path / "t.gguf", meta, {"x": (np.zeros((1, 32), np.float32), "F32")})
    tok = gguf_tokenizer(GGUFReader(tmp_path / "t.gguf"))
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>" and tok.pad_token == "<|im_end|>"
    assert len(tok) == len(tokens)
    assert tok.convert_ids_to_tokens(tok(" the", add_special_tokens=False)["input_ids"]) == ["Ġthe"]
    assert tok.convert_ids_to_tokens(tok("123", add_special_tokens=False)["input_ids"]) == digits
    text = "Über 123 the\n\tthe <|im_end|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tokens.index("<|im_end|>") in ids            # control tokens stay whole
    assert tok.decode(ids) == text


def test_tokenizer_rejects_other_models(tmp_path):
    write_gguf(tmp_path / "s.gguf", {"tokenizer.ggml.model": "llama"}, {"x": (np.zeros((1, 32), np.float32), "F32")})
    with pytest.raises(GGUFError, match="tokenizer.ggml.model is 'llama'"):
        gguf_tokenizer(GGUFReader(tmp_path / "s.gguf"))
