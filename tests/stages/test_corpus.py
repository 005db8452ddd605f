"""The corpus: capping a source's documents and the seeded train/heldout split."""

from __future__ import annotations

from occult.stages.corpus import Document, cap_documents, rng_for, split_documents


def _doc(i: int, size: int) -> Document:
    return Document("kjv", f"kjv:{i}", ("line\n" * size)[:size])


def test_cap_keeps_whole_documents_and_cuts_the_last_at_a_line_break():
    docs = [_doc(i, 1000) for i in range(10)]
    kept = cap_documents(iter(docs), 3500)
    assert [d.doc_id for d in kept] == ["kjv:0", "kjv:1", "kjv:2", "kjv:3"]
    assert len(kept[-1].text) <= 500 and kept[-1].text.endswith("line")
    assert sum(len(d.text) for d in kept) <= 3500
    assert len(cap_documents(iter(docs), 3100)) == 3          # a 100-char remainder is dropped


def test_split_is_seeded_and_keeps_both_sides():
    docs = [_doc(i, 10) for i in range(40)]
    a = split_documents(docs, 0.1, rng_for(0, "split"))
    b = split_documents(docs, 0.1, rng_for(0, "split"))
    c = split_documents(docs, 0.1, rng_for(1, "split"))
    assert len(a["heldout"]) == 4 and len(a["train"]) == 36
    assert a == b and a["heldout"] != c["heldout"]
    tiny = split_documents(docs[:2], 0.01, rng_for(0, "split"))
    assert len(tiny["train"]) == len(tiny["heldout"]) == 1
