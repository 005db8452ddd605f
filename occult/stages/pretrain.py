"""Model stage (scratch, upcycle): pre-train the tiny OLMoE, or continue pre-training a MoE upcycled
from a dense GGUF model (occult.models.upcycle), and measure whether its routers learned structure.

`pretrain(cfg, data_dir, out_dir, log_csv, structure_json)` trains on the train split, packed as
one token stream (documents in seeded random order, each followed by EOS) cut into windows of
`cfg.pretrain.seq_len`; batches draw windows without replacement, reshuffling each epoch. AdamW
(betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine decay to 10% of the peak
rate, gradient clipping at 1.0, the Switch-style load-balancing loss of transformers weighted by
`cfg.pretrain.router_aux_loss`. Held-out perplexity is measured on up to `EVAL_TOKENS` held-out
tokens every `pretrain.eval_every` steps (default: five times) and at the end. With
`pretrain.target_heldout_ppl`, training stops at the first measurement at or below the target;
`pretrain.steps` is then a budget (the learning-rate schedule spans it either way). The base
model's own seed (`pretrain.seed`, default the top-level seed) sets its initial draws and the order
of its training data; the held-out windows use the top-level seed, so base models of one config are
measured on the same tokens.

On a GPU the forward runs under bf16 autocast (fp32 master weights, fused AdamW); CPU runs are
unchanged. Training is resumable: every `CHECKPOINT_EVERY_S` seconds, when `time_limit_s` is
reached and on SIGTERM (as `timeout` sends), the model, optimizer, sampler and RNG state and the
log rows so far go to `<out_dir>.resume/state.pt`; the next call with the same config continues
from there (bit-identical on CPU to an uninterrupted run) and deletes it once the checkpoint is
saved. An interrupted call raises `PretrainPaused` (the CLI exits non-zero).

Data parallel: started by `torchrun --nproc_per_node=N` (`occult pretrain`), each of the N ranks
draws the same global batch from the same seeded sampler, keeps its 1/N share of the rows and
averages the gradients over the ranks (one all-reduce per step) before clipping and the optimizer
step, so every rank holds the same weights. The language-model loss is then that of the global
batch up to summation order; the load-balancing loss is averaged over the ranks' shares (it is not
linear in the tokens, so it differs slightly from the one-process value). Rank 0 alone writes the
outputs and the resume state.

Outputs: the checkpoint and tokenizer in `out_dir` (written to a temporary sibling, then renamed),
the per-step log CSV (step, train_loss = LM loss only, aux_loss, lr, heldout_ppl where measured,
elapsed_s; provenance in `<csv>.meta.json`) and `structure_json`.

Structure measure (per MoE layer, on the held-out routing of the final model). Take a random
token and two distinct experts (X, Y) of its top-k in random order; `pair_mi_bits` is the mutual
information I(X; Y). Even routing with no structure has I > 0 (X != Y and loads are unequal),
so the same statistic is computed for a *null routing*: the same number of tokens, each choosing k
distinct experts independently of every other layer and token, by Gumbel-top-k sampling with
weights equal to the observed loads (loads are matched up to sampling noise). `excess_pair_mi_bits`
= observed - null; clearly positive means tokens select experts in correlated groups, which is
what Occult's placement exploits. Also reported: E[C_T] (distinct devices per token) for the best
of `PLACEMENT_TRIALS` random balanced placements on `cfg.finetune.devices` devices, observed vs
null, and the held-out perplexity against the unigram baseline (the held-out cross-entropy of
add-one-smoothed train-split token frequencies).
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import occult.ep.experts  # noqa: F401  (registers model.experts_kernel "triton")
from occult.config import Config, PretrainConfig
from occult.logs import StagePaused, progress
from occult.models.moe import build_tiny_olmoe, count_parameters, use_experts_kernel
from occult.routing.profiling import (
    TokenWindows,
    corpus_windows,
    read_corpus,
    route_windows,
    shuffled,
    tokenize_documents,
)
from occult.provenance import atomic_path, provenance, seed_everything, write_csv, write_json
from occult.routing.structure import PLACEMENT_TRIALS, inheritance_summary, routing_structure

log = logging.getLogger(__name__)
from occult.harness.steptrace import StepTrace


EVAL_TOKENS = 16_384
EVAL_POINTS = 5
FINAL_LR_FRACTION = 0.1
CLIP_NORM = 1.0
WEIGHT_DECAY = 0.1
CHECKPOINT_EVERY_S = 240.0
STOP_CHECK_STEPS = 10             # data parallel: how often the ranks agree on stopping and saving
LOG_FLUSH_STEPS = 50


class PretrainPaused(StagePaused):
    """Training stopped early (time limit or SIGTERM) after saving its resume state (CLI: exit 3)."""


def load_tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    if not (tokenizer_dir / "tokenizer.json").is_file() and not (tokenizer_dir / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"tokenizer directory {tokenizer_dir} has no tokenizer.json")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer_dir}: no eos_token")
    return tokenizer


def lr_at(step: int, train_cfg: PretrainConfig) -> float:
    """Linear warm-up over `warmup_steps`, then cosine from `lr` down to FINAL_LR_FRACTION * lr."""
    if step < train_cfg.warmup_steps:
        return train_cfg.lr * (step + 1) / train_cfg.warmup_steps
    span = max(1, train_cfg.steps - train_cfg.warmup_steps)
    decayed = min(1.0, (step - train_cfg.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * decayed))
    return train_cfg.lr * (FINAL_LR_FRACTION + (1.0 - FINAL_LR_FRACTION) * cosine)


def make_optimizer(model: nn.Module, lr: float, fused: bool = False) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": WEIGHT_DECAY}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if fused else {}))


class WindowSampler:
    """Batches of non-overlapping windows of a token stream, reshuffled every epoch (seeded)."""

    def __init__(self, ids_N: np.ndarray, seq_len: int, batch_size: int, seed: int):
        rows = len(ids_N) // seq_len
        if rows < 1:
            raise ValueError(f"train split has {len(ids_N)} tokens, fewer than one window of {seq_len}")
        self.windows_RS = torch.from_numpy(ids_N[: rows * seq_len].astype(np.int64)).view(rows, seq_len)
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.order: list[int] = []
        self.epochs = 0

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "order": list(self.order), "epochs": self.epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.order = list(state["order"])
        self.epochs = int(state["epochs"])

    def next_batch(self) -> Tensor:
        picks = []
        while len(picks) < self.batch_size:
            if not self.order:
                self.order = torch.randperm(len(self.windows_RS), generator=self.generator).tolist()
                self.epochs += 1
            picks.append(self.order.pop())
        return self.windows_RS[picks]


@torch.no_grad()
def heldout_nll(model: nn.Module, windows: TokenWindows, batch_rows: int = 16) -> tuple[float, int]:
    """(summed next-token NLL, predicted tokens) over real (unpadded) positions of `windows`."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows.input_ids_BS), batch_rows):
        device = next(model.parameters()).device
        ids_BS = windows.input_ids_BS[start:start + batch_rows].to(device)
        mask_BS = windows.attention_mask_BS[start:start + batch_rows].to(device)
        logits_BSV = model(input_ids=ids_BS, attention_mask=mask_BS, use_cache=False).logits
        valid = (mask_BS[:, 1:] * mask_BS[:, :-1]).bool()
        nll = F.cross_entropy(logits_BSV[:, :-1][valid].float(), ids_BS[:, 1:][valid], reduction="sum")
        total += float(nll)
        count += int(valid.sum())
    model.train(was_training)
    return total, count


