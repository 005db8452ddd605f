"""Instruction pairs of the data stage, built from train documents only: per source, templates over
the structured pieces of each document (chat turns, verses, docstrings, first requests), mixed
round-robin across sources and seeded."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from occult.stages.corpus import Document, rng_for

PAIR_MIN_CHARS = 10
PAIR_MAX_CHARS = 600
VERSE_MIN_WORDS = 8


@dataclass(frozen=True)
class Pair:
    instruction: str
    response: str
    source: str
    template: str
    doc_id: str


def _fits(*texts: str) -> bool:
    return all(PAIR_MIN_CHARS <= len(t) <= PAIR_MAX_CHARS for t in texts)


def chitchat_pairs(doc: Document, rng: random.Random) -> list[Pair]:
    """message -> reply, from consecutive turns (different speakers) of one conversation."""
    turns = [text for _, _, text in doc.units if text in doc.text]
    return [
        Pair(message, reply, doc.source, "chat_reply", doc.doc_id)
        for message, reply in zip(turns, turns[1:])
        if _fits(message, reply)
    ]


def kjv_pairs(doc: Document, rng: random.Random) -> list[Pair]:
    """Per verse, one of: continue the verse from its first half; name the book it is from."""
    pairs = []
    for _, ref, verse in doc.units:
        words = verse.split(" ")
        if len(words) < VERSE_MIN_WORDS or verse not in doc.text or len(verse) > PAIR_MAX_CHARS:
            continue
        if rng.random() < 0.5:
            half = len(words) // 2
            first, second = " ".join(words[:half]), " ".join(words[half:])
            pairs.append(Pair(f"Continue this verse from {ref}: {first}", second, doc.source,
                              "verse_continuation", doc.doc_id))
        else:
            pairs.append(Pair(f'Which book of the King James Bible is this verse from? "{verse}"', ref,
                              doc.source, "verse_book", doc.doc_id))
    return pairs


PYDOC_QUESTIONS = {
    "module": "What is the Python module `{name}` for?",
    "class": "What is the Python class `{name}` for?",
    "function": "What does the Python function `{name}` do?",
    "method": "What does the Python method `{name}` do?",
}


def pydoc_pairs(doc: Document, rng: random.Random) -> list[Pair]:
    """`What does the Python function mod.func do?` -> the first paragraph of its docstring."""
    pairs = []
    for kind, name, docstring in doc.units:
        paragraph = docstring.split("\n\n", 1)[0].strip()
        if len(paragraph) < 20 or len(paragraph) > PAIR_MAX_CHARS or paragraph not in doc.text:
            continue
        pairs.append(Pair(PYDOC_QUESTIONS[kind].format(name=name), paragraph, doc.source,
                          f"pydoc_{kind}", doc.doc_id))
    return pairs


SHAREGPT_MAX_RESPONSE_CHARS = 1500


def sharegpt_pairs(doc: Document, rng: random.Random) -> list[Pair]:
    """The conversation's first request -> the assistant's reply (an instruction-following pair)."""
    if len(doc.units) < 2 or doc.units[0][1] != "User" or doc.units[1][1] == "User":
        return []
    request, reply = doc.units[0][2], doc.units[1][2]
    if not (PAIR_MIN_CHARS <= len(request) <= PAIR_MAX_CHARS and PAIR_MIN_CHARS <= len(reply) <= SHAREGPT_MAX_RESPONSE_CHARS):
        return []
    if request not in doc.text or reply not in doc.text:          # cut by the cap
        return []
    return [Pair(request, reply, doc.source, "sharegpt_first_turn", doc.doc_id)]


PAIR_BUILDERS: dict[str, Callable[[Document, random.Random], list[Pair]]] = {
    "chitchat": chitchat_pairs,
    "kjv": kjv_pairs,
    "pydoc": pydoc_pairs,
    "sharegpt": sharegpt_pairs,
}


def build_instruction_pairs(train_docs: dict[str, list[Document]], count: int, seed: int) -> list[Pair]:
    """`count` pairs drawn round-robin from the sources (evenly while each lasts), seeded.
    Only the given (train) documents are used; an instruction appears at most once."""
    queues: dict[str, list[Pair]] = {}
    for source, docs in train_docs.items():
        rng = rng_for(seed, "pairs", source)
        seen: set[str] = set()
        candidates = []
        for doc in docs:
            for pair in PAIR_BUILDERS[source](doc, rng):
                if pair.instruction not in seen:
                    seen.add(pair.instruction)
                    candidates.append(pair)
        rng.shuffle(candidates)
        queues[source] = candidates
    chosen: list[Pair] = []
    depth = 0
    while len(chosen) < count and any(depth < len(q) for q in queues.values()):
        for source in sorted(queues):
            if depth < len(queues[source]) and len(chosen) < count:
                chosen.append(queues[source][depth])
        depth += 1
    rng_for(seed, "pairs", "mix").shuffle(chosen)
    return chosen
