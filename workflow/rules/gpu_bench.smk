# GPU benchmarks: the EP runtime, the expert kernels and their configs, the all-to-all and GEMM
# curves, and the GPU tests. Never part of `rule all`: ask for a file on a GPU machine, e.g.
#   snakemake --workflow-profile workflow/profiles/gpu results/my-box/ep_v1/ep_prefill_uniform_D2.csv
# (docs/deploy.md lists every target). Each job takes its GPUs through occult.harness.gpu_slots,
# which gives concurrent jobs distinct devices. Multi-GPU jobs (files ending in _D<D>) start one
# torchrun rank per GPU and ask the allocator for D themselves: Snakemake lowers a job's `gpus` to
# the profile's limit, and D ranks must never share fewer GPUs.

# Per-phase times (dispatch, expert kernels, combine), wire bytes and pairs per GPU of every Occult
# variant on the OLMoE layer shape (d=2048, expert ffn 1024, E=64, k=8, no shared expert), bf16.
rule bench_ep_runtime:
    output:
        csv="results/{machine}/ep_{version}/ep_{kind}_{routing}_D{devices}.csv",
    params:
        methods=lambda wildcards: EP_METHODS[wildcards.kind],
        sizes=lambda wildcards: EP_SIZES[wildcards.kind],
        trace=ep_trace_flag,
        no_multicast=NO_MULTICAST,
    log:
        text="logs/bench_ep_runtime/{machine}_{version}_{kind}_{routing}_D{devices}.log",
        json="logs/bench_ep_runtime/{machine}_{version}_{kind}_{routing}_D{devices}.jsonl",
    benchmark:
        "benchmarks/bench_ep_runtime/{machine}_{version}_{kind}_{routing}_D{devices}.tsv"
    wildcard_constraints:
        machine="[^/]+",
        version="[^/]+",
        kind="prefill|train",
        routing="uniform|trace|synthetic",
        devices="[0-9]+",
    conda:
        "../../environment.yml"
    threads: 8
    resources:
        gpus=gpus_of_run,
        mem_mb=64000,
        runtime=60,
    shell:
        "OCCULT_LOG_JSON={log.json} {params.no_multicast} python -m occult.harness.gpu_slots --gpus {wildcards.devices} --"
        " torchrun --nproc_per_node={wildcards.devices} -m occult.harness.sweep --kind {wildcards.kind}"
        " --shapes olmoe --no-shared --routing {wildcards.routing} {params.trace} --methods {params.methods}"
        " {params.sizes} --repeats 20 --warmup 5 --timeout-s 120 --out {output.csv} > {log.text} 2>&1"


# The same layer's expert compute replayed from a CUDA graph (host-free kernel rows: the
# simulator's kernel curves), in a process of its own.
rule bench_ep_compute:
    output:
        csv="results/{machine}/ep_{version}/ep_{kind}_uniform_D{devices}_compute_graph.csv",
    params:
        sizes=lambda wildcards: EP_SIZES[wildcards.kind],
        no_multicast=NO_MULTICAST,
    log:
        text="logs/bench_ep_compute/{machine}_{version}_{kind}_D{devices}.log",
        json="logs/bench_ep_compute/{machine}_{version}_{kind}_D{devices}.jsonl",
    benchmark:
        "benchmarks/bench_ep_compute/{machine}_{version}_{kind}_D{devices}.tsv"
    wildcard_constraints:
        machine="[^/]+",
        version="[^/]+",
        kind="prefill|train",
        devices="[0-9]+",
    conda:
        "../../environment.yml"
    threads: 8
    resources:
        gpus=gpus_of_run,
        mem_mb=64000,
        runtime=30,
    shell:
        "OCCULT_LOG_JSON={log.json} {params.no_multicast} python -m occult.harness.gpu_slots --gpus {wildcards.devices} --"
        " torchrun --nproc_per_node={wildcards.devices} -m occult.harness.sweep --kind {wildcards.kind}"
        " --shapes olmoe --no-shared --routing uniform --methods occult-compute-graph {params.sizes}"
        " --repeats 20 --warmup 5 --timeout-s 120 --out {output.csv} > {log.text} 2>&1"


# The bf16 matmul peak of the same GPU, which the EP report divides expert rates by.
rule measure_matmul_peak:
    output:
        csv="results/{machine}/ep_{version}/peak.csv",
    log:
        text="logs/measure_matmul_peak/{machine}_{version}.log",
        json="logs/measure_matmul_peak/{machine}_{version}.jsonl",
    benchmark:
        "benchmarks/measure_matmul_peak/{machine}_{version}.tsv"
    wildcard_constraints:
        machine="[^/]+",
        version="[^/]+",
    conda:
        "../../environment.yml"
    threads: 2
    resources:
        gpus=1,
        mem_mb=16000,
        runtime=10,
    shell:
        "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
        " python -m occult.harness.matmul_peak --out {output.csv} --log-json {log.json} > {log.text} 2>&1"


