"""lm-eval on one variant: the model, its variant's routing rule, the offline tasks.

Runs `lm_eval.simple_evaluate` with `HFLM` on the model instance over task YAMLs generated from
the data stage's evaluation sets; lm-eval's own results JSON is kept, and a summary with
accuracy, standard error and chance level per task is added for the report.
Progress: lm-eval batches the requests of all tasks together, so the progress records count the
model's forward calls (batches) and tokens, without a known total; each task's score is logged as
a `score` event when the run ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import occult.ep.experts  # noqa: F401  (registers model.experts_kernel "triton")
from occult.config import Config, parse_variant
from occult.stages.eval_tasks import NOT_AVAILABLE, UNAVAILABLE_TASKS
from occult.logs import ENV_LOG_JSON, Progress, log_event, progress, run_main
from occult.provenance import provenance, seed_everything, write_json

log = logging.getLogger(__name__)


def count_forward_calls(model: nn.Module, bar: Progress):
    """A forward pre-hook on `model` that advances `bar` by one batch and counts its tokens;
    returns the hook handle (`.remove()` it)."""
    seen = {"tokens": 0}

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = args[0] if args else kwargs.get("input_ids")
        if isinstance(input_ids, torch.Tensor):
            seen["tokens"] += input_ids.numel()
            bar.log(tokens=seen["tokens"])
        bar.update(1)

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def task_scores(out: dict, tasks: list[str]) -> tuple[list[dict], dict[str, str]]:
    """From `lm_eval.simple_evaluate`'s output (run with `log_samples=True`): the score of each
    task (acc, acc_norm, their stderrs, chance, documents) and each task's per-document correctness
    as a string of 0/1 in `doc_id` order, for paired comparisons between arms scored on the same
    documents. Raises if the documents' mean differs from lm-eval's aggregate `acc`."""
    from occult.stages.eval_tasks import CHANCE, TASK_NAMES

    scores, per_doc = [], {}
    for task in tasks:
        res = out["results"][TASK_NAMES[task]]
        scores.append({
            "task": task,
            "acc": res.get("acc,none"),
            "acc_stderr": res.get("acc_stderr,none"),
            "acc_norm": res.get("acc_norm,none"),
            "acc_norm_stderr": res.get("acc_norm_stderr,none"),
            "chance": CHANCE[task],
            "n": out.get("n-samples", {}).get(TASK_NAMES[task], {}).get("effective"),
        })
        samples = sorted(out.get("samples", {}).get(TASK_NAMES[task], []), key=lambda sample: sample["doc_id"])
        if samples and res.get("acc,none") is not None:
            bits = "".join("1" if sample["acc"] else "0" for sample in samples)
            if abs(bits.count("1") / len(bits) - res["acc,none"]) > 1e-9:
                raise RuntimeError(f"{task}: per-document accuracy {bits.count('1') / len(bits)} "
                                   f"differs from lm-eval's {res['acc,none']}")
            per_doc[task] = bits
    return scores, per_doc


def evaluate(cfg: Config, variant_name: str, model_dir: Path, data_dir: Path, profile_dir: Path,
             placements_dir: Path, out_json: Path, limit: int | None = None) -> dict:
    """Evaluate one variant; writes `out_json` (summary + lm-eval's results) and returns it."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from occult.stages.eval_tasks import TASK_NAMES, make_task_dir
    from occult.models.moe import load_checkpoint, set_routing
    from occult.routing.variants import routing_for_variant

    variant = parse_variant(variant_name)
    seed_everything(cfg.seed)
    model, tokenizer = load_checkpoint(model_dir, device="cuda" if torch.cuda.is_available() else "cpu",
                                       experts_kernel=cfg.model.experts_kernel)
    model.eval()
    set_routing(model, routing_for_variant(cfg, variant, placements_dir, profile_dir, model))
    tasks = list(cfg.data.eval_tasks)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="occult-tasks-") as tmp:
        task_dir = make_task_dir(data_dir / "eval", tasks, Path(tmp))
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.evaluate.batch_size,
                  max_length=cfg.model.max_seq_len)
        with progress(None, desc=f"evaluate {variant.name}", unit="batch") as bar:
            hook = count_forward_calls(model, bar)
            try:
                out = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=[TASK_NAMES[t] for t in tasks],
                    task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                    bootstrap_iters=100,        # acc has a closed-form stderr; no bootstrap is drawn for it
                    limit=limit,
                    random_seed=cfg.seed,
                    numpy_random_seed=cfg.seed,
                    torch_random_seed=cfg.seed,
                    log_samples=True,
                )
            finally:
                hook.remove()
    set_routing(model, None)
    scores, per_doc = task_scores(out, tasks)
    for score in scores:
        acc = score["acc"]
        log_event("score", f"variant {variant.name}, {score['task']}: acc {'n/a' if acc is None else f'{acc:.4f}'}",
                  variant=variant.name, **score)
    summary = {
        "variant": variant.name,
        "scores": scores,
        "per_doc": per_doc,
        "elapsed_s": time.perf_counter() - start,
        "provenance": provenance(cfg.hash(), cfg.seed, stage="evaluate", variant=variant.name),
        "lm_eval": {"results": out["results"], "configs": out.get("configs"),
                    "versions": out.get("versions"), "n-samples": out.get("n-samples"),
                    "config": out.get("config")},
    }
    write_json(out_json, json.loads(json.dumps(summary, default=str)))
    log.info("variant %s evaluated in %.1f s", variant.name, summary["elapsed_s"])
    return summary


