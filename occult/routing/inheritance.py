"""How much of a model's routing still follows the expert groups it was initialised with.

An MoE upcycled with virtual groups (`occult.models.upcycle`, `model.upcycle_init: virtual_groups`)
starts with E/k groups of k experts, each group holding the whole dense FFN, and tied router rows
inside a group, so every token picks one whole group. If continued pre-training leaves that
structure in place, a placement that keeps each group on one device makes pruning to N_d = 1 nearly
lossless (the kept experts are the dense FFN), which says nothing about a model that learned its
co-activation from scratch.

Per MoE layer, over the tokens of a routing trace ([N, k] expert ids):

- `groups_spanned`: the mean number of distinct groups among a token's k experts;
- `main_group_share`: the mean share of a token's k experts that sit in its most used group;
- both for *random routing* (k distinct experts drawn uniformly: exact expectations,
  `random_routing_expectation`) and for a *load-matched null* (k distinct experts per token by
  Gumbel-top-k with weights equal to the layer's observed expert loads, independent across tokens:
  Monte-Carlo with a fixed seed, `load_matched_null`), which keeps any effect of unequal loads;
- `inheritance_index` = (main_group_share - random) / (1 - random): 0 for routing that ignores the
  groups, 1 when every token stays in one group.

The group map (`group_map_of_model`): expert j is in group j mod (E/k), the map virtual-group
upcycling builds. For such a model the groups are inherited (`basis = inherited`). A model upcycled
with `drop` (random unit subsets, independent router rows) or trained from scratch has no initial
groups; its table is computed against the same map as a control (`basis = reference`), where the
metric should sit at the random value.

    python -m occult.routing.inheritance --routing R.npz [R2.npz ...] --model-config config.json --out T.csv
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from occult.logs import ENV_LOG_JSON, run_main

NULL_SEED = 0
BASES = ("inherited", "reference")
COLUMNS = ["split", "layer", "tokens", "top_k", "groups", "basis", "groups_spanned", "groups_spanned_random",
           "groups_spanned_load_null", "main_group_share", "main_group_share_random",
           "main_group_share_load_null", "inheritance_index"]


def virtual_group_map(num_experts: int, top_k: int) -> np.ndarray:
    """Group of each expert under virtual-group upcycling: expert j in group j mod (E / k)."""
    if top_k < 1 or num_experts % top_k:
        raise ValueError(f"num_experts {num_experts} is not a multiple of top_k {top_k}: no virtual-group map")
    return np.arange(num_experts) % (num_experts // top_k)


def _check_map(group_of_expert_E: np.ndarray) -> np.ndarray:
    groups = np.asarray(group_of_expert_E)
    if groups.ndim != 1 or len(groups) == 0 or groups.dtype.kind not in "iu" or groups.min() < 0:
        raise ValueError("group_of_expert_E: expected a non-empty 1-d array of group numbers >= 0")
    return groups.astype(np.int64)


def token_group_stats(ids_NK: np.ndarray, group_of_expert_E: np.ndarray) -> tuple[float, float]:
    """(mean groups spanned, mean main-group share) of the tokens of one layer's routing [N, k]."""
    groups = _check_map(group_of_expert_E)
    ids = np.asarray(ids_NK, dtype=np.int64)
    if ids.ndim != 2 or ids.shape[0] == 0:
        raise ValueError(f"ids_NK: expected [tokens, k] with at least one token, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= len(groups):
        raise ValueError(f"ids_NK: expert ids outside 0..{len(groups) - 1} of the group map")
    counts = np.zeros((ids.shape[0], int(groups.max()) + 1), dtype=np.int64)
    np.add.at(counts, (np.arange(ids.shape[0])[:, None], groups[ids]), 1)
    return float((counts > 0).sum(axis=1).mean()), float(counts.max(axis=1).mean() / ids.shape[1])


def random_routing_expectation(group_of_expert_E: np.ndarray, top_k: int) -> tuple[float, float]:
    """Exact (E[groups spanned], E[main-group share]) when each token takes k distinct experts
    uniformly at random. Spanned: sum over groups of 1 - C(E - n_g, k) / C(E, k). Main share:
    E[max_g c_g] / k with P(max <= m) = [x^k] prod_g sum_{c <= m} C(n_g, c) x^c / C(E, k)."""
    groups = _check_map(group_of_expert_E)
    sizes = np.bincount(groups)
    sizes = [int(n) for n in sizes if n > 0]
    experts = sum(sizes)
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k: {top_k} is not between 1 and the {experts} experts of the map")
    total = math.comb(experts, top_k)
    spanned = sum(1 - math.comb(experts - n, top_k) / total for n in sizes)

    def ways_with_max_at_most(m: int) -> int:
        poly = [1]
        for n in sizes:
            terms = [math.comb(n, c) for c in range(min(m, n) + 1)]
            out = [0] * min(len(poly) + len(terms) - 1, top_k + 1)
            for i, a in enumerate(poly):
                for j, b in enumerate(terms):
                    if i + j <= top_k:
                        out[i + j] += a * b
            poly = out
        return poly[top_k] if len(poly) > top_k else 0

    expected_max = sum(1 - ways_with_max_at_most(m - 1) / total for m in range(1, top_k + 1))
    return spanned, expected_max / top_k


def load_matched_null(ids_NK: np.ndarray, group_of_expert_E: np.ndarray, rng: np.random.Generator,
                      tokens: int | None = None) -> tuple[float, float]:
    """(groups spanned, main-group share) of a null routing with the observed loads: `tokens`
    tokens (default: as many as observed), each taking k distinct experts by Gumbel-top-k with
    log-weights log(load), independently of every other token."""
    groups = _check_map(group_of_expert_E)
    ids = np.asarray(ids_NK, dtype=np.int64)
    load = np.bincount(ids.ravel(), minlength=len(groups)).astype(np.float64)
    count = ids.shape[0] if tokens is None else tokens
    scores = np.log(np.maximum(load, 0.5))[None, :] + rng.gumbel(size=(count, len(groups)))
    null_ids = np.argpartition(-scores, ids.shape[1] - 1, axis=1)[:, : ids.shape[1]]
    return token_group_stats(null_ids, groups)


def inheritance_index(share: float, share_random: float) -> float:
    """(main-group share - its random value) / (1 - random value): 0 for routing that ignores the
    groups, 1 when every token stays in one group (0 where one group holds every expert)."""
    return (share - share_random) / (1 - share_random) if share_random < 1 else 0.0


SUMMARY_COLUMNS = ("groups_spanned", "groups_spanned_random", "main_group_share", "main_group_share_random",
                   "inheritance_index")


def virtual_group_summary(ids_NK: np.ndarray, num_experts: int) -> dict[str, float]:
    """One layer's routing [N, k] against the virtual-group map of E = `num_experts` experts:
    `SUMMARY_COLUMNS` (no load-matched null); NaN where k does not divide E (no such map)."""
    top_k = np.asarray(ids_NK).shape[1]
    if top_k < 1 or num_experts % top_k:
        return dict.fromkeys(SUMMARY_COLUMNS, float("nan"))
    groups = virtual_group_map(num_experts, top_k)
    spanned, share = token_group_stats(ids_NK, groups)
    spanned_random, share_random = random_routing_expectation(groups, top_k)
    return dict(zip(SUMMARY_COLUMNS, (spanned, spanned_random, share, share_random,
                                      inheritance_index(share, share_random))))


def group_inheritance(ids_LNK: np.ndarray, group_of_expert_E: np.ndarray, layers: list[int] | None = None,
                      basis: str = "inherited", seed: int = NULL_SEED) -> pd.DataFrame:
    """The per-layer table (module docstring) for routing `ids_LNK` [L, N, k] (or one layer [N, k]),
    plus a `layer = "mean"` row averaging the layers. `basis` says whether the map is the model's own
    initial grouping (`inherited`) or a reference map for a model without one (`reference`)."""
    if basis not in BASES:
        raise ValueError(f"basis: {basis!r} is not one of {', '.join(BASES)}")
    groups = _check_map(group_of_expert_E)
    ids = np.asarray(ids_LNK)
    if ids.ndim == 2:
        ids = ids[None]
    if ids.ndim != 3:
        raise ValueError(f"ids_LNK: expected [layers, tokens, k], got shape {ids.shape}")
    layers = list(range(ids.shape[0])) if layers is None else [int(layer) for layer in layers]
    if len(layers) != ids.shape[0]:
        raise ValueError(f"layers: {len(layers)} names for {ids.shape[0]} layers of routing")
    top_k = ids.shape[2]
    spanned_random, share_random = random_routing_expectation(groups, top_k)
    rng = np.random.default_rng(seed)
    rows = []
    for layer, ids_NK in zip(layers, ids):
        spanned, share = token_group_stats(ids_NK, groups)
        null_spanned, null_share = load_matched_null(ids_NK, groups, rng)
        rows.append({"layer": str(layer), "tokens": ids_NK.shape[0], "top_k": top_k,
                     "groups": int(len(np.unique(groups))), "basis": basis,
                     "groups_spanned": spanned, "groups_spanned_random": spanned_random,
                     "groups_spanned_load_null": null_spanned, "main_group_share": share,
                     "main_group_share_random": share_random, "main_group_share_load_null": null_share,
                     "inheritance_index": inheritance_index(share, share_random)})
    table = pd.DataFrame(rows)
    numeric = [c for c in table.columns if c not in ("layer", "basis", "tokens", "top_k", "groups")]
    mean = {**table.iloc[0][["tokens", "top_k", "groups", "basis"]].to_dict(), "layer": "mean",
            **table[numeric].mean().to_dict()}
    return pd.concat([table, pd.DataFrame([mean])], ignore_index=True)


def group_map_of_model(config: dict) -> tuple[np.ndarray, str]:
    """(group of each expert, basis) for a transformers model config (`config.json` as a dict):
    the virtual-group map j mod (E/k); `inherited` where the model was upcycled with virtual groups
    (its `occult_upcycle` record, `init` absent or `virtual_groups`), `reference` otherwise."""
    experts = config.get("num_local_experts", config.get("num_experts", config.get("n_routed_experts")))
    top_k = config.get("num_experts_per_tok")
    if not isinstance(experts, int) or not isinstance(top_k, int):
        raise ValueError("model config: no expert count (num_local_experts/num_experts/n_routed_experts) "
                         "or num_experts_per_tok")
    upcycle = config.get("occult_upcycle") or {}
    inherited = bool(upcycle) and upcycle.get("init", "virtual_groups") == "virtual_groups"
    return virtual_group_map(experts, top_k), "inherited" if inherited else "reference"


def split_name(path: Path) -> str:
    """`heldout` for routing_heldout.npz or routing_heldout_sample.npz; else the file's stem."""
    stem = path.name.removesuffix(".npz").removesuffix("_sample")
    return stem.removeprefix("routing_")


def inheritance_of_traces(routing_files: list[Path], group_of_expert_E: np.ndarray, basis: str,
                          seed: int = NULL_SEED) -> pd.DataFrame:
    """`group_inheritance` of each routing file (`occult.routing.profiling.load_routing`), one
    `split` per file, in the `COLUMNS` order."""
    from occult.routing.profiling import load_routing

    tables = []
    for path in routing_files:
        record = load_routing(path)
        table = group_inheritance(record.ids, group_of_expert_E, record.layers.tolist(), basis, seed)
        table.insert(0, "split", split_name(Path(path)))
        tables.append(table)
    if not tables:
        raise ValueError("no routing files given")
    return pd.concat(tables, ignore_index=True)[COLUMNS]


def main(argv: list[str] | None = None) -> int:
    from occult.provenance import provenance, write_csv

    parser = argparse.ArgumentParser(prog="python -m occult.routing.inheritance",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--routing", type=Path, nargs="+", required=True, metavar="NPZ",
                        help="routing traces (occult.routing.profiling: routing_*.npz or their samples)")
    parser.add_argument("--model-config", type=Path, required=True, metavar="JSON",
                        help="the model's config.json: expert count, top-k and how it was initialised")
    parser.add_argument("--out", type=Path, required=True, metavar="CSV")
    parser.add_argument("--seed", type=int, default=NULL_SEED, help="seed of the load-matched null")
    parser.add_argument("--log-json", metavar="PATH", help=f"append JSON-lines logs here (default: ${ENV_LOG_JSON})")
    args = parser.parse_args(argv)
    try:
        config = json.loads(args.model_config.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{args.model_config}: no such model config") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{args.model_config}: not valid JSON ({err})") from None
    group_of_expert, basis = group_map_of_model(config)
    table = inheritance_of_traces(args.routing, group_of_expert, basis, args.seed)
    write_csv(args.out, table, provenance(None, args.seed, stage="inheritance",
                                          routing=[str(p) for p in args.routing],
                                          model_config=str(args.model_config), basis=basis,
                                          group_map="expert j in group j mod (E / k)"))
    return 0


if __name__ == "__main__":
    sys.exit(run_main("inheritance", main))
