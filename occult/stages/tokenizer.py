"""The tokenizer of the data stage: a byte-level BPE trained on the train split, or the one a GGUF
file carries (`data.tokenizer_from`, for a model upcycled from that file)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable

from occult.provenance import atomic_path
from occult.stages.corpus import DataError

ENDOFTEXT = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenisation) trained on `texts`, wrapped for transformers.
    `<|endoftext|>` is token 0 and serves as bos, eos and pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


def gguf_tokenizer_for(locator: str):
    """`(tokenizer, manifest entry)` for `data.tokenizer_from`: the BPE stored in a GGUF file."""
    from occult.models.gguf import GGUFError, GGUFReader, find_gguf, gguf_tokenizer

    try:
        path = find_gguf(locator)
        tokenizer = gguf_tokenizer(GGUFReader(path))
    except GGUFError as err:
        raise DataError(f"data.tokenizer_from: {err}") from None
    info = {"kind": "byte-level BPE from GGUF metadata", "from": locator, "file": path.name,
            "vocab_size": len(tokenizer), "bos": tokenizer.bos_token, "eos": tokenizer.eos_token,
            "pad": tokenizer.pad_token, "path": "tokenizer"}
    return tokenizer, info


def save_tokenizer(tokenizer, dest: Path) -> None:
    with atomic_path(dest) as tmp:
        tokenizer.save_pretrained(str(tmp))
        if dest.exists():
            shutil.rmtree(dest)


def count_tokens(tokenizer, texts: list[str]) -> int:
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    return sum(len(e.ids) for e in encodings)
