"""Latency sweeps of one MoE layer: Occult against MegaBlocks, Tutel, a naive EP, HF and FSDP.

Launch on GPUs (one process per GPU, D = GPUs):

    torchrun --nproc_per_node=2 -m occult.harness.sweep --kind prefill --shapes olmoe qwen deepseek

and on the CPU (gloo ranks forked here, tiny shapes) for smoke tests:

    python -m occult.harness.sweep --device cpu --dtype float32 --D 2 --kind prefill --shapes tiny --sizes 16 32

Kinds and sizes (`--sizes`, per GPU): `prefill` — forward of N tokens (default 2^10 … 2^16);
`decode` — forward of one step of a batch of B sequences, N = B tokens (B ∈ 1, 8, 64, 512);
`train` — forward + backward of B sequences of `--seq-len` 512 tokens (B ∈ 1, 2, 4, 8, 16).

Routing. Each shape gets a seeded low-rank router (logits = (x U) V + b, rank 4: experts whose
columns of V are close are picked together, so co-activation has structure). Every input set
is fresh random hidden states x routed by it: ids = top-k of softmax(logits), weights = their
probabilities. All methods receive the SAME (x, ids, weights) at a given point; the router
itself is not timed. Occult's placement is `occult.routing.placement.greedy_occult` on the co-activation
of a separate calibration batch (computed on rank 0, broadcast). `occult-nd<N>` routes with
`occult.routing.pruning.prune_router_score` (at most N devices per token) on that placement.

Methods: `occult` (exact, dedup dispatch, `occult.ep.layer.ep_moe`), `occult-nd2`, `occult-nd1`,
and the baselines of `occult.harness.baselines` (`megablocks`, `tutel`, `naive`, `hf`, `fsdp`,
`deepspeed`). The shape's shared expert (if any) is one replicated SwiGLU added by the harness to
every method's output, timed with it.

Per (shape, method): set up the method with the shape's seeded global weights, then check its
output (and, for `train`, dL/dx) on a small batch against `occult.kernels.reference.moe_dense_ref`
(max relative error over ranks; above the dtype's tolerance the method is `failed` and not timed).
Per size: `--input-sets` input sets are generated and rotated over `warmup + repeats` steps; each
step is timed with CUDA events (perf_counter on CPU) after a barrier; the per-step time is the max
over ranks; the row gets its median, p10 and p90, and `host_ms`, the median host time until the
step's call returns (a sync inside the call included, GPU work still queued excluded: a layer is
host-bound where host_ms is close to median_ms), and two host probes run just before each timed
block, their medians: `host_probe_us`, a fixed pure-Python loop (`host_probe_us()`: the host CPU's
speed at that moment, which on the lent H200 machines moves up to 2x within seconds), and
`host_launch_us`, issuing `HOST_LAUNCHES` tiny ops on the device (`host_launch_us()`: the launch
path an eager layer spends its host time in). Peak memory = max over ranks of
`torch.cuda.max_memory_allocated` during the timed loop. Bytes sent per rank come from each
method's own accounting (rows, metadata, padding). A method that raises gets `status="error: ..."`
(traceback on stderr) and the sweep goes on; one whose library is missing gets
`status="unavailable: ..."`, never a substitute. The CSV (rank 0, atomic, rewritten after every
row) has a `.meta.json` provenance sidecar; a short table is printed last.
"""