# --------------------------------------------------------------------------- the quality study: every arm, fast

BATCH_TOKENS = 65_536          # padded tokens per forward of the batched scorer (GPU)


def fast_lm(model, tokenizer, max_length: int, batch_tokens: int, token_cache: dict | None = None):
    """An lm-eval `HFLM` over `model` whose log-likelihood scoring is batched for speed.

    Same results as HFLM's (same tokenisation of each (context, continuation) pair, same left
    truncation to `max_length`), computed differently: requests with the same input tokens share
    one row (HFLM shares only one-token continuations); rows are sorted by length and packed into
    batches of at most `batch_tokens` padded tokens; only continuation positions are
    log-softmaxed, and each batch is read back with one device sync. On a GPU the forward runs
    under bf16 autocast. `token_cache` (a dict shared between instances) keeps the tokenised
    requests across models that share a tokenizer.
    """
    from lm_eval.models.huggingface import HFLM

    cache = token_cache if token_cache is not None else {}

    class BatchedHFLM(HFLM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            encoded = []
            for request in requests:
                key = tuple(request.args)
                if key not in cache:
                    context, continuation = key
                    if context == "":
                        cont = self.tok_encode(continuation, add_special_tokens=False)
                        pair = ([self.prefix_token_id], cont) if self.prefix_token_id != cont[0] else (cont[:1], cont[1:])
                    else:
                        pair = self._encode_pair(context, continuation)
                    cache[key] = pair
                encoded.append(cache[key])
            return score_requests(self.model, encoded, self.max_length, batch_tokens, disable_tqdm)

    return BatchedHFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, max_length=max_length)


