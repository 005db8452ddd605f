"""Instruction pairs: the seeded round-robin mix over sources."""

from __future__ import annotations

from occult.stages.corpus import Document
from occult.stages.instructions import Pair, build_instruction_pairs


def test_pairs_mix_evenly_and_stop_when_sources_run_out():
    verses = tuple(("verse", f"Genesis 1:{v}", f"and the word number {v} was spoken over all the waters")
                   for v in range(1, 4))
    kjv = Document("kjv", "kjv:1", "\n".join(text for _, _, text in verses), verses)
    turns = tuple(("turn", str(i), f"this is chat message number {i}") for i in range(40))
    chat = Document("chitchat", "chitchat:x", "\n".join(f"A: {t}" for _, _, t in turns), turns)
    pairs = build_instruction_pairs({"kjv": [kjv], "chitchat": [chat]}, 20, seed=0)
    assert len(pairs) == 20
    assert sum(p.source == "kjv" for p in pairs) == 3          # all that kjv has; chat fills the rest
    assert all(isinstance(p, Pair) for p in pairs)
    everything = build_instruction_pairs({"kjv": [kjv], "chitchat": [chat]}, 1000, seed=0)
    assert len(everything) == 3 + 39                              # fewer than asked: sources ran out
    assert pairs == build_instruction_pairs({"kjv": [kjv], "chitchat": [chat]}, 20, seed=0)
