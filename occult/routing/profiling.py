"""Profile stage: which experts each token selects, and how experts co-activate.

`profile(cfg, model_dir, data_dir, out_dir)` runs the model (eval mode, no grad) on
`cfg.profile.calibration_tokens` tokens of the train split (the calibration set) and
`cfg.profile.heldout_tokens` tokens of the held-out split, packed into windows of
`cfg.profile.seq_len` tokens (documents shuffled with `cfg.seed`, each followed by EOS; the last
window is padded and padding is excluded everywhere). It writes to `out_dir`:

`profile.npz` — statistics of the calibration set, L = MoE layers, E = routed experts:
    coactivation  int64   [L, E, E]  tokens that select both experts i and j (symmetric);
                                     the diagonal is the expert load
    load          int64   [L, E]     tokens that select expert e; sums to tokens * top_k
    logit_gram    float64 [L, E, E]  sum over tokens of z_t z_t^T, z_t = router logits (pre-softmax)
    logit_sum     float64 [L, E]     sum over tokens of z_t
    tokens        int64   []         calibration tokens N (padding excluded)
    layers        int64   [L]        model layer index of each MoE layer (dense layers have none)
    top_k         int64   []         experts per token of the model's own routing
    num_experts   int64   []         E
`routing_calibration.npz`, `routing_heldout.npz` — the routing actually used, token by token:
    ids           int16   [L, N, k]  selected experts per token (after any routing override)
    sources       int16   [N]        index into source_names of the document each token came from
    source_names  str     [S]        corpus source names
    layers        int64   [L]
`profile.json` — provenance, token counts per split and source, and these descriptions.

Counts treat a token's selection as a set: an id repeated within a token, or outside [0, E)
(transformers' "no expert" slot), is counted once or not at all.
"""

from __future__ import annotations

import json
import math
import random
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

import occult.ep.experts  # noqa: F401  (registers model.experts_kernel "triton")
from occult.config import Config
from occult.logs import progress
from occult.models.moe import RoutingFn, capture_routing, load_checkpoint, moe_layers, set_routing
from occult.provenance import atomic_path, provenance, write_json

TOKENS_PER_BATCH = 8192

PROFILE_ARRAYS = {
    "coactivation": "int64 [L,E,E]: tokens selecting both experts i and j; diagonal = load",
    "load": "int64 [L,E]: tokens selecting expert e; sum over e = tokens * top_k",
    "logit_gram": "float64 [L,E,E]: sum over tokens of z z^T of the router logits z (pre-softmax)",
    "logit_sum": "float64 [L,E]: sum over tokens of the router logits",
    "tokens": "int64 scalar: calibration tokens (padding excluded)",
    "layers": "int64 [L]: model layer index of each MoE layer",
    "top_k": "int64 scalar: experts per token",
    "num_experts": "int64 scalar: routed experts E",
}
ROUTING_ARRAYS = {
    "ids": "int16 [L,N,k]: experts each token used, per MoE layer (after any routing override)",
    "sources": "int16 [N]: index into source_names of each token's document",
    "source_names": "str [S]: corpus source names",
    "layers": "int64 [L]: model layer index of each MoE layer",
}


class ProfileError(ValueError):
    """A profile or routing file is missing, truncated or malformed; the message names the file."""


# --------------------------------------------------------------------------- text to token windows


def read_corpus(path: str | Path) -> list[tuple[str, str]]:
    """(source, text) pairs of a jsonl corpus file; errors name the file and line."""
    path = Path(path)
    try:
        # split on "\n" only: str.splitlines() also splits inside JSON strings at U+2028, U+0085
        # and other separators that json.dumps(ensure_ascii=False) leaves raw (ShareGPT has them)
        lines = path.read_text(encoding="utf-8").split("\n")
    except FileNotFoundError:
        raise FileNotFoundError(f"corpus file {path} does not exist") from None
    docs = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str) \
                or not isinstance(record.get("source"), str):
            raise ValueError(f"{path}:{number}: expected an object with string fields 'source' and 'text'")
        if record["text"]:
            docs.append((record["source"], record["text"]))
    if not docs:
        raise ValueError(f"{path}: no documents")
    return docs


def shuffled(items: list, seed: int) -> list:
    out = list(items)
    random.Random(seed).shuffle(out)
    return out