def continuation_logits(model, ids_BS: torch.Tensor, pos_b: torch.Tensor, pos_s: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] at positions (pos_b, pos_s) only. The decoder runs once; the LM head is applied
    to the picked hidden states instead of all B x S (a fifth of a 135M model's FLOPs, and a
    [B, S, V] tensor never made). Models whose causal-LM head is not just `lm_head(hidden)` (none
    of the MoE families here) fall back to the full forward."""
    head = model.get_output_embeddings()
    plain_head = getattr(model, "base_model", None) is not model and isinstance(head, nn.Linear) and not any(
        getattr(model.config, name, None) for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    if not plain_head:
        return model(input_ids=ids_BS, use_cache=False).logits[pos_b, pos_s]
    hidden_BSD = model.base_model(input_ids=ids_BS, use_cache=False).last_hidden_state
    return head(hidden_BSD[pos_b, pos_s])


@torch.no_grad()
def score_requests(model, encoded: list[tuple[list[int], list[int]]], max_length: int, batch_tokens: int,
                   disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    """(sum log p(continuation | context), continuation is the greedy decode) per request."""
    from occult.stages.pretrain import autocast_for

    device = next(model.parameters()).device
    rows: dict[tuple[int, ...], int] = {}          # input tokens -> row index
    row_of_request = []
    for context, continuation in encoded:
        if not continuation or len(continuation) > max_length:
            raise ValueError(f"continuation of {len(continuation)} tokens (model length {max_length})")
        inputs = tuple((context + continuation)[-(max_length + 1):][:-1])
        row_of_request.append(rows.setdefault(inputs, len(rows)))
    inputs_R = list(rows)
    requests_of_row: list[list[int]] = [[] for _ in inputs_R]
    for request, row in enumerate(row_of_request):
        requests_of_row[row].append(request)
    results: list[tuple[float, bool]] = [(0.0, False)] * len(encoded)
    order = sorted(range(len(inputs_R)), key=lambda r: -len(inputs_R[r]))
    bar = progress(len(encoded), desc="loglikelihood", unit="request", disable=disable_tqdm)
    start = 0
    while start < len(order):
        width = len(inputs_R[order[start]])
        stop = min(len(order), start + max(1, batch_tokens // width))
        batch = order[start:stop]
        ids_BS = torch.zeros(len(batch), width, dtype=torch.long)
        for b, row in enumerate(batch):
            ids_BS[b, : len(inputs_R[row])] = torch.tensor(inputs_R[row])
        # (batch row, position, target, request) of every continuation token in this batch
        pos_b, pos_s, targets, owner = [], [], [], []
        batch_requests = [req for row in batch for req in requests_of_row[row]]
        for b, row in enumerate(batch):
            length = len(inputs_R[row])
            for req in requests_of_row[row]:
                cont = encoded[req][1]
                pos_b += [b] * len(cont)
                pos_s += range(length - len(cont), length)
                targets += cont
                owner += [req] * len(cont)
        with autocast_for(device):
            picked_NV = continuation_logits(model, ids_BS.to(device), torch.tensor(pos_b, device=device),
                                            torch.tensor(pos_s, device=device)).float()
        target_N = torch.tensor(targets, device=device)
        logp_N = torch.log_softmax(picked_NV, dim=-1).gather(1, target_N[:, None]).squeeze(1)
        greedy_N = picked_NV.argmax(dim=-1) == target_N
        slot = {req: i for i, req in enumerate(batch_requests)}
        owner_N = torch.tensor([slot[r] for r in owner], device=device)
        sums = torch.zeros(len(batch_requests), dtype=torch.float64, device=device).index_add_(0, owner_N, logp_N.double())
        misses = torch.zeros(len(batch_requests), dtype=torch.long, device=device).index_add_(0, owner_N, (~greedy_N).long())
        for req, total, miss in zip(batch_requests, sums.tolist(), misses.tolist()):
            results[req] = (total, miss == 0)
        bar.update(len(batch_requests))
        start = stop
    bar.close()
    return results


@contextlib.contextmanager
def request_cache(path: Path):
    """Point lm-eval's request cache at `path` for the duration (restored afterwards)."""
    from lm_eval.caching import cache as lm_cache

    previous = lm_cache.PATH
    path.mkdir(parents=True, exist_ok=True)
    lm_cache.PATH = str(path)
    try:
        yield
    finally:
        lm_cache.PATH = previous


