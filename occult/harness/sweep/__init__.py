"""Latency sweeps of one MoE layer: Occult against MegaBlocks, Tutel, DeepSpeed, a naive EP, HF and FSDP.

Launch on GPUs (one process per GPU, D = GPUs):

    torchrun --nproc_per_node=2 -m occult.harness.sweep --kind prefill --shapes olmoe qwen deepseek

and on the CPU (gloo ranks forked here, tiny shapes) for smoke tests:

    python -m occult.harness.sweep --device cpu --dtype float32 --D 2 --kind prefill --shapes tiny --sizes 16 32

Methods whose libraries cannot share a process (the two grouped_gemm builds of MegaBlocks, Tutel's
kernels) run as several sweep processes merged into one CSV: `python -m occult.harness.sweep.parts`.

Kinds and sizes (`--sizes`, per GPU): `prefill` — forward of N tokens (default 2^10 … 2^16);
`decode` — forward of one step of a batch of B sequences, N = B tokens (B ∈ 1, 8, 64, 512);
`train` — forward + backward of B sequences of `--seq-len` 512 tokens (B ∈ 1, 2, 4, 8, 16).

Routing (`--routings`, one or more): `synthetic`, a seeded low-rank router per shape (logits =
(x U) V + b, rank 4: experts whose columns of V are close are picked together); `uniform`, i.i.d.
logits; `trace`, a measured routing trace widened to the shape (`inputs.TraceRouter`). Every input
set is fresh random hidden states x routed by it: ids = top-k of softmax(logits), weights = their
probabilities. All methods receive the SAME (x, ids, weights) at a given point; the router is not
timed. Occult's placement is `occult.routing.placement.greedy_occult` on the co-activation of a
separate calibration batch (rank 0 computes, all receive); `occult-nd<N>` routes with
`occult.routing.pruning.prune_router_score` (at most N devices per token) on that placement.

Methods (`occult.method_names`): Occult's EP layer with its options (`occult`, `occult-nd2`,
`occult-graph`, ...) and the baselines of `occult.harness.baselines`, each optionally with library
settings (`megablocks:grouped_gemm=cutlass`; the row's `baseline_config` names them). The shape's
shared expert (if any) is one replicated SwiGLU added by the harness to every method's output,
timed with it.

Per point (routing, shape, size) the methods run in an order drawn from a seed (`order_seed`,
`order_position`). Each is set up with the shape's seeded global weights, its output (and, for
`train`, dL/dx) checked on a small batch against `occult.kernels.reference.moe_dense_ref` (max
relative error over ranks; above the dtype's tolerance the method is `failed` and not timed), then
timed and freed. `--input-sets` input sets are rotated over `warmup + repeats` steps; each step is
timed with CUDA events (perf_counter on CPU) after a barrier; the per-step time is the max over
ranks; the row gets its median, p10 and p90, `host_ms` (the median host time until the step's call
returns), and the medians of two host probes run before each timed block: `host_probe_us`, a
fixed pure-Python loop (the host CPU's speed at that moment), and `host_launch_us`, issuing tiny
ops on the device (the launch path an eager layer spends its host time in). Peak memory = max over
ranks of `torch.cuda.max_memory_allocated` during the timed loop. Bytes sent per rank come from
each method's own accounting. A method that raises gets `status="error: ..."` (traceback on
stderr) and the sweep goes on; one whose library is missing gets `status="unavailable: ..."`,
never a substitute. The CSV (rank 0, atomic, rewritten after every row) has a `.meta.json`
provenance sidecar; a short table is printed last.
"""
