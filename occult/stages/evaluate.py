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
        from occult.report.quality import plot_replicates, replicate_table

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
        from occult.report.quality import summarise_arms

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


if __name__ == "__main__":
    import sys

    stage = ("summarise_quality" if "--summarise" in sys.argv[1:] else
             "quality_replicates" if "--replicates" in sys.argv[1:] else "evaluate_arms")
    raise SystemExit(run_main(stage, main, output_flags=("--out", "--figures")))