def evaluate_arms(cfg: Config, arms: list, base_model_dir: Path, arms_root: Path, data_dir: Path, profile_dir: Path,
                  placements_dir: Path, out_dir: Path, time_limit_s: float | None = None, limit: int | None = None,
                  batch_tokens: int = BATCH_TOKENS, shard: tuple[int, int] = (0, 1)) -> list[str]:
    """lm-eval every arm of the quality study in one process; arm `a` is read from
    `arms_root/<a.name>` (`raw`: `base_model_dir`) and scored into `out_dir/<a.name>.json` in the
    format of `evaluate`. Tasks are built once (lm-eval's request cache, kept in a temporary
    folder for this call) and tokenised once. Arms already scored are skipped; no new arm starts
    after `time_limit_s`. `shard` (k, n) keeps the arms at positions k, k + n, ... (one process per
    GPU). Returns the names of this shard's arms still missing."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from occult.stages.eval_tasks import TASK_NAMES, make_task_dir
    from occult.models.moe import load_checkpoint, set_routing
    from occult.routing.variants import arm_config, arms_before_deadline, routing_for_variant, shard_of

    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    todo = [a for a in shard_of(arms, shard) if not (out_dir / f"{a.name}.json").is_file()]
    missing: list[str] = []
    tasks = list(cfg.data.eval_tasks)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    token_cache: dict = {}
    with tempfile.TemporaryDirectory(prefix="occult-tasks-") as tmp, request_cache(Path(tmp) / "requests"):
        task_manager = TaskManager(include_path=str(make_task_dir(data_dir / "eval", tasks, Path(tmp) / "tasks")),
                                   include_defaults=False)
        with progress(todo, desc="arms", unit="arm") as bar:
            for arm in arms_before_deadline(bar, deadline, missing):
                arm_cfg = arm_config(cfg, arm)
                seed_everything(arm_cfg.seed)
                model_dir = base_model_dir if arm.name == "raw" else arms_root / arm.name
                model, tokenizer = load_checkpoint(model_dir, device=device, experts_kernel=arm_cfg.model.experts_kernel)
                model.eval()
                set_routing(model, routing_for_variant(arm_cfg, arm.variant, placements_dir, profile_dir, model))
                start = time.perf_counter()
                lm = fast_lm(model, tokenizer, arm_cfg.model.max_seq_len, batch_tokens, token_cache)
                out = lm_eval.simple_evaluate(
                    model=lm, tasks=[TASK_NAMES[t] for t in tasks], task_manager=task_manager,
                    bootstrap_iters=100, limit=limit, cache_requests=True,
                    random_seed=arm_cfg.seed, numpy_random_seed=arm_cfg.seed, torch_random_seed=arm_cfg.seed,
                    log_samples=True,
                )
                set_routing(model, None)
                scores, per_doc = task_scores(out, tasks)
                summary = {
                    "variant": arm.variant,
                    "arm": arm.name,
                    "setting": {"devices": arm.devices, "gate_weights": arm.gate_weights,
                                "train_modules": arm.train_modules},
                    "scores": scores,
                    "per_doc": per_doc,
                    "elapsed_s": time.perf_counter() - start,
                    "provenance": provenance(arm_cfg.hash(), arm_cfg.seed, stage="evaluate", variant=arm.variant,
                                             arm=arm.name, scorer="occult.stages.evaluate.fast_lm (batched HFLM)"),
                    "lm_eval": {"results": out["results"], "configs": out.get("configs"),
                                "versions": out.get("versions"), "n-samples": out.get("n-samples"),
                                "config": out.get("config")},
                }
                write_json(out_dir / f"{arm.name}.json", json.loads(json.dumps(summary, default=str)))
                log.info("arm %s evaluated in %.1f s", arm.name, summary["elapsed_s"])
                del model, lm
                if device == "cuda":
                    torch.cuda.empty_cache()
    return missing


def main(argv: list[str] | None = None) -> int:
    """`python -m occult.stages.evaluate --config C --model BASE --arms ROOT --data D --profile P
    --placements DIR --out DIR [--time-limit S] [--limit N] [--done JSON]`: every arm of the quality study.
    `python -m occult.stages.evaluate --summarise RESULTS --figures DIR`: its tables, verdicts and figure.
    `python -m occult.stages.evaluate --replicates SPEC_YAML --out CSV`: two runs of the same recipe compared."""
    import argparse
    import sys

    log_json_help = f"append JSON-lines logs here (default: ${ENV_LOG_JSON}); read by the entry point"
    if argv is None:
        argv = sys.argv[1:]
    if "--replicates" in argv:
        replicate_parser = argparse.ArgumentParser(prog="python -m occult.stages.evaluate --replicates")
        replicate_parser.add_argument("--replicates", required=True, metavar="SPEC_YAML")
        replicate_parser.add_argument("--out", required=True, metavar="CSV")
        replicate_parser.add_argument("--figure", metavar="PNG", help="also plot both runs side by side here")
        replicate_parser.add_argument("--log-json", metavar="PATH", help=log_json_help)
        replicate_args = replicate_parser.parse_args(argv)
        from occult.provenance import write_csv

        table = replicate_table(Path(replicate_args.replicates))
        write_csv(Path(replicate_args.out), table,
                  provenance(None, None, stage="replicates", source=replicate_args.replicates,
                             tasks=table.attrs["tasks"]))
        if replicate_args.figure:
            plot_replicates(table, Path(replicate_args.figure))
        return 0
    if "--summarise" in argv:
        summary_parser = argparse.ArgumentParser(prog="python -m occult.stages.evaluate --summarise")
        summary_parser.add_argument("--summarise", required=True, metavar="RESULTS")
        summary_parser.add_argument("--figures", required=True)
        summary_parser.add_argument("--log-json", metavar="PATH", help=log_json_help)
        summary_args = summary_parser.parse_args(argv)
        summarise_arms(Path(summary_args.summarise), Path(summary_args.figures))
        return 0

    from occult.config import load_config
    from occult.routing.variants import cap_gpu_memory_share, parse_shard, quality_arms, write_arms_done

    parser = argparse.ArgumentParser(prog="python -m occult.stages.evaluate", description=main.__doc__)
    for flag in ("--config", "--model", "--arms", "--data", "--profile", "--placements", "--out"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--time-limit", type=float, default=None, help="start no arm after this many seconds")
    parser.add_argument("--limit", type=int, default=None, help="examples per task (smoke tests only)")
    parser.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS)
    parser.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="K/N",
                        help="only the arms at positions K, K+N, ... (e.g. one process per GPU)")
    parser.add_argument("--done", metavar="JSON", help="once every arm is scored, record them here (the workflow's output)")
    parser.add_argument("--log-json", metavar="PATH", help=log_json_help)
    args = parser.parse_args(argv)
    if args.done and args.shard != (0, 1):
        parser.error("--done records every arm: run without --shard")
    cap_gpu_memory_share()
    cfg = load_config(args.config)
    arms = quality_arms(cfg)
    missing = evaluate_arms(cfg, arms, Path(args.model), Path(args.arms), Path(args.data),
                            Path(args.profile), Path(args.placements), Path(args.out), args.time_limit,
                            args.limit, args.batch_tokens, args.shard)
    if missing:
        print(f"evaluate: time limit reached; {len(missing)} arms left ({', '.join(missing)}); run again",
              file=sys.stderr)
        return 3
    if args.done:
        write_arms_done(Path(args.done), arms, Path(args.out), "evaluate_arms")
    return 0


# --------------------------------------------------------------------------- the quality study's tables (CPU)


def arms_accuracy_table(eval_dir: Path) -> "pd.DataFrame":
    """One row per scored arm (file order of `quality_arms`-named JSONs): setting columns, `acc` and
    `acc_stderr` per task, `average` (unweighted over tasks) and its stderr (tasks independent),
    a chance row, and a column per benchmark of the paper that the offline data lacks
    (`UNAVAILABLE_TASKS`), reading "not available offline"."""
    import math

    import pandas as pd

    rows = []
    for path in sorted(Path(eval_dir).glob("*.json")):
        summary = json.loads(path.read_text())
        if "scores" not in summary:
            raise ValueError(f"{path}: not an evaluation summary (no 'scores')")
        setting = summary.get("setting", {})
        row = {"arm": summary.get("arm", path.stem), "variant": summary["variant"], **setting}
        errors = []
        for score in summary["scores"]:
            row[score["task"]] = score["acc"]
            row[f"{score['task']}_stderr"] = score["acc_stderr"]
            errors.append(score["acc_stderr"] or 0.0)
        tasks = [s["task"] for s in summary["scores"]]
        row["average"] = sum(row[t] for t in tasks) / len(tasks)
        row["average_stderr"] = math.sqrt(sum(e * e for e in errors)) / len(tasks)
        rows.append(row)
    if not rows:
        raise FileNotFoundError(f"{eval_dir}: no evaluation JSON files")
    rows.sort(key=_paper_order)
    chance = {s["task"]: s["chance"] for s in json.loads(next(Path(eval_dir).glob("*.json")).read_text())["scores"]}
    rows.append({"arm": "chance", "variant": "chance", **chance, "average": sum(chance.values()) / len(chance)})
    table = pd.DataFrame(rows)
    for task in UNAVAILABLE_TASKS:           # the paper's other benchmarks: said, not substituted
        table[task] = NOT_AVAILABLE
    return table


def _paper_order(row: dict) -> tuple:
    """raw, SFT, then pruned variants by D, N_d (descending) and method; ablations last."""
    variant = parse_variant(row["variant"])
    return (variant.trains, variant.max_devices is not None, row.get("gate_weights", "keep") != "keep",
            row.get("train_modules", "moe") != "moe", row.get("devices", 0), -(variant.max_devices or 0),
            variant.method or "", row["arm"])


def paired_contrast(terms: list[tuple[float, dict[str, str]]], tasks: list[str]) -> tuple[float, float] | None:
    """sum_j w_j * (task-averaged accuracy of arm j) for `terms` = [(w_j, per-document correctness of
    arm j)], and its standard error. All arms answered the same documents, so the error is that of
    the mean per-document contrast c_i = sum_j w_j x_ij: var(c) / n per task, tasks independent.
    None unless every arm has every task's documents, in the same number."""
    import numpy as np

    if not terms or not tasks:
        return None
    arms = [arm for _, arm in terms]
    if any(t not in arm or len(arm[t]) != len(arms[0].get(t, "")) for arm in arms for t in tasks):
        return None

    def bits(arm: dict[str, str], task: str) -> "np.ndarray":
        return (np.frombuffer(arm[task].encode(), dtype=np.uint8) - ord("0")).astype(np.float64)

    means, variances = [], []
    for task in tasks:
        c = sum(weight * bits(arm, task) for weight, arm in terms)
        means.append(c.mean())
        variances.append(c.var(ddof=1) / len(c) if len(c) > 1 else 0.0)
    return float(np.mean(means)), float(np.sqrt(np.sum(variances)) / len(tasks))


