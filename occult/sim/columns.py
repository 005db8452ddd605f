"""The simulator's error and the columns of the tables it reads and writes."""

from __future__ import annotations


MEASURED_COLUMNS = ("kind", "shape", "method", "D", "tokens_per_gpu", "median_ms", "status")
ALLTOALL_COLUMNS = ("D", "pattern", "bytes_remote_per_rank", "median_ms")
GEMM_COLUMNS = ("shape", "experts", "hidden", "ffn", "rows_per_expert", "pass", "tflops")   # pass: fwd | fwd+bwd
COMPONENTS = ("kernels_ms", "other_gpu_ms", "comm_ms", "shared_ms", "gpu_ms", "host_pre_ms", "host_post_ms",
              "host_shared_ms")
VALIDATION_COLUMNS = (
    "role", "kind", "shape", "method", "family", "routing", "D", "tokens_per_gpu", "batch", "measured_ms",
    "p10_ms", "p90_ms", "predicted_ms", "rel_err", "within_tolerance", "bound", *COMPONENTS, "host_scale",
    "replicates", "replicate_ratio", "reachable", "measured_ct", "trace_ct", "measured_bytes_sent",
    "trace_bytes_sent", "measured_pairs_max", "trace_pairs_max", "traffic_source", "source", "commit",
)
PREDICTION_COLUMNS = (
    "shape", "method", "kind", "D", "nodes", "gpus_per_node", "tokens_per_gpu", "batch", "moe_layers",
    "mean_devices_per_token", "load_max_over_mean", "dispatch_bytes_per_rank", "return_bytes_per_rank",
    "inter_node_bytes_per_rank", *COMPONENTS, "layer_ms", "model_ms", "speedup_vs_naive", "status",
)


class SimulateError(ValueError):
    """A simulator input is missing or malformed; the message names the file or field."""
