"""Fine-tuning variants: standard SFT and SFT with collaboration pruning in the forward pass.

Instruction pairs are formatted as a prompt and a response; the loss covers response tokens only.
`train_modules: moe` trains routers and experts (the paper fine-tunes the MoE modules);
`all` trains every parameter. Every variant sees the same data order, steps and seed.
On a GPU the forward runs under bf16 autocast with fused AdamW; CPU runs stay fp32.
`finetune_arms` (and `python -m occult.stages.finetune`) runs all arms of the quality study in one
process, resumably; run as a module it is a logged stage (`occult.logs.run_main`: `--log-json PATH`
gives JSON-lines `start`, `progress` (arms; each arm's steps with `loss` and `lr`) and one `done` or
`failed` record).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

import pandas as pd
import torch

import occult.ep.experts  # noqa: F401  (registers model.experts_kernel "triton")
from occult.config import Config, Variant, parse_variant
from occult.logs import ENV_LOG_JSON, progress, run_main
from occult.provenance import atomic_path, provenance, seed_everything, write_csv

log = logging.getLogger(__name__)

PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
LOG_FLUSH_STEPS = 50


def load_pairs(path: Path) -> list[dict]:
    pairs = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            try:
                row = json.loads(line)
                pairs.append({"instruction": str(row["instruction"]), "response": str(row["response"])})
            except (json.JSONDecodeError, KeyError) as err:
                raise ValueError(f"{path}:{n}: not an instruction pair ({err})") from None
    if not pairs:
        raise ValueError(f"{path}: no instruction pairs")
    return pairs


def encode_pairs(pairs: list[dict], tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [N, seq_len] and labels with -100 on prompt and padding positions."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    ids = torch.full((len(pairs), seq_len), pad, dtype=torch.long)
    labels = torch.full((len(pairs), seq_len), -100, dtype=torch.long)
    for i, pair in enumerate(pairs):
        prompt = tokenizer(PROMPT_TEMPLATE.format(instruction=pair["instruction"]),
                           add_special_tokens=False)["input_ids"]
        answer = tokenizer(pair["response"], add_special_tokens=False)["input_ids"] + [eos]
        prompt = prompt[: seq_len // 2]
        seq = (prompt + answer)[:seq_len]
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(prompt) : len(seq)] = torch.tensor(seq[len(prompt):])
    return ids, labels


def trainable_parameters(model, train_modules: str) -> list[torch.nn.Parameter]:
    """`moe`: router and expert weights only; `all`: every parameter."""
    from occult.models.moe import moe_layers

    if train_modules == "all":
        return [p for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    params = []
    for layer in moe_layers(model):
        for p in layer.block.parameters():
            p.requires_grad_(True)
            params.append(p)
    return params


def train_variant(model, tokenizer, cfg: Config, variant: Variant, ids: torch.Tensor, labels: torch.Tensor,
                  desc: str, step_trace: Path | None = None) -> list[dict]:
    """Fine-tune `model` in place under the variant's routing; returns one log row per step.
    With `step_trace`, 5 steps after the first 10 are profiled there (`occult.harness.steptrace`)."""
    from occult.harness.steptrace import StepTrace
    from occult.models.moe import set_routing
    from occult.stages.pretrain import autocast_for

    ft = cfg.finetune
    device = next(model.parameters()).device
    rows: list[dict] = []
    if not (variant.trains and ft.steps > 0):
        return rows
    params = trainable_parameters(model, ft.train_modules)
    opt = torch.optim.AdamW(params, lr=ft.lr, weight_decay=0.0, **({"fused": True} if device.type == "cuda" else {}))
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.cat([torch.randperm(len(ids), generator=gen)
                       for _ in range(math.ceil(ft.steps * ft.batch_size / len(ids)) + 1)])
    pad = tokenizer.pad_token_id
    start = time.perf_counter()
    pending: list[tuple[dict, torch.Tensor]] = []
    trace = StepTrace(step_trace, total=ft.steps, meta={"loop": "finetune", "arm": desc, "rows_per_step": ft.batch_size,
                                        "seq_len": ft.seq_len})
    model.train()
    with progress(range(ft.steps), desc=desc, unit="step") as bar:
        for step in bar:
            trace.step()
            batch = order[step * ft.batch_size : (step + 1) * ft.batch_size]
            lr = ft.lr * 0.5 * (1 + math.cos(math.pi * step / ft.steps))
            for group in opt.param_groups:
                group["lr"] = lr
            attention = (labels[batch] != -100) | (ids[batch] != pad)
            with autocast_for(device):
                out = model(input_ids=ids[batch].to(device), attention_mask=attention.long().to(device),
                            labels=labels[batch].to(device))
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            row = {"step": step, "loss": float("nan"), "lr": lr, "elapsed_s": time.perf_counter() - start}
            pending.append((row, out.loss.detach()))
            if len(pending) >= LOG_FLUSH_STEPS or step + 1 == ft.steps:
                for r, loss in pending:       # one device sync per LOG_FLUSH_STEPS steps
                    r["loss"] = float(loss)
                bar.log(loss=pending[-1][0]["loss"], lr=pending[-1][0]["lr"])
                pending.clear()
            rows.append(row)
        trace.close()
    model.eval()
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.requires_grad_(True)
    set_routing(model, None)
    return rows


def save_variant(model, tokenizer, meta: dict, out_dir: Path, log_csv: Path, rows: list[dict]) -> None:
    """The loss log, then the checkpoint (renamed into place last: an arm whose folder exists is done)."""
    write_csv(log_csv, pd.DataFrame(rows, columns=["step", "loss", "lr", "elapsed_s"]), meta)
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "occult_variant.json").write_text(json.dumps(meta, indent=2, default=str))


def variant_meta(cfg: Config, variant: Variant, **extra) -> dict:
    ft = cfg.finetune
    return provenance(cfg.hash(), cfg.seed, stage="finetune", variant=variant.name,
                      max_devices=variant.max_devices, method=variant.method, devices=ft.devices,
                      gate_weights=ft.gate_weights, train_modules=ft.train_modules, steps=ft.steps, **extra)


def finetune(cfg: Config, variant_name: str, model_dir: Path, data_dir: Path, profile_dir: Path,
             placements_dir: Path, out_dir: Path, log_csv: Path) -> None:
    """Fine-tune one variant and save it (checkpoint + tokenizer + `occult_variant.json`)."""
    from occult.models.moe import load_checkpoint, set_routing
    from occult.routing.variants import routing_for_variant

    variant = parse_variant(variant_name)
    seed_everything(cfg.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_checkpoint(model_dir, device=device, experts_kernel=cfg.model.experts_kernel)
    start = time.perf_counter()
    rows: list[dict] = []
    routing = routing_for_variant(cfg, variant, placements_dir, profile_dir, model)   # bad placement/profile: fail first
    if variant.trains and cfg.finetune.steps > 0:
        ids, labels = encode_pairs(load_pairs(data_dir / "instructions.jsonl"), tokenizer, cfg.finetune.seq_len)
        set_routing(model, routing)
        rows = train_variant(model, tokenizer, cfg, variant, ids, labels, desc=f"finetune {variant.name}")
    set_routing(model, None)
    save_variant(model, tokenizer, variant_meta(cfg, variant), out_dir, log_csv, rows)
    log.info("variant %s: %d steps in %.1f s", variant.name, len(rows), time.perf_counter() - start)


def finetune_arms(cfg: Config, arms: list, model_dir: Path, data_dir: Path, profile_dir: Path,
                  placements_dir: Path, out_root: Path, logs_root: Path,
                  time_limit_s: float | None = None, shard: tuple[int, int] = (0, 1),
                  step_trace: Path | None = None) -> list[str]:
    """Fine-tune every arm of the quality study in one process (data encoded once, the base
    weights reloaded from memory for each arm). Arm `a` goes to `out_root/<a.name>` with its loss
    log at `logs_root/<a.name>_log.csv`; `raw` is the base model itself and is skipped. Arms whose
    output exists are skipped (resumable); no new arm starts after `time_limit_s`. `shard` (k, n)
    keeps the arms at positions k, k + n, ... (one process per GPU). With `step_trace`, shard 0
    profiles a few steps of its first arm there. Returns the names of this shard's arms still missing."""
    from occult.models.moe import load_checkpoint, set_routing
    from occult.routing.variants import arm_config, arms_before_deadline, routing_for_variant, shard_of

    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    todo = [a for a in shard_of(arms, shard) if parse_variant(a.variant).trains and not (out_root / a.name).is_dir()]
    if not todo:
        return []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_checkpoint(model_dir, device=device, experts_kernel=cfg.model.experts_kernel)
    base_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    encoded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    pairs = load_pairs(data_dir / "instructions.jsonl")
    missing = []
    with progress(todo, desc="arms", unit="arm") as bar:
        for arm in arms_before_deadline(bar, deadline, missing):
            arm_cfg = arm_config(cfg, arm)
            variant = parse_variant(arm.variant)
            seq_len = arm_cfg.finetune.seq_len
            if seq_len not in encoded:
                encoded[seq_len] = encode_pairs(pairs, tokenizer, seq_len)
            seed_everything(arm_cfg.seed)
            model.load_state_dict(base_state)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            set_routing(model, routing_for_variant(arm_cfg, variant, placements_dir, profile_dir, model))
            rows = train_variant(model, tokenizer, arm_cfg, variant, *encoded[seq_len], desc=f"finetune {arm.name}",
                                 step_trace=step_trace if shard[0] == 0 and arm is todo[0] else None)
            peak = {"peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)} if device == "cuda" else {}
            meta = variant_meta(arm_cfg, variant, arm=arm.name, **peak)
            save_variant(model, tokenizer, meta, out_root / arm.name, logs_root / f"{arm.name}_log.csv", rows)
            log.info("arm %s: %d steps in %.1f s", arm.name, len(rows), time.perf_counter() - start)
    return missing


def main(argv: list[str] | None = None) -> int:
    """`python -m occult.stages.finetune --config C --model M --data D --profile P --placements DIR
    --out ROOT --logs LOGDIR [--time-limit S] [--done JSON]`: every arm of the quality study."""
    import argparse

    from occult.config import load_config
    from occult.routing.variants import parse_shard, quality_arms, write_arms_done

    parser = argparse.ArgumentParser(prog="python -m occult.stages.finetune", description=main.__doc__)
    for flag in ("--config", "--model", "--data", "--profile", "--placements", "--out", "--logs"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--time-limit", type=float, default=None, help="start no arm after this many seconds")
    parser.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="K/N",
                        help="only the arms at positions K, K+N, ... (e.g. one process per GPU)")
    parser.add_argument("--step-trace", metavar="JSON", help="shard 0: profile 5 steps of its first arm here")
    parser.add_argument("--done", metavar="JSON", help="once every arm is saved, record them here (the workflow's output)")
    parser.add_argument("--log-json", metavar="PATH",
                        help=f"append JSON-lines logs here (default: ${ENV_LOG_JSON}); read by the entry point")
    args = parser.parse_args(argv)
    if args.done and args.shard != (0, 1):
        parser.error("--done records every arm: run without --shard")
    # no allocator cap here (evaluation has one): fine-tuning peaks at 34.5-39 GiB per process, so three
    # fit an H200 uncapped (quality_upcycle_v3), while a third of it failed two full-module arms (v4)
    cfg = load_config(args.config)
    arms = quality_arms(cfg)
    missing = finetune_arms(cfg, arms, Path(args.model), Path(args.data), Path(args.profile),
                            Path(args.placements), Path(args.out), Path(args.logs), args.time_limit, args.shard,
                            Path(args.step_trace) if args.step_trace else None)
    if missing:
        print(f"finetune: time limit reached; {len(missing)} arms left ({', '.join(missing)}); run again",
              file=sys.stderr)
        return 3
    if args.done:
        write_arms_done(Path(args.done), [a for a in arms if parse_variant(a.variant).trains], Path(args.out),
                        "finetune_arms")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("finetune_arms", main, output_flags=("--out", "--logs")))