def paired_difference(pairs: list[tuple[dict[str, str], dict[str, str]]], tasks: list[str]) -> tuple[float, float] | None:
    """Mean over `pairs` of arm a's minus arm b's task-averaged accuracy, and its paired standard
    error (`paired_contrast`: the error of the mean per-document difference)."""
    if not pairs:
        return None
    share = 1.0 / len(pairs)
    return paired_contrast([(share, a) for a, _ in pairs] + [(-share, b) for _, b in pairs], tasks)


def claim_verdicts(table: "pd.DataFrame", per_doc: dict[str, dict[str, str]] | None = None) -> list[dict]:
    """A verdict per paper claim from the arms table: differences of task-averaged accuracy, "holds"
    needing 2 standard errors. The error is the paired one (`paired_difference`) where `per_doc`
    (arm -> task -> 0/1 per document) has both arms, else that of two independent averages."""
    import math

    by_arm = table.set_index("arm")
    tasks = [c[: -len("_stderr")] for c in table.columns if c.endswith("_stderr") and c != "average_stderr"]
    per_doc = per_doc or {}

    def avg(arm: str) -> tuple[float, float] | None:
        return (by_arm.at[arm, "average"], by_arm.at[arm, "average_stderr"]) if arm in by_arm.index else None

    def diff(a: str, b: str) -> dict | None:
        if avg(a) is None or avg(b) is None:
            return None
        (ma, sa), (mb, sb) = avg(a), avg(b)
        independent = math.sqrt(sa * sa + sb * sb)
        documents = a in per_doc and b in per_doc
        paired = paired_difference([(per_doc[a], per_doc[b])], tasks) if documents else None
        # the task that moves the difference most, and the difference without it: does one task decide?
        by_task = {t: by_arm.at[a, t] - by_arm.at[b, t] for t in tasks}
        decisive = max(by_task, key=lambda t: abs(by_task[t])) if len(tasks) > 1 else None
        rest = [t for t in tasks if t != decisive]
        without = paired_difference([(per_doc[a], per_doc[b])], rest) if documents and decisive else None
        return {"a": a, "b": b, "diff": ma - mb, "stderr": paired[1] if paired else independent,
                "stderr_basis": "paired documents" if paired else "independent averages",
                "stderr_independent": independent, "decisive_task": decisive,
                "diff_without_decisive_task": (without[0] if without else
                                               (sum(by_task[t] for t in rest) / len(rest) if rest else None)),
                "stderr_without_decisive_task": without[1] if without else None}

    pruned = table[table["variant"].str.startswith("prune") & (table.get("gate_weights") == "keep")
                   & (table.get("train_modules") == "moe")]
    verdicts = []
    within2 = [d for d in (diff(a, "sft-moe") for a in pruned[pruned["variant"].str.startswith("prune2")]["arm"]) if d]
    verdicts.append({
        "claim": "pruning within 2 devices is about as good as standard fine-tuning",
        "comparisons": within2,
        "verdict": "holds" if within2 and all(d["diff"] >= -2 * d["stderr"] for d in within2) else
                   ("does not hold" if within2 else "not measured"),
    })
    within1 = [d for d in (diff(a, "sft-moe") for a in pruned[pruned["variant"].str.startswith("prune1")]["arm"]) if d]
    verdicts.append({
        "claim": "pruning within 1 device hurts",
        "comparisons": within1,
        "verdict": "holds" if within1 and all(d["diff"] < -2 * d["stderr"] for d in within1) else
                   ("does not hold (no loss beyond 2 standard errors)" if within1 else "not measured"),
    })
    pairs = [d for d in (diff(a, a.replace("-sim-", "-router-")) for a in pruned["arm"] if "-sim-" in a) if d]
    mean = sum(d["diff"] for d in pairs) / len(pairs) if pairs else 0.0
    if pairs and all(d["stderr_basis"] == "paired documents" for d in pairs):      # the pairs share documents too
        spread = paired_difference([(per_doc[d["a"]], per_doc[d["b"]]) for d in pairs], tasks)[1]
    else:
        spread = math.sqrt(sum(d["stderr"] ** 2 for d in pairs)) / len(pairs) if pairs else 0.0
    verdicts.append({
        "claim": "similarity-based pruning beats router-score-based pruning",
        "comparisons": pairs,
        "mean_diff": mean, "mean_diff_stderr": spread,
        "verdict": "not measured" if not pairs else "holds" if mean > 2 * spread else
                   "does not hold" if mean < -2 * spread else "inconclusive (within 2 standard errors)",
    })
    # two ablations the paper reports without a claim we could test: the sign of each difference
    arms = table[table["arm"] != "chance"]
    full = [d for d in (diff(a, a[: -len("-all")] + "-moe") for a in arms[arms["train_modules"] == "all"]["arm"]) if d]
    verdicts.append({"claim": "full fine-tuning against MoE-only fine-tuning (same variant)", "comparisons": full,
                     "verdict": _sign_verdict(full, "full fine-tuning", "MoE-only fine-tuning")})
    gates = [d for d in (diff(a, a.replace("-renormalise-", "-keep-")) for a in
                         arms[arms["gate_weights"] == "renormalise"]["arm"]) if d]
    verdicts.append({"claim": "gate weights renormalised after pruning against kept as they are", "comparisons": gates,
                     "verdict": _sign_verdict(gates, "renormalised gates", "kept gates")})
    return verdicts