def unigram_ppl(train_ids_N: np.ndarray, windows: TokenWindows, vocab_size: int) -> float:
    """Perplexity on the held-out targets of add-one-smoothed unigram frequencies of the train split."""
    counts = np.bincount(train_ids_N, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    mask = windows.attention_mask_BS.numpy()
    valid = (mask[:, 1:] * mask[:, :-1]).astype(bool)
    targets = windows.input_ids_BS.numpy()[:, 1:][valid]
    return float(np.exp(-log_p[targets].mean()))


# --------------------------------------------------------------------------- the stage


def autocast_for(device: torch.device):
    """bf16 autocast on a GPU; a no-op context on CPU (CPU numerics stay fp32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class StopRequest:
    """Set by SIGTERM (while installed) or by the time limit; polled once per step."""

    def __init__(self, time_limit_s: float | None):
        self.deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
        self.signalled = False

    @property
    def due(self) -> bool:
        return self.signalled or (self.deadline is not None and time.monotonic() >= self.deadline)

    @contextlib.contextmanager
    def on_sigterm(self):
        def handler(signum, frame):
            self.signalled = True
        try:
            previous = signal.signal(signal.SIGTERM, handler)
        except ValueError:            # not the main thread: no handler, the time limit still works
            yield
            return
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)


def data_parallel_rank() -> tuple[int, int]:
    """(world size, rank) of the initialised default process group, (1, 0) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def average_gradients(params: list[nn.Parameter], world: int) -> None:
    """Replace each gradient by its mean over the ranks: one all-reduce of all of them, flattened
    (a parameter without a gradient contributes zeros, so every rank flattens the same layout)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.div_(world)
    for p, mean in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
        if p.grad is None:
            p.grad = mean
        else:
            p.grad.copy_(mean)


def flags_agreed(world: int, device: torch.device, *flags: bool) -> list[bool]:
    """Each flag, true on every rank once it is true on any rank (one all-reduce for all)."""
    if world == 1:
        return list(flags)
    values = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v) for v in values.tolist()]


def resume_dir_of(out_dir: Path) -> Path:
    return out_dir.with_name(out_dir.name + ".resume")


def save_resume_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, sampler: WindowSampler,
                      rows: list[dict[str, Any]], config_hash: str) -> None:
    state = {
        "config_hash": config_hash,
        "step": len(rows),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler": sampler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "rows": rows,
    }
    with atomic_path(path) as tmp:
        tmp.mkdir()
        torch.save(state, tmp / "state.pt")


def load_resume_state(path: Path, config_hash: str) -> dict[str, Any] | None:
    """The saved state of an interrupted run of the same config (None if there is none)."""
    file = path / "state.pt"
    if not file.is_file():
        return None
    state = torch.load(file, map_location="cpu", weights_only=False)
    if state.get("config_hash") != config_hash:
        raise ValueError(f"{file}: resume state of config {state.get('config_hash')}, not {config_hash}; "
                         "delete it to start over")
    return state


def eval_interval(train_cfg: PretrainConfig) -> int:
    """Steps between held-out measurements: `eval_every`, else a fifth of the steps."""
    return train_cfg.eval_every or max(1, train_cfg.steps // EVAL_POINTS)


def reached_target(rows: list[dict[str, Any]], train_cfg: PretrainConfig) -> bool:
    """Whether the last measured held-out perplexity is at or below `target_heldout_ppl`."""
    measured = [row["heldout_ppl"] for row in rows if not math.isnan(row["heldout_ppl"])]
    return train_cfg.target_heldout_ppl is not None and bool(measured) and measured[-1] <= train_cfg.target_heldout_ppl


def train(model: nn.Module, sampler: WindowSampler, heldout: TokenWindows, train_cfg: PretrainConfig,
          eval_every: int, *, resume_dir: Path | None = None, config_hash: str = "",
          time_limit_s: float | None = None, step_trace: Path | None = None) -> list[dict[str, Any]]:
    """The training loop; returns one log row per step (fewer than `steps` where the held-out
    perplexity reached `target_heldout_ppl`).

    With `resume_dir`, continues from a saved state there and saves one every
    CHECKPOINT_EVERY_S seconds and before raising `PretrainPaused` (time limit or SIGTERM).
    Under an initialised process group the ranks train data-parallel (module docstring).
    With `step_trace`, rank 0 writes a profile of 5 steps after the first 10 there (`occult.harness.steptrace`).
    """
    device = next(model.parameters()).device
    world, rank = data_parallel_rank()
    if train_cfg.batch_size % world:
        raise ValueError(f"pretrain.batch_size: {train_cfg.batch_size} rows do not split over {world} "
                         "data-parallel ranks")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(model, train_cfg.lr, fused=device.type == "cuda")
    use_aux = train_cfg.router_aux_loss > 0
    rows: list[dict[str, Any]] = []
    state = load_resume_state(resume_dir, config_hash) if resume_dir is not None else None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        rows = state["rows"]
    first_step = len(rows)
    elapsed_before = rows[-1]["elapsed_s"] if rows else 0.0
    start = time.perf_counter()
    last_save = time.monotonic()
    stop = StopRequest(time_limit_s)
    trace = StepTrace(step_trace if rank == 0 else None, total=train_cfg.steps - first_step, meta={"loop": "pretrain", "first_step": first_step,
                                                                "tokens_per_step": train_cfg.batch_size * train_cfg.seq_len,
                                                                "data_parallel_ranks": world})
    pending: list[tuple[dict[str, Any], Tensor, Tensor | None]] = []   # rows whose losses are still on the device

    def flush() -> None:
        if pending and world > 1:       # the logged losses are the ranks' mean (a collective: every
            # rank flushes at the same steps)
            values = torch.stack([torch.stack([loss.float(), aux.float() if aux is not None else loss.new_zeros(())])
                                  for _, loss, aux in pending])
            dist.all_reduce(values)
            values /= world
            pending[:] = [(row, mean[0], mean[1] if aux is not None else None)
                          for (row, _, aux), mean in zip(pending, values)]
        for row, loss, aux in pending:
            aux_value = float(aux) if aux is not None else 0.0
            row["aux_loss"] = aux_value
            row["train_loss"] = float(loss) - train_cfg.router_aux_loss * aux_value
        if pending:     # the newest known losses go to the bar and its JSON progress records
            row = pending[-1][0]
            bar.log(loss=row["train_loss"], aux_loss=row["aux_loss"], lr=row["lr"])
        pending.clear()

    model.train()
    last_step = first_step if reached_target(rows, train_cfg) else train_cfg.steps
    bar = progress(range(first_step, last_step), desc="pretrain", unit="step", initial=first_step,
                   total=train_cfg.steps, disable=rank != 0)
    with bar, stop.on_sigterm():        # the bar closes (a final progress record) however the loop ends
        for step in bar:
            trace.step()
            # data parallel: the ranks agree every STOP_CHECK_STEPS steps (one tiny all-reduce and
            # host sync), so that all of them save and stop at the same step
            due = save_due = False
            if world == 1 or step % STOP_CHECK_STEPS == 0:
                due, save_due = flags_agreed(world, device, stop.due,
                                             time.monotonic() - last_save >= CHECKPOINT_EVERY_S)
            if resume_dir is not None and (due or save_due):
                flush()
                if rank == 0:
                    save_resume_state(resume_dir, model, optimizer, sampler, rows, config_hash)
                if world > 1:
                    dist.barrier()
                last_save = time.monotonic()
                if due:
                    raise PretrainPaused(f"pretraining paused at step {step} of {train_cfg.steps}; "
                                         f"state in {resume_dir}; run the same command again to continue")
            lr = lr_at(step, train_cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            ids_BS = sampler.next_batch().chunk(world)[rank].to(device)     # this rank's share
            with autocast_for(device):
                out = model(input_ids=ids_BS, labels=ids_BS, output_router_logits=use_aux, use_cache=False)
            out.loss.backward()
            if world > 1:
                average_gradients(params, world)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            row = {"step": step + 1, "train_loss": float("nan"), "aux_loss": 0.0, "lr": lr, "heldout_ppl": float("nan")}
            pending.append((row, out.loss.detach(), out.aux_loss.detach() if use_aux else None))
            if (step + 1) % eval_every == 0 or step + 1 == train_cfg.steps:
                flush()
                nll, count = heldout_nll(model, heldout)
                row["heldout_ppl"] = math.exp(nll / count)
                bar.log(heldout_ppl=row["heldout_ppl"])
            elif len(pending) >= LOG_FLUSH_STEPS:
                flush()
            row["elapsed_s"] = elapsed_before + time.perf_counter() - start
            rows.append(row)
            # the ranks measured the same weights; they still agree, so that all stop at one step
            if not math.isnan(row["heldout_ppl"]) and flags_agreed(world, device, reached_target(rows, train_cfg))[0]:
                break
        flush()
        trace.close()
    model.eval()
    return rows


def build_base_model(cfg: Config, vocab_size: int, token_ids: dict[str, int | None]) -> nn.Module:
    """The model training starts from: a fresh tiny OLMoE (`scratch`) or the MoE upcycled from
    `model.checkpoint`'s dense GGUF (`upcycle`, occult.models.upcycle), with `model.experts_kernel` set."""
    if cfg.model.source == "upcycle":
        from occult.models.gguf import find_gguf
        from occult.models.upcycle import upcycle_gguf

        model = upcycle_gguf(find_gguf(cfg.model.checkpoint), num_experts=cfg.model.num_experts,
                             top_k=cfg.model.top_k, max_seq_len=cfg.model.max_seq_len, token_ids=token_ids,
                             seed=cfg.pretrain.base_seed(cfg.seed), router_noise=cfg.model.router_noise,
                             router_aux_loss=cfg.pretrain.router_aux_loss, init=cfg.model.upcycle_init,
                             drop_ratio=cfg.model.drop_ratio)
        if model.config.vocab_size != vocab_size:
            raise ValueError(f"data.tokenizer_from: the tokenizer has {vocab_size} tokens but {cfg.model.checkpoint} "
                             f"has {model.config.vocab_size} embeddings (set data.tokenizer_from: {cfg.model.checkpoint})")
    else:
        model = build_tiny_olmoe(cfg.model, vocab_size, **token_ids, seed=cfg.pretrain.base_seed(cfg.seed),
                                 router_aux_loss=cfg.pretrain.router_aux_loss)
    use_experts_kernel(model, cfg.model.experts_kernel)
    return model


def save_model_dir(model: nn.Module, tokenizer, out_dir: Path, meta: dict[str, Any]) -> None:
    """save_pretrained into a temporary sibling directory, then rename it onto `out_dir`."""
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / "occult_pretrain.json", meta)
        if out_dir.exists():
            shutil.rmtree(out_dir)


