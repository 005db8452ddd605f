"""The data stage on a tiny configuration: splits, tokenizer, instruction pairs, eval sets, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from occult.config import DataConfig
from occult.stages.corpus import SOURCES, DataError
from occult.stages.data import build_data
from occult.stages.eval_sets import EVAL_FIELDS

CAP = 20_000
TINY = DataConfig(
    sources=("chitchat", "kjv", "pydoc"),
    max_chars_per_source=CAP,
    heldout_fraction=0.2,
    vocab_size=400,
    instruction_pairs=50,
    eval_tasks=tuple(EVAL_FIELDS),
    eval_examples=5,
)
OUTPUT_FILES = ["corpus/train.jsonl", "corpus/heldout.jsonl", "instructions.jsonl", "tokenizer/tokenizer.json",
                *[f"eval/{task}.jsonl" for task in EVAL_FIELDS]]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("data")
    return out, build_data(TINY, 0, out)


@pytest.fixture(scope="module")
def corpus(built) -> dict[str, list[dict]]:
    out, _ = built
    return {split: read_jsonl(out / "corpus" / f"{split}.jsonl") for split in ("train", "heldout")}


def test_every_source_in_both_splits_within_the_cap(built, corpus):
    _, manifest = built
    for source in TINY.sources:
        docs = {split: [d for d in corpus[split] if d["source"] == source] for split in corpus}
        assert docs["train"] and docs["heldout"], source
        chars = sum(len(d["text"]) for split in docs for d in docs[split])
        assert 0.5 * CAP < chars <= CAP, (source, chars)
        assert manifest["sources"][source]["documents"] == {s: len(docs[s]) for s in docs}
        assert manifest["sources"][source]["licence"] == SOURCES[source].licence
        assert manifest["sources"][source]["tokens"]["train"] > 0
    assert manifest["provenance"]["seed"] == 0


def test_splits_are_disjoint_documents(corpus):
    train_ids = {d["id"] for d in corpus["train"]}
    heldout_ids = {d["id"] for d in corpus["heldout"]}
    assert not train_ids & heldout_ids
    assert len(train_ids) == len(corpus["train"]) and len(heldout_ids) == len(corpus["heldout"])
    assert not {d["text"] for d in corpus["train"]} & {d["text"] for d in corpus["heldout"]}
    assert set(corpus["train"][0]) == {"source", "id", "text"}


def test_tokenizer_loads_offline_and_round_trips(built, corpus):
    from transformers import AutoTokenizer

    out, manifest = built
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    assert len(tok) == TINY.vocab_size == manifest["tokenizer"]["vocab_size"]
    assert tok.bos_token == tok.eos_token == tok.pad_token == "<|endoftext|>"
    samples = [d["text"] for d in corpus["heldout"][:5]] + ["  Tabs\tand ünïcode — 😀 x=1;\n\n end "]
    for text in samples:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    # merges were learned: training text compresses well below one token per byte
    text = "\n".join(d["text"] for d in corpus["train"])
    assert len(tok(text)["input_ids"]) < 0.7 * len(text.encode())


def test_instruction_pairs_come_from_train_documents_only(built, corpus):
    out, manifest = built
    pairs = read_jsonl(out / "instructions.jsonl")
    assert len(pairs) == TINY.instruction_pairs == manifest["instructions"]["produced"]
    train = {d["id"]: d["text"] for d in corpus["train"]}
    heldout = {d["id"] for d in corpus["heldout"]}
    for pair in pairs:
        assert pair["instruction"] and pair["response"]
        assert pair["doc_id"] in train and pair["doc_id"] not in heldout
        assert pair["doc_id"].startswith(pair["source"] + ":")
        if pair["template"] == "verse_book":       # the answer is a reference: "<Book> c:v"
            assert train[pair["doc_id"]].split("\n", 1)[0].split(" ")[0] in pair["response"]
        else:
            assert pair["response"] in train[pair["doc_id"]], pair
    per_source = {s: sum(p["source"] == s for p in pairs) for s in TINY.sources}
    assert max(per_source.values()) - min(per_source.values()) <= 1, per_source


def test_eval_files_have_normalised_fields_and_counts(built):
    out, manifest = built
    for task, fields in EVAL_FIELDS.items():
        rows = read_jsonl(out / "eval" / f"{task}.jsonl")
        assert len(rows) == TINY.eval_examples == manifest["eval"]["tasks"][task]["examples"]
        for row in rows:
            assert tuple(row) == fields, task
            assert isinstance(row["label"], int) and row["label"] >= 0
            n_choices = len(row["choices"]) if "choices" in row else 2
            assert row["label"] < n_choices
        assert len({r["id"] for r in rows}) == len(rows)
    winogrande = read_jsonl(out / "eval" / "winogrande.jsonl")
    assert all(r["sentence"].count("_") == 1 for r in winogrande)


def test_same_seed_gives_identical_files_other_seed_differs(built, tmp_path):
    out, _ = built
    again = tmp_path / "again"
    build_data(TINY, 0, again)
    for name in OUTPUT_FILES:
        assert (out / name).read_bytes() == (again / name).read_bytes(), name
    other = tmp_path / "other"
    build_data(TINY, 1, other)
    assert (out / "corpus/train.jsonl").read_bytes() != (other / "corpus/train.jsonl").read_bytes()
    assert (out / "eval/piqa.jsonl").read_bytes() != (other / "eval/piqa.jsonl").read_bytes()


def test_unknown_task_or_source_is_a_clear_error(tmp_path):
    import dataclasses

    with pytest.raises(DataError, match=r"data\.eval_tasks: unknown task 'race'"):
        build_data(dataclasses.replace(TINY, eval_tasks=("piqa", "race")), 0, tmp_path)
    with pytest.raises(DataError, match=r"data\.sources"):
        build_data(dataclasses.replace(TINY, sources=("kjv", "alpaca")), 0, tmp_path)
    assert not (tmp_path / "corpus").exists()