def _sign_verdict(comparisons: list[dict], a: str, b: str) -> str:
    """`a better`, `b better` (every comparison beyond 2 standard errors, one sign), or no difference."""
    if not comparisons:
        return "not measured"
    if all(d["diff"] > 2 * d["stderr"] for d in comparisons):
        return f"{a} better"
    if all(d["diff"] < -2 * d["stderr"] for d in comparisons):
        return f"{b} better"
    return "no consistent difference beyond 2 standard errors"


def load_per_doc(eval_dir: Path) -> dict[str, dict[str, str]]:
    """arm -> task -> its per-document correctness ("0"/"1" per document) from `eval_dir/*.json`."""
    per_doc = {}
    for path in sorted(Path(eval_dir).glob("*.json")):
        summary = json.loads(path.read_text())
        if summary.get("per_doc"):
            per_doc[summary.get("arm", path.stem)] = summary["per_doc"]
    return per_doc


def replicate_table(spec_path: Path) -> "pd.DataFrame":
    """Two runs of the same recipe on two base models (pre-training is not bitwise reproducible on a
    GPU): how far does the second move each arm, and each arm's difference from the reference arm?

    `spec_path` (YAML, in the second run's folder): `first:` the first run's folder; `reference:` an
    arm of the second run; `same_arms:` {first run's arm: second run's arm} for the arms that ran the
    same recipe in both. All four arms of a change answered the same documents, so every error is
    paired (`paired_contrast`); z = change / its error, beyond 2 meaning the base model, not the
    test set, moved it. Accuracy rows also give the runs' document agreement (`document_agreement`)."""
    import pandas as pd
    import yaml

    spec_path = Path(spec_path)
    spec = yaml.safe_load(spec_path.read_text()) or {}
    for field in ("first", "reference", "same_arms"):
        if field not in spec:
            raise ValueError(f"{spec_path}: missing field '{field}'")
    second_dir, first_dir = spec_path.parent, Path(spec["first"])
    first, second = load_per_doc(first_dir / "evaluate"), load_per_doc(second_dir / "evaluate")
    same = {str(a): str(b) for a, b in spec["same_arms"].items()}
    for name, runs, where in [(a, first, first_dir) for a in same] + [(b, second, second_dir) for b in same.values()]:
        if name not in runs:
            raise ValueError(f"{spec_path}: same_arms names {name!r}, which {where}/evaluate has no per-document scores for")
    reference = str(spec["reference"])
    ref_first = next((a for a, b in same.items() if b == reference), None)
    if ref_first is None:
        raise ValueError(f"{spec_path}: reference {reference!r} is not a second-run arm of same_arms")
    arms = [first[a] for a in same] + [second[b] for b in same.values()]
    tasks = sorted(set.intersection(*(set(arm) for arm in arms)))

    def row(kind: str, name: str, first_terms: list, second_terms: list) -> dict:
        one, two = paired_contrast(first_terms, tasks), paired_contrast(second_terms, tasks)
        change = paired_contrast(second_terms + [(-w, arm) for w, arm in first_terms], tasks)
        pooled = paired_contrast([(w / 2, arm) for w, arm in first_terms + second_terms], tasks)
        if None in (one, two, change, pooled):
            raise ValueError(f"{spec_path}: {name}: the two runs did not score the same documents")
        return {"kind": kind, "arm": name, "first": one[0], "first_stderr": one[1], "second": two[0],
                "second_stderr": two[1], "change": change[0], "change_stderr": change[1],
                "z": change[0] / change[1] if change[1] else float("nan"), "pooled": pooled[0],
                "pooled_stderr": pooled[1]}

    rows = [{**row("accuracy", b, [(1.0, first[a])], [(1.0, second[b])]), **document_agreement(first[a], second[b], tasks)}
            for a, b in same.items()]
    rows += [row(f"minus {reference}", b, [(1.0, first[a]), (-1.0, first[ref_first])],
                 [(1.0, second[b]), (-1.0, second[reference])]) for a, b in same.items() if b != reference]
    table = pd.DataFrame(rows)
    table.attrs["tasks"] = tasks
    return table