def pretrain(cfg: Config, data_dir: Path, out_dir: Path, log_csv: Path, structure_json: Path,
             time_limit_s: float | None = None, step_trace: Path | None = None) -> None:
    """Pre-train the tiny OLMoE of `cfg.model` on `data_dir` (see the module docstring).

    Resumes from `<out_dir>.resume/` when an interrupted run of the same config left one there;
    raises `PretrainPaused` after saving that state when `time_limit_s` passes or SIGTERM arrives.
    """
    if cfg.model.source not in ("scratch", "upcycle"):
        raise ValueError(f"model.source: pretrain needs 'scratch' or 'upcycle', got {cfg.model.source!r}")
    train_cfg = cfg.pretrain
    if train_cfg.seq_len > cfg.model.max_seq_len:
        raise ValueError(f"pretrain.seq_len: {train_cfg.seq_len} exceeds model.max_seq_len {cfg.model.max_seq_len}")
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    base_seed = train_cfg.base_seed(cfg.seed)
    seed_everything(base_seed)
    wall_start = time.perf_counter()
    tokenizer = load_tokenizer(data_dir / "tokenizer")
    corpus = data_dir / "corpus"
    train_ids_N, _, _ = tokenize_documents(shuffled(read_corpus(corpus / "train.jsonl"), base_seed), tokenizer)
    heldout = corpus_windows(corpus / "heldout.jsonl", tokenizer, EVAL_TOKENS, train_cfg.seq_len, cfg.seed)
    sampler = WindowSampler(train_ids_N, train_cfg.seq_len, train_cfg.batch_size, base_seed)
    eos = tokenizer.eos_token_id
    model = build_base_model(cfg, len(tokenizer), {
        # pad == eos would freeze the shared <|endoftext|> embedding (nn.Embedding padding_idx);
        # padding is masked anyway, so the model config then carries no pad id.
        "pad_token_id": None if tokenizer.pad_token_id in (eos, tokenizer.bos_token_id) else tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos,
        "eos_token_id": eos,
    })
    world, rank = data_parallel_rank()
    model.to(torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu")
    # (CPU results are unchanged by this line; under torchrun the current device is the rank's GPU)
    initial_ppl, initial_inheritance = None, None
    if rank == 0:
        initial_inheritance = inheritance_summary(model, heldout)
    if cfg.model.source == "upcycle" and rank == 0:     # virtual groups: the dense model's (exact at init)
        nll, count = heldout_nll(model, heldout)
        initial_ppl = math.exp(nll / count)
        log.info("upcycled model before training: held-out ppl %.3f", initial_ppl)
    prep_s = time.perf_counter() - wall_start
    resume_dir = resume_dir_of(out_dir)
    rows = train(model, sampler, heldout, train_cfg, eval_every=eval_interval(train_cfg),
                 resume_dir=resume_dir, config_hash=cfg.hash(), time_limit_s=time_limit_s, step_trace=step_trace)
    if rank != 0:               # rank 0 measures and writes; the others wait for it
        dist.barrier()
        return

    nll, count = heldout_nll(model, heldout)
    final_ppl = math.exp(nll / count)
    baseline_ppl = unigram_ppl(train_ids_N, heldout, len(tokenizer))
    routed = route_windows(model, heldout, logit_stats=False, desc="structure")
    layers = routing_structure(routed.ids_LNK, routed.layers.tolist(), routed.num_experts,
                               cfg.finetune.devices, cfg.seed)
    meta = provenance(cfg.hash(), cfg.seed, stage="pretrain", base_seed=base_seed)
    train_summary = {
        "steps": len(rows),
        "step_budget": train_cfg.steps,
        "target_heldout_ppl": train_cfg.target_heldout_ppl,
        "reached_target": reached_target(rows, train_cfg),
        "base_seed": base_seed,
        "tokens_seen": len(rows) * train_cfg.batch_size * train_cfg.seq_len,
        "train_tokens": int(len(train_ids_N)),
        "epochs_started": sampler.epochs,
        "final_train_loss": rows[-1]["train_loss"] if rows else None,
        "prepare_s": prep_s,
        "data_parallel_ranks": world,
        "train_s": rows[-1]["elapsed_s"] if rows else 0.0,
        "parameters": count_parameters(model),
    }
    save_model_dir(model, tokenizer, out_dir, {**meta, "train": train_summary})
    if resume_dir.exists():
        shutil.rmtree(resume_dir)
    columns = ["step", "train_loss", "aux_loss", "lr", "heldout_ppl", "elapsed_s"]
    write_csv(log_csv, pd.DataFrame(rows, columns=columns), meta=meta)

    per_layer = [vars(s) for s in layers]
    mean_keys = [k for k in per_layer[0] if k != "layer"]
    write_json(structure_json, {
        "provenance": meta,
        "definition": {
            "pair_mi_bits": "I(X;Y) of two distinct experts X, Y drawn from one token's top-k (held-out text)",
            "null_pair_mi_bits": "the same for a null routing: k distinct experts per token by Gumbel-top-k "
                                 "with weights = observed loads, independent across tokens",
            "excess_pair_mi_bits": "pair_mi_bits - null_pair_mi_bits (> 0: routers learned co-activation structure)",
            "load_cv": "coefficient of variation of expert loads",
            "ct_best_random_placement": f"E[C_T] on {cfg.finetune.devices} devices, best of {PLACEMENT_TRIALS} "
                                        "random balanced placements (observed routing)",
            "null_ct_best_random_placement": "the same for the null routing",
            "unigram_ppl": "held-out perplexity of add-one-smoothed train-split unigram frequencies",
            "inheritance": "before and after training: layer means of occult.routing.inheritance against the "
                           "virtual-group map (expert j in group j mod E/k; basis inherited for virtual-group "
                           "upcycling, reference otherwise)",
            "unigram_entropy_bits": "log2(unigram_ppl): held-out cross-entropy of that unigram model",
        },
        "heldout_tokens": heldout.tokens,
        "heldout_ppl": final_ppl,
        "initial_heldout_ppl": initial_ppl,     # upcycle: the upcycled model's before training (null for scratch)
        "unigram_ppl": baseline_ppl,
        "ppl_ratio_to_unigram": final_ppl / baseline_ppl,
        "heldout_bits_per_token": math.log2(final_ppl),
        "unigram_entropy_bits": math.log2(baseline_ppl),
        "devices": cfg.finetune.devices,
        # layer means of occult.routing.inheritance on the held-out windows (null: no virtual-group map)
        "inheritance": {"before_training": initial_inheritance, "after_training": inheritance_summary(model, heldout)},
        "layers": per_layer,
        "mean": {k: float(np.mean([row[k] for row in per_layer])) for k in mean_keys},
        "train": train_summary,
    })
    if world > 1:
        dist.barrier()