# Where one EP forward's time goes at T tokens per GPU: torch.profiler tables, host syncs, and the
# expert compute alone on one GPU (occult.harness.ep_profile).
rule profile_ep_layer:
    output:
        tables=directory("results/{machine}/ep_{version}/profile_T{tokens}_D{devices}"),
    params:
        no_multicast=NO_MULTICAST,
    log:
        text="logs/profile_ep_layer/{machine}_{version}_T{tokens}_D{devices}.log",
        json="logs/profile_ep_layer/{machine}_{version}_T{tokens}_D{devices}.jsonl",
    benchmark:
        "benchmarks/profile_ep_layer/{machine}_{version}_T{tokens}_D{devices}.tsv"
    wildcard_constraints:
        machine="[^/]+",
        version="[^/]+",
        tokens="[0-9]+",
        devices="[0-9]+",
    conda:
        "../../environment.yml"
    threads: 8
    resources:
        gpus=gpus_of_run,
        mem_mb=64000,
        runtime=30,
    shell:
        "{params.no_multicast} python -m occult.harness.gpu_slots --gpus {wildcards.devices} --"
        " torchrun --nproc_per_node={wildcards.devices} -m occult.harness.ep_profile --tokens {wildcards.tokens}"
        " --repeats 20 --out {output.tables} --log-json {log.json} > {log.text} 2>&1"


# The expert kernels (Triton with tensor-descriptor and pointer operands, torch._grouped_mm, the
# no-gather and dense cuBLAS ceilings, the cuBLAS peaks) on one GPU, with its clocks and power
# sampled beside them (a log: committed runs without it are complete).
rule bench_kernels:
    output:
        csv="results/{machine}/kernels_{version}/kernels.csv",
    log:
        text="logs/bench_kernels/{machine}_{version}.log",
        json="logs/bench_kernels/{machine}_{version}.jsonl",
        telemetry="logs/bench_kernels/{machine}_{version}_telemetry.csv",
    benchmark:
        "benchmarks/bench_kernels/{machine}_{version}.tsv"
    wildcard_constraints:
        machine="[^/]+",
        version="[^/]+",
    conda:
        "../../environment.yml"
    threads: 4
    resources:
        gpus=1,
        mem_mb=32000,
        runtime=30,
    shell:
        "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
        " python -m occult.harness.telemetry --out {log.telemetry} --"
        " python -m occult.harness.kernel_bench --out {output.csv} --log-json {log.json} > {log.text} 2>&1"


# A config sweep of the grouped GEMM kernels (the autotuner's configs and a seeded sample of a
# wider grid, each checked against the default) on one GPU.
rule tune_kernels:
    output:
        csv="results/{machine}/tune_{version}/tune.csv",
    params:
        max_configs=24,
        time_limit_s=2400,
    log:
        text="logs/tune_kernels/{machine}_{version}.log",
        json="logs/tune_kernels/{machine}_{version}.jsonl",
    benchmark:
        "benchmarks/tune_kernels/{machine}_{version}.tsv"
    wildcard_constraints:
        machine="[^/]+",
        version="[^/]+",
    conda:
        "../../environment.yml"
    threads: 4
    resources:
        gpus=1,
        mem_mb=32000,
        runtime=60,
    shell:
        "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
        " python -m occult.harness.kernel_tune --out {output.csv} --max-configs {params.max_configs}"
        " --time-limit-s {params.time_limit_s} --log-json {log.json} > {log.text} 2>&1"


# All-to-all rates per message size and the grouped-GEMM curves of D ranks (the simulator's
# communication and compute terms).
rule bench_alltoall:
    output:
        alltoall="results/{machine}/comm_{version}_D{devices}/alltoall.csv",
        gemm="results/{machine}/comm_{version}_D{devices}/gemm.csv",
    params:
        outdir=output_dir,
        no_multicast=NO_MULTICAST,
    log:
        text="logs/bench_alltoall/{machine}_{version}_D{devices}.log",
        json="logs/bench_alltoall/{machine}_{version}_D{devices}.jsonl",
    benchmark:
        "benchmarks/bench_alltoall/{machine}_{version}_D{devices}.tsv"
    wildcard_constraints:
        machine="[^/]+",
        version="[^/]+",
        devices="[0-9]+",
    conda:
        "../../environment.yml"
    threads: 8
    resources:
        gpus=gpus_of_run,
        mem_mb=64000,
        runtime=30,
    shell:
        "{params.no_multicast} python -m occult.harness.gpu_slots --gpus {wildcards.devices} --"
        " torchrun --nproc_per_node={wildcards.devices} -m occult.harness.commbench --out {params.outdir}"
        " --log-json {log.json} > {log.text} 2>&1"


# The bf16 GPU tests of the kernels and the EP layer (pytest -m gpu) on one GPU.
rule test_gpu_kernels:
    output:
        junit="results/{machine}/gpu_tests_{version}/junit.xml",
    params:
        tests=lambda wildcards: [committed_path("tests/kernels"), committed_path("tests/ep")],
    log:
        text="logs/test_gpu_kernels/{machine}_{version}.log",
    benchmark:
        "benchmarks/test_gpu_kernels/{machine}_{version}.tsv"
    wildcard_constraints:
        machine="[^/]+",
        version="[^/]+",
    conda:
        "../../environment.yml"
    threads: 4
    resources:
        gpus=1,
        mem_mb=32000,
        runtime=30,
    shell:
        "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
        " python -m pytest {params.tests} -m gpu -q -p no:cacheprovider --junitxml={output.junit}"
        " > {log.text} 2>&1"