def document_agreement(a: dict[str, str], b: dict[str, str], tasks: list[str]) -> dict[str, float]:
    """Share of documents two arms answer alike (both right or both wrong), mean over `tasks`, and
    the share expected of independent answers at the same accuracies: far above it, the two
    per-document records are aligned (the same documents in the same order)."""
    import numpy as np

    same, independent = [], []
    for task in tasks:
        x, y = (np.frombuffer(arm[task].encode(), dtype=np.uint8) == ord("1") for arm in (a, b))
        same.append(float(np.mean(x == y)))
        independent.append(float(x.mean() * y.mean() + (1 - x.mean()) * (1 - y.mean())))
    return {"agreement": float(np.mean(same)), "agreement_if_independent": float(np.mean(independent))}


def plot_replicates(table: "pd.DataFrame", path: Path) -> None:
    """Each run's value beside the other's, with paired 2-standard-error bars: the arms' accuracies
    (left) and their differences from the reference arm (right), one row of `replicate_table` each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from occult.provenance import atomic_path

    kinds = list(dict.fromkeys(table["kind"]))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rows = table[table["kind"] == kind].reset_index(drop=True)
        for offset, run, color in ((-0.15, "first", "tab:blue"), (0.15, "second", "tab:orange")):
            ax.errorbar(rows.index + offset, 100 * rows[run], yerr=200 * rows[f"{run}_stderr"], fmt="o",
                        color=color, capsize=3, label=f"{run} run")
        for i, row in rows.iterrows():      # above both error bars
            top = 100 * max(row["first"] + 2 * row["first_stderr"], row["second"] + 2 * row["second_stderr"])
            ax.annotate(f"z {row['z'] + 0.0:+.1f}", (i, top), textcoords="offset points", xytext=(0, 4),
                        ha="center", fontsize=7)
        if kind != "accuracy":
            ax.axhline(0.0, color="black", linewidth=0.8, linestyle="dotted")
        ax.set_xticks(rows.index, rows["arm"], rotation=25, ha="right", fontsize=7)
        ax.set_ylabel("task-averaged accuracy, %" if kind == "accuracy" else f"{kind}, points")
        ax.set_title(kind, fontsize=9)
        ax.margins(y=0.15)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("one recipe, two base models: bars are 2 paired standard errors; z = change / its error", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def summarise_arms(results_dir: Path, figures_dir: Path) -> None:
    """From `results_dir/evaluate/*.json` (committed GPU results): `tables/accuracy.csv` (arms x
    tasks with averages, the paper's layout), `tables/verdicts.json` and `figures_dir/accuracy.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from occult.provenance import atomic_path, write_csv

    results_dir, figures_dir = Path(results_dir), Path(figures_dir)
    table = arms_accuracy_table(results_dir / "evaluate")
    per_doc = load_per_doc(results_dir / "evaluate")
    meta = provenance(None, None, stage="summarise", source=str(results_dir / "evaluate"))
    write_csv(results_dir / "tables" / "accuracy.csv", table, meta)
    write_json(results_dir / "tables" / "verdicts.json",
               {"provenance": meta, "verdicts": claim_verdicts(table, per_doc)})
    tasks = [c for c in table.columns if f"{c}_stderr" in table.columns and c != "average"]
    arms = table[table["arm"] != "chance"]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(tasks) + 2), 5))
    width = 0.8 / max(1, len(arms))
    colors = plt.get_cmap("tab20").colors          # 20 distinct colours: a full grid has 14-16 arms
    for i, (_, row) in enumerate(arms.iterrows()):
        xs = [t + i * width for t in range(len(tasks) + 1)]
        ax.bar(xs, [row[t] for t in tasks] + [row["average"]], width, color=colors[i % len(colors)],
               yerr=[row[f"{t}_stderr"] for t in tasks] + [row["average_stderr"]], label=row["arm"], capsize=1)
    chance = table[table["arm"] == "chance"].iloc[0]
    for t, task in enumerate(tasks + ["average"]):
        ax.hlines(chance[task], t - 0.1, t + 0.9, colors="black", linestyles="dotted")
    ax.set_xticks([t + 0.4 for t in range(len(tasks) + 1)], tasks + ["average"], rotation=30, ha="right")
    ax.set_ylabel("accuracy (dotted: chance)")
    ax.set_title(f"{', '.join(UNAVAILABLE_TASKS)}: {NOT_AVAILABLE}, not substituted", fontsize=8, loc="left")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    with atomic_path(figures_dir / "accuracy.png") as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


if __name__ == "__main__":
    import sys

    stage = ("summarise_quality" if "--summarise" in sys.argv[1:] else
             "quality_replicates" if "--replicates" in sys.argv[1:] else "evaluate_arms")
    raise SystemExit(run_main(stage, main, output_flags=("--out", "--figures")))
