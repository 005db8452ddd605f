"""Pre-training step time of the configured model under each expert kernel, side by side (a bench).

    python -m occult.harness.trainbench --config CONFIG --out trainbench.csv [--steps 20 --warmup 5]

Builds the model of `cfg.model` (random weights, seeded; random token ids of the pre-training batch
shape, so no data is needed), and for each of `occult.models.moe.EXPERTS_KERNELS` runs `--warmup` then
`--steps` optimizer steps exactly as pre-training does (bf16 autocast and fused AdamW on a GPU,
gradient clipping, the load-balancing loss). Every kernel starts from the same weights and sees the
same batches. One row per kernel: median and mean ms per step (CUDA-synchronised wall time of each
step), tokens per second, peak memory, the first step's loss and its difference from the first
kernel's (the two paths compute the same model); on a GPU also the host syncs of one more step and
the lines that made them. Runs on a CPU only under TRITON_INTERPRET=1 and for tiny configs (the tests).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable

import pandas as pd
import torch

import occult.ep.experts  # noqa: F401  (registers model.experts_kernel "triton")
from occult.config import load_config
from occult.logs import progress, run_main
from occult.models.moe import EXPERTS_KERNELS, use_experts_kernel
from occult.stages.pretrain import CLIP_NORM, autocast_for, build_base_model, make_optimizer
from occult.provenance import provenance, write_csv


def sync_sites(step: Callable[[], object]) -> dict[str, int]:
    """Host syncs made by one call of `step` on a CUDA device, by the Python line that asked for
    them (`file:line` -> count): CUDA's sync debug mode warns at every synchronising op. Syncs
    inside the autograd engine's own threads may be missed."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower())
    return dict(sites.most_common())


def bench_kernel(model, kernel: str, batches: list[torch.Tensor], warmup: int, lr: float,
                 use_aux: bool) -> dict:
    """Step times of `model` (trained in place) with `kernel`; `batches` = warmup + timed steps.
    On a GPU, one more step under CUDA's sync debug mode counts its host syncs (`sync_sites`)."""
    device = next(model.parameters()).device
    use_experts_kernel(model, kernel)
    optimizer = make_optimizer(model, lr, fused=device.type == "cuda")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step(ids_BS: torch.Tensor) -> torch.Tensor:
        with autocast_for(device):
            out = model(input_ids=ids_BS, labels=ids_BS, output_router_logits=use_aux, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.loss.detach()

    times_ms, first_loss = [], None
    model.train()
    for i, ids_BS in enumerate(progress(batches, desc=f"trainbench {kernel}", unit="step")):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step(ids_BS)
        if cuda:
            torch.cuda.synchronize()
        if i == 0:
            first_loss = float(loss)
        if i >= warmup:
            times_ms.append((time.perf_counter() - start) * 1e3)
    tokens = batches[0].numel()
    median = statistics.median(times_ms)
    sites = sync_sites(lambda: step(batches[-1])) if cuda else {}
    return {"experts_kernel": kernel, "steps": len(times_ms), "median_ms": median,
            "mean_ms": statistics.fmean(times_ms), "tokens_per_s": tokens / median * 1e3,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
            "first_loss": first_loss,
            "host_syncs_per_step": sum(sites.values()) if cuda else float("nan"),
            "sync_sites": "; ".join(f"{site} x{count}" for site, count in list(sites.items())[:8])}


def run_trainbench(config: Path, out: Path, steps: int, warmup: int, vocab_size: int | None = None) -> pd.DataFrame:
    cfg = load_config(config)
    if steps < 1 or warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {steps} and {warmup}")
    if cfg.model.source == "upcycle":
        from occult.models.gguf import GGUFReader, find_gguf
        from occult.models.gguf import dense_shape
        vocab = dense_shape(GGUFReader(find_gguf(cfg.model.checkpoint))).vocab_size
    else:
        vocab = vocab_size or cfg.data.vocab_size
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(cfg.seed)
    batches = [torch.randint(0, vocab, (cfg.pretrain.batch_size, cfg.pretrain.seq_len), generator=generator).to(device)
               for _ in range(warmup + steps)]
    base = build_base_model(cfg, vocab, {"pad_token_id": None, "bos_token_id": 0, "eos_token_id": 0})
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    rows = []
    for kernel in EXPERTS_KERNELS:
        base.load_state_dict(initial)
        torch.manual_seed(cfg.seed)
        rows.append(bench_kernel(base.to(device), kernel, batches, warmup, cfg.pretrain.lr,
                                 cfg.pretrain.router_aux_loss > 0))
    table = pd.DataFrame(rows)
    table["first_loss_diff"] = table["first_loss"] - table["first_loss"].iloc[0]
    table["speedup_vs_first"] = table["median_ms"].iloc[0] / table["median_ms"]
    meta = provenance(cfg.hash(), cfg.seed, stage="trainbench")
    meta.update({"tokens_per_step": cfg.pretrain.batch_size * cfg.pretrain.seq_len, "vocab_size": vocab,
                 "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"})
    write_csv(out, table, meta=meta)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult.harness.trainbench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="workflow config (its model and pretrain sections)")
    parser.add_argument("--out", required=True, help="CSV to write")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per kernel")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (autotuning, allocator)")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: data.vocab_size")
    parser.add_argument("--log-json", metavar="PATH", help="append JSON-lines logs here; read by the entry point")
    args = parser.parse_args(argv)
    table = run_trainbench(Path(args.config), Path(args.out), args.steps, args.warmup, args.vocab_size)
    print(table[["experts_kernel", "median_ms", "tokens_per_s", "peak_mem_gib", "first_loss_diff",
                 "speedup_vs_first"]].to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(run_main("trainbench", main, output_flags=("--out",)))
