# Settings and helpers of the GPU rules (gpu_bench.smk, gpu_host.smk, gpu_quality.smk).

# NVLink multicast off (NCCL NVLS, torch symmetric memory, NVSHMEM): not every host supports it.
NO_MULTICAST = "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
# The routing trace replayed by the EP benchmark's `trace` rows: the upcycled model's held-out
# routing, widened to the layer's 64 experts by the sweep (occult.harness.sweep.inputs.TraceRouter).
EP_TRACE = "results/nvidia-h200/quality_upcycle_v4/profile/routing_heldout_sample.npz"
# Every Occult variant of the EP runtime, per kind (prefill: 2^10 ... 2^16 tokens per GPU; train:
# forward and backward of 32 sequences of 512 tokens per GPU).
EP_METHODS = {
    "prefill": "occult occult-pe occult-trivial occult-static occult-graph occult-nd2 occult-nd1 occult-compute",
    "train": "occult occult-pe occult-static occult-graph occult-nd1 occult-compute",
}
EP_SIZES = {"prefill": "", "train": "--sizes 32"}


def ep_trace_flag(wildcards) -> str:
    """The trace of `trace` rows; a parameter, not an input, so that committed runs never look stale."""
    return f"--trace {committed_path(EP_TRACE)}" if wildcards.routing == "trace" else ""


def gpus_of_run(wildcards) -> int:
    return int(wildcards.devices)