def tokenize_documents(
    docs: list[tuple[str, str]], tokenizer, max_tokens: int | None = None, docs_per_call: int = 512
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Concatenate documents as tokens, each followed by EOS, stopping at `max_tokens`.

    Returns `(token_ids int32 [N], source_index int16 [N], source_names)`.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos_token")
    source_names = tuple(sorted({source for source, _ in docs}))
    source_index = {name: i for i, name in enumerate(source_names)}
    id_chunks, source_chunks, total = [], [], 0
    for start in range(0, len(docs), docs_per_call):
        batch = docs[start:start + docs_per_call]
        encoded = tokenizer([text for _, text in batch], add_special_tokens=False, verbose=False)["input_ids"]
        for (source, _), ids in zip(batch, encoded):
            ids = [*ids, tokenizer.eos_token_id]
            id_chunks.append(np.asarray(ids, dtype=np.int32))
            source_chunks.append(np.full(len(ids), source_index[source], dtype=np.int16))
            total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    ids_N = np.concatenate(id_chunks)[:max_tokens]
    sources_N = np.concatenate(source_chunks)[:max_tokens]
    return ids_N, sources_N, source_names


@dataclass
class TokenWindows:
    """Token windows of one split, padded at the end; `sources_BS` is -1 on padding."""

    input_ids_BS: Tensor
    attention_mask_BS: Tensor
    sources_BS: Tensor
    source_names: tuple[str, ...]

    @property
    def tokens(self) -> int:
        return int(self.attention_mask_BS.sum())

    def sources(self) -> np.ndarray:
        """Source index of every real token, in the order routing is captured."""
        return self.sources_BS[self.attention_mask_BS.bool()].numpy().astype(np.int16)


def pack_windows(
    ids_N: np.ndarray, sources_N: np.ndarray, source_names: tuple[str, ...], seq_len: int, pad_id: int
) -> TokenWindows:
    rows = max(1, math.ceil(len(ids_N) / seq_len))
    input_ids = np.full(rows * seq_len, pad_id, dtype=np.int64)
    sources = np.full(rows * seq_len, -1, dtype=np.int16)
    mask = np.zeros(rows * seq_len, dtype=np.int64)
    input_ids[:len(ids_N)] = ids_N
    sources[:len(ids_N)] = sources_N
    mask[:len(ids_N)] = 1
    return TokenWindows(
        torch.from_numpy(input_ids.reshape(rows, seq_len)),
        torch.from_numpy(mask.reshape(rows, seq_len)),
        torch.from_numpy(sources.reshape(rows, seq_len)),
        source_names,
    )


def corpus_windows(corpus_file: Path, tokenizer, num_tokens: int, seq_len: int, seed: int) -> TokenWindows:
    """The first `num_tokens` tokens of the corpus file's documents in seeded random order."""
    docs = shuffled(read_corpus(corpus_file), seed)
    ids_N, sources_N, names = tokenize_documents(docs, tokenizer, max_tokens=num_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pack_windows(ids_N, sources_N, names, seq_len, pad_id)


# --------------------------------------------------------------------------- routing statistics


@dataclass
class RoutingStats:
    layers: np.ndarray              # int64 [L]
    ids_LNK: np.ndarray             # int16 [L, N, k]
    coactivation_LEE: np.ndarray    # int64
    load_LE: np.ndarray             # int64
    logit_gram_LEE: np.ndarray      # float64 (zeros when logit statistics were not asked for)
    logit_sum_LE: np.ndarray        # float64
    tokens: int
    top_k: int
    num_experts: int


def selection_matrix(ids_NK: Tensor, num_experts: int) -> Tensor:
    """Multi-hot [N, E] float64: 1 where the token selected the expert (set semantics)."""
    ids_NK = torch.where((ids_NK < 0) | (ids_NK >= num_experts), num_experts, ids_NK).long()
    hot_NE = torch.zeros(ids_NK.shape[0], num_experts + 1, dtype=torch.float64)
    hot_NE.scatter_(1, ids_NK, 1.0)
    return hot_NE[:, :num_experts]


def coactivation_counts(ids_NK: Tensor, num_experts: int) -> np.ndarray:
    """Pair counts [E, E] int64: tokens selecting both i and j; the diagonal is the load."""
    hot_NE = selection_matrix(ids_NK, num_experts)
    return torch.round(hot_NE.T @ hot_NE).to(torch.int64).numpy()


@torch.no_grad()
def route_windows(
    model: nn.Module, windows: TokenWindows, *, logit_stats: bool = True, desc: str = "route"
) -> RoutingStats:
    """Run `model` over `windows` and collect the routing of every real token."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__}: no MoE layers to profile")
    num_experts, top_k = layers[0].num_experts, layers[0].top_k
    L, E = len(layers), num_experts
    coactivation = np.zeros((L, E, E), dtype=np.int64)
    gram = torch.zeros(L, E, E, dtype=torch.float64)
    logit_sum = torch.zeros(L, E, dtype=torch.float64)
    ids_chunks: list[list[Tensor]] = [[] for _ in layers]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    rows = windows.input_ids_BS.shape[0]
    batch_rows = max(1, TOKENS_PER_BATCH // windows.input_ids_BS.shape[1])
    try:
        routed_tokens = 0
        with capture_routing(model, keep_logits=logit_stats) as cap:
            bar = progress(range(0, rows, batch_rows), desc=desc, unit="batch", leave=False)
            for start in bar:
                input_ids = windows.input_ids_BS[start:start + batch_rows].to(device)
                mask = windows.attention_mask_BS[start:start + batch_rows].to(device)
                cap.clear()
                cap.attention_mask = mask
                model(input_ids=input_ids, attention_mask=mask, use_cache=False)
                for l, ids_NK in enumerate(cap.ids()):
                    ids_chunks[l].append(ids_NK.to(torch.int16))
                    coactivation[l] += coactivation_counts(ids_NK, num_experts)
                if logit_stats:
                    for l, z_NE in enumerate(cap.logits()):
                        z_NE = z_NE.double()
                        gram[l] += z_NE.T @ z_NE
                        logit_sum[l] += z_NE.sum(0)
                routed_tokens += int(mask.sum())
                bar.log(tokens=routed_tokens)
    finally:
        model.train(was_training)
    ids_LNK = torch.stack([torch.cat(chunks) for chunks in ids_chunks]).numpy()
    if ids_LNK.shape[1] != windows.tokens:
        raise RuntimeError(f"captured {ids_LNK.shape[1]} tokens, expected {windows.tokens}")
    return RoutingStats(
        layers=np.asarray([layer.layer_index for layer in layers], dtype=np.int64),
        ids_LNK=ids_LNK,
        coactivation_LEE=coactivation,
        load_LE=np.stack([np.diag(c) for c in coactivation]).astype(np.int64),
        logit_gram_LEE=gram.numpy(),
        logit_sum_LE=logit_sum.numpy(),
        tokens=windows.tokens,
        top_k=top_k,
        num_experts=num_experts,
    )


def expert_similarity(
    logit_gram: np.ndarray, logit_sum: np.ndarray, tokens: int, centred: bool = False
) -> np.ndarray:
    """Cosine similarity [L, E, E] between experts' router-logit columns over the calibration tokens.

    Uncentred by default: cos(i, j) = G_ij / sqrt(G_ii G_jj) with G = sum_t z_t z_t^T.
    `centred=True` subtracts each column's mean first (the Pearson correlation of the logits).
    A column of zero norm has similarity 0 with every other expert; the diagonal is 1.
    """
    gram = np.asarray(logit_gram, dtype=np.float64)
    if centred:
        mean = np.asarray(logit_sum, dtype=np.float64) / max(tokens, 1)
        gram = gram - tokens * mean[..., :, None] * mean[..., None, :]
    norm = np.sqrt(np.clip(np.diagonal(gram, axis1=-2, axis2=-1), 0.0, None))
    denom = norm[..., :, None] * norm[..., None, :]
    with np.errstate(invalid="ignore", divide="ignore"):
        sim = np.where(denom > 0, gram / np.where(denom > 0, denom, 1.0), 0.0)
    sim = np.clip(sim, -1.0, 1.0)
    E = sim.shape[-1]
    sim[..., np.arange(E), np.arange(E)] = 1.0
    return sim


# --------------------------------------------------------------------------- files


def _save_npz(path: Path, arrays: dict[str, Any]) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        np.savez(handle, **arrays)


def save_profile(path: Path, stats: RoutingStats) -> None:
    _save_npz(path, {
        "coactivation": stats.coactivation_LEE,
        "load": stats.load_LE,
        "logit_gram": stats.logit_gram_LEE,
        "logit_sum": stats.logit_sum_LE,
        "tokens": np.int64(stats.tokens),
        "layers": stats.layers,
        "top_k": np.int64(stats.top_k),
        "num_experts": np.int64(stats.num_experts),
    })


def save_routing(path: Path, stats: RoutingStats, windows: TokenWindows) -> None:
    _save_npz(path, {
        "ids": stats.ids_LNK,
        "sources": windows.sources(),
        "source_names": np.asarray(windows.source_names, dtype=str),
        "layers": stats.layers,
    })


@dataclass(frozen=True)
class Profile:
    """A validated `profile.npz` (see the module docstring for the arrays)."""

    coactivation: np.ndarray
    load: np.ndarray
    logit_gram: np.ndarray
    logit_sum: np.ndarray
    tokens: int
    layers: np.ndarray
    top_k: int
    num_experts: int

    def similarity(self, centred: bool = False) -> np.ndarray:
        return expert_similarity(self.logit_gram, self.logit_sum, self.tokens, centred)


@dataclass(frozen=True)
class RoutingRecord:
    """A validated `routing_*.npz`."""

    ids: np.ndarray
    sources: np.ndarray
    source_names: tuple[str, ...]
    layers: np.ndarray


def _read_npz(path: Path, required: dict[str, str]) -> dict[str, np.ndarray]:
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"{path}: file does not exist")
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = sorted(set(required) - set(npz.files))
            if missing:
                raise ProfileError(f"{path}: missing arrays {missing}")
            return {name: npz[name] for name in required}
    except ProfileError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError) as err:
        raise ProfileError(f"{path}: unreadable or truncated npz ({type(err).__name__}: {err})") from None


def _check(path: Path, name: str, array: np.ndarray, kinds: str, shape: tuple[int | None, ...]) -> None:
    if array.dtype.kind not in kinds:
        raise ProfileError(f"{path}: array {name!r} has dtype {array.dtype}, expected kind {kinds!r}")
    if array.ndim != len(shape) or any(s is not None and s != a for s, a in zip(shape, array.shape)):
        want = "[" + ", ".join("?" if s is None else str(s) for s in shape) + "]"
        raise ProfileError(f"{path}: array {name!r} has shape {list(array.shape)}, expected {want}")


def load_profile(path: str | Path) -> Profile:
    """Read and validate `profile.npz`; raises `ProfileError` naming the file."""
    path = Path(path)
    a = _read_npz(path, PROFILE_ARRAYS)
    for name in ("tokens", "top_k", "num_experts"):
        _check(path, name, a[name], "iu", ())
    _check(path, "layers", a["layers"], "iu", (None,))
    L, E = len(a["layers"]), int(a["num_experts"])
    _check(path, "coactivation", a["coactivation"], "i", (L, E, E))
    _check(path, "load", a["load"], "i", (L, E))
    _check(path, "logit_gram", a["logit_gram"], "f", (L, E, E))
    _check(path, "logit_sum", a["logit_sum"], "f", (L, E))
    diag = np.diagonal(a["coactivation"], axis1=1, axis2=2)
    if not np.array_equal(diag, a["load"]):
        raise ProfileError(f"{path}: the diagonal of 'coactivation' differs from 'load'")
    return Profile(
        coactivation=a["coactivation"].astype(np.int64), load=a["load"].astype(np.int64),
        logit_gram=a["logit_gram"].astype(np.float64), logit_sum=a["logit_sum"].astype(np.float64),
        tokens=int(a["tokens"]), layers=a["layers"].astype(np.int64),
        top_k=int(a["top_k"]), num_experts=E,
    )


def load_routing(path: str | Path) -> RoutingRecord:
    """Read and validate a `routing_*.npz`; raises `ProfileError` naming the file."""
    path = Path(path)
    a = _read_npz(path, ROUTING_ARRAYS)
    _check(path, "layers", a["layers"], "iu", (None,))
    _check(path, "ids", a["ids"], "iu", (len(a["layers"]), None, None))
    _check(path, "sources", a["sources"], "iu", (a["ids"].shape[1],))
    _check(path, "source_names", a["source_names"], "U", (None,))
    if len(a["sources"]) and (a["sources"].min() < 0 or a["sources"].max() >= len(a["source_names"])):
        raise ProfileError(f"{path}: 'sources' indexes outside 'source_names'")
    return RoutingRecord(a["ids"], a["sources"], tuple(str(s) for s in a["source_names"]), a["layers"])


SAMPLE_STRETCHES = 16    # runs of consecutive tokens in a routing sample (the placement study's bootstrap blocks)


def spread_indices(total: int, tokens: int, stretches: int = SAMPLE_STRETCHES) -> np.ndarray:
    """The indices of `tokens` of `total` tokens taken as `stretches` runs of consecutive tokens
    spread evenly over all of them (the first run starts at 0, the last ends at `total`; the first
    `tokens % stretches` runs are one token longer): a sample whose mix of documents and sources
    follows the whole split's, where its first tokens hold only its first documents. All tokens
    where `tokens >= total`."""
    if tokens >= total:
        return np.arange(total, dtype=np.int64)
    stretches = max(1, min(stretches, tokens))
    lengths = np.array([tokens // stretches + (i < tokens % stretches) for i in range(stretches)])
    gaps = (np.arange(stretches) * (total - tokens)) // max(1, stretches - 1)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) + gaps
    return np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lengths)]).astype(np.int64)


def sample_routing(src: str | Path, dst: str | Path, tokens: int, stretches: int = SAMPLE_STRETCHES) -> RoutingRecord:
    """Save `tokens` tokens of the routing file `src` to `dst` as `stretches` runs of consecutive
    tokens spread evenly over the whole file (`spread_indices`; 1: its first tokens), compressed
    and in the smallest integer types: a real trace small enough to come back from a GPU machine
    (16,384 tokens of a 30-layer top-8 model: about 3 MB) whose sources are mixed as in the whole
    split. `dst` reads back with `load_routing`."""
    if tokens < 1:
        raise ValueError(f"sample_routing: tokens={tokens} must be at least 1")
    if stretches < 1:
        raise ValueError(f"sample_routing: stretches={stretches} must be at least 1")
    record = load_routing(src)
    keep = spread_indices(record.ids.shape[1], tokens, stretches)
    ids = record.ids[:, keep]
    sources = record.sources[keep]

    def smallest(array: np.ndarray) -> np.ndarray:
        return array.astype(np.uint8 if array.size == 0 or (array.min() >= 0 and array.max() < 256) else np.int32)

    with atomic_path(Path(dst)) as tmp, open(tmp, "wb") as handle:
        np.savez_compressed(handle, ids=smallest(ids), sources=smallest(sources),
                            source_names=np.asarray(record.source_names, dtype=str), layers=record.layers)
    return RoutingRecord(ids, sources, record.source_names, record.layers)


# --------------------------------------------------------------------------- the stage


def profile(
    cfg: Config,
    model_dir: Path,
    data_dir: Path,
    out_dir: Path,
    *,
    routing: RoutingFn | None = None,
    device: str | None = None,
) -> None:
    """Profile `model_dir` on the calibration (train) and held-out splits of `data_dir`.

    `routing` (optional) is set with `models.set_routing` for the whole run, so the profile
    describes the overridden routing (for example a pruned one). `device` defaults to CUDA when
    available.
    """
    model_dir, data_dir, out_dir = Path(model_dir), Path(data_dir), Path(out_dir)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_checkpoint(model_dir, device=device, experts_kernel=cfg.model.experts_kernel)
    set_routing(model, routing)
    corpus = data_dir / "corpus"
    splits = {
        "calibration": (corpus / "train.jsonl", cfg.profile.calibration_tokens),
        "heldout": (corpus / "heldout.jsonl", cfg.profile.heldout_tokens),
    }
    summary: dict[str, Any] = {}
    model_facts: dict[str, Any] = {}
    for split, (corpus_file, num_tokens) in splits.items():
        windows = corpus_windows(corpus_file, tokenizer, num_tokens, cfg.profile.seq_len, cfg.seed)
        stats = route_windows(model, windows, logit_stats=split == "calibration", desc=f"profile {split}")
        if split == "calibration":
            save_profile(out_dir / "profile.npz", stats)
            model_facts = {"layers": stats.layers.tolist(), "top_k": stats.top_k, "num_experts": stats.num_experts}
        save_routing(out_dir / f"routing_{split}.npz", stats, windows)
        per_source = np.bincount(windows.sources(), minlength=len(windows.source_names))
        summary[split] = {
            "corpus": str(corpus_file),
            "tokens_requested": num_tokens,
            "tokens": windows.tokens,
            "tokens_per_source": dict(zip(windows.source_names, per_source.tolist())),
        }
        if windows.tokens < num_tokens:
            summary[split]["note"] = "the corpus file holds fewer tokens than requested; all were used"
    set_routing(model, None)
    write_json(out_dir / "profile.json", {
        "provenance": provenance(cfg.hash(), cfg.seed, stage="profile"),
        "model_dir": str(model_dir),
        "data_dir": str(data_dir),
        "seq_len": cfg.profile.seq_len,
        "routing_override": None if routing is None else getattr(routing, "__qualname__", repr(routing)),
        **model_facts,
        "splits": summary,
        "files": {
            "profile.npz": {"split": "calibration", "arrays": PROFILE_ARRAYS},
            "routing_calibration.npz": {"split": "calibration", "arrays": ROUTING_ARRAYS},
            "routing_heldout.npz": {"split": "heldout", "arrays": ROUTING_ARRAYS},
        },
        "similarity": "occult.routing.profiling.expert_similarity: cosine of router-logit columns, uncentred by default",
    })
