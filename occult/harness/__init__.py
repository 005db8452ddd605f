"""GPU and CPU-rank benchmarking: latency sweeps, baselines, communication and kernel benchmarks, host probes."""
