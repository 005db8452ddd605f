"""Fine-tuning variants: standard SFT and SFT with collaboration pruning in the forward pass.

Instruction pairs are formatted as a prompt and a response; the loss covers response tokens only.
`train_modules: moe` trains routers and experts (the paper fine-tunes the MoE modules);
`all` trains every parameter. Every variant sees the same data order, steps and seed.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from occult.config import Config, parse_variant
from occult.provenance import atomic_path, provenance, seed_everything, write_csv

log = logging.getLogger(__name__)

PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"


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
    from occult.models import moe_layers

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


def finetune(cfg: Config, variant_name: str, model_dir: Path, data_dir: Path, profile_dir: Path,
             placements_dir: Path, out_dir: Path, log_csv: Path) -> None:
    """Fine-tune one variant and save it (checkpoint + tokenizer + `occult_variant.json`)."""
    from occult.models import load_checkpoint, set_routing
    from occult.variants import routing_for_variant

    variant = parse_variant(variant_name)
    ft = cfg.finetune
    seed_everything(cfg.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_checkpoint(model_dir, device=device)
    routing = routing_for_variant(cfg, variant, placements_dir, profile_dir)
    set_routing(model, routing)
    rows: list[dict] = []
    start = time.perf_counter()
    if variant.trains and ft.steps > 0:
        pairs = load_pairs(data_dir / "instructions.jsonl")
        ids, labels = encode_pairs(pairs, tokenizer, ft.seq_len)
        params = trainable_parameters(model, ft.train_modules)
        opt = torch.optim.AdamW(params, lr=ft.lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(cfg.seed)
        order = torch.cat([torch.randperm(len(ids), generator=gen)
                           for _ in range(math.ceil(ft.steps * ft.batch_size / len(ids)) + 1)])
        model.train()
        for step in tqdm(range(ft.steps), desc=f"finetune {variant.name}", mininterval=2):
            batch = order[step * ft.batch_size : (step + 1) * ft.batch_size]
            lr = ft.lr * 0.5 * (1 + math.cos(math.pi * step / ft.steps))
            for group in opt.param_groups:
                group["lr"] = lr
            attention = (labels[batch] != -100) | (ids[batch] != tokenizer.pad_token_id)
            out = model(input_ids=ids[batch].to(device), attention_mask=attention.long().to(device),
                        labels=labels[batch].to(device))
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            rows.append({"step": step, "loss": float(out.loss), "lr": lr,
                         "elapsed_s": time.perf_counter() - start})
        model.eval()
    set_routing(model, None)
    meta = provenance(cfg.hash(), cfg.seed, stage="finetune", variant=variant.name,
                      max_devices=variant.max_devices, method=variant.method,
                      gate_weights=ft.gate_weights, train_modules=ft.train_modules, steps=ft.steps)
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "occult_variant.json").write_text(json.dumps(meta, indent=2, default=str))
    write_csv(log_csv, pd.DataFrame(rows, columns=["step", "loss", "lr", "elapsed_s"]), meta)
    log.info("variant %s: %d steps in %.1f s", variant.name, len(rows), time.perf_counter() - start)

