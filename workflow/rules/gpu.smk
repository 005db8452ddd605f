# GPU latency sweeps against the baselines. On a GPU machine (baselines built: tools/build_baselines.sh),
# ask for a CSV to measure it, e.g.
#   snakemake --cores all results/my-gpus/sweeps_v3/sweep_prefill_D2.csv
#   snakemake --cores all results/my-gpus/sweeps_v3/sweep_prefill_D1_trace.csv   (one routing)
#   snakemake --cores all results/my-gpus/sweeps_v3/order_check_prefill_D1.csv   (does the order move medians?)
# On any machine, `rule all` redraws the figures of every committed sweep run (no GPU needed).


# Every Occult variant and every exact setting of each baseline (docs/baselines.md): the sweep's
# methods, and the order check's, so that a method there runs after the same others as here.
SWEEP_METHODS = (
    "occult occult-balanced occult-graph occult-graph-balanced occult-nd2 occult-nd1 naive hf fsdp"
    " megablocks megablocks:grouped_gemm=cutlass megablocks:mlp_impl=sparse"
    " tutel tutel:adaptive_r=0 tutel:megablocks_size=1 deepspeed deepspeed:use_tutel=1"
)


rule run_gpu_sweep:
    # The fair sweep of one kind at D GPUs: every Occult variant against every exact setting of each
    # baseline (docs/baselines.md), the methods of each point in a seeded random order, one process
    # per part that cannot share one (occult.harness.sweep.parts). `sweep_<kind>_D<D>.csv` runs the
    # three routings; `sweep_<kind>_D<D>_<routing>.csv` runs one (a piece that fits a shorter slot).
    output:
        csv="results/{machine}/sweeps_{version}/sweep_{kind}_D{devices}{routing}.csv",
    params:
        shapes="olmoe qwen deepseek",
        methods=SWEEP_METHODS,
        routings=lambda wildcards: wildcards.routing.lstrip("_") or "synthetic uniform trace",
        trace=lambda wildcards: committed_path(EP_TRACE),   # the EP benchmark's trace (gpu_common.smk)
        grouped_gemm_dir=str(Path(workflow.basedir) / ".thirdparty" / "baselines"),   # tools/build_baselines.sh
    log:
        text="logs/run_gpu_sweep/{machine}_{version}_{kind}_D{devices}{routing}.log",
        json="logs/run_gpu_sweep/{machine}_{version}_{kind}_D{devices}{routing}.jsonl",
    benchmark:
        "benchmarks/run_gpu_sweep/{machine}_{version}_{kind}_D{devices}{routing}.tsv"
    wildcard_constraints:
        kind="prefill|decode|train",
        devices="[0-9]+",
        routing="(_(synthetic|uniform|trace))?",
    conda:
        "../../environment.yml"
    threads: 8
    resources:
        gpus=gpus_of_sweep,
        mem_mb=64000,
        runtime=120,
    shell:
        "OCCULT_LOG_JSON={log.json} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
        " python -m occult.harness.gpu_slots --gpus {wildcards.devices} --"
        " python -m occult.harness.sweep.parts --launch 'torchrun --nproc_per_node={wildcards.devices} --nnodes=1'"
        " --kind {wildcards.kind} --D {wildcards.devices} --shapes {params.shapes} --methods {params.methods}"
        " --routings {params.routings} --trace {params.trace} --grouped-gemm-dir {params.grouped_gemm_dir}"
        " --repeats 20 --warmup 5 --timeout-s 120 --out {output.csv} > {log.text} 2>&1"


rule run_order_check:
    # Whether a method's median moves with its place in the order of a point: the same data (one
    # --seed) at one size per kind (prefill 16384 tokens per GPU, decode batch 64, train batch 8 of
    # 512 tokens), the three shapes, synthetic routing, run 6 times as fresh processes with order seeds
    # 0 ... 5 (occult.harness.sweep.order_check), with the sweep's methods so that each runs after the
    # same others as in the sweep; rows carry `replicate`, the CSV is written at the end.
    output:
        csv="results/{machine}/sweeps_{version}/order_check_{kind}_D{devices}.csv",
    params:
        shapes="olmoe qwen deepseek",
        methods=SWEEP_METHODS,
        replicates=6,
        grouped_gemm_dir=str(Path(workflow.basedir) / ".thirdparty" / "baselines"),   # tools/build_baselines.sh
    log:
        text="logs/run_order_check/{machine}_{version}_{kind}_D{devices}.log",
        json="logs/run_order_check/{machine}_{version}_{kind}_D{devices}.jsonl",
    benchmark:
        "benchmarks/run_order_check/{machine}_{version}_{kind}_D{devices}.tsv"
    wildcard_constraints:
        kind="prefill|decode|train",
        devices="[0-9]+",
    conda:
        "../../environment.yml"
    threads: 8
    resources:
        gpus=gpus_of_sweep,
        mem_mb=64000,
        runtime=90,
    shell:
        "OCCULT_LOG_JSON={log.json} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
        " python -m occult.harness.gpu_slots --gpus {wildcards.devices} --"
        " python -m occult.harness.sweep.order_check --launch 'torchrun --nproc_per_node={wildcards.devices} --nnodes=1'"
        " --kind {wildcards.kind} --D {wildcards.devices} --shapes {params.shapes} --methods {params.methods}"
        " --routing synthetic --replicates {params.replicates} --grouped-gemm-dir {params.grouped_gemm_dir}"
        " --repeats 20 --warmup 5 --timeout-s 120 --out {output.csv} > {log.text} 2>&1"


rule plot_gpu_sweeps:
    input:
        sweeps=gpu_sweep_csvs,
    output:
        speedups="results/{machine}/sweeps_{version}/speedups.csv",
        figures=report(
            directory("figures/{machine}/sweeps_{version}"),
            patterns=["{name}.png"],
            category="GPU latency",
            caption="../report/gpu_sweeps.rst",
        ),
    params:
        run_dir=sweep_run_dir,
    log:
        text="logs/plot_gpu_sweeps/{machine}_{version}.log",
        json="logs/plot_gpu_sweeps/{machine}_{version}.jsonl",
    benchmark:
        "benchmarks/plot_gpu_sweeps/{machine}_{version}.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "OCCULT_LOG_JSON={log.json} python -m occult.report.gpu_runs --run-dir {params.run_dir} --figures {output.figures}"
        " > {log.text} 2>&1"


rule summarise_order_check:
    # The order effect of a run's order checks (occult.report.order_effect): per method and shape the
    # run-to-run spread, first vs last, the fitted % change per position and the verdict.
    input:
        csvs=order_check_csvs,
    output:
        table="results/{machine}/sweeps_{version}/order_effect.csv",
        figure=report(
            "figures/{machine}/sweeps_{version}_order/order_effect.png",
            category="GPU latency",
            caption="../report/order_effect.rst",
        ),
    log:
        text="logs/summarise_order_check/{machine}_{version}.log",
        json="logs/summarise_order_check/{machine}_{version}.jsonl",
    benchmark:
        "benchmarks/summarise_order_check/{machine}_{version}.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "OCCULT_LOG_JSON={log.json} python -m occult.report.order_effect {input.csvs} --out {output.table}"
        " --figure {output.figure} > {log.text} 2>&1"


rule plot_ep_bench:
    input:
        csvs=ep_bench_csvs,
    output:
        summary="results/{machine}/ep_{version}/summary.csv",
        targets="results/{machine}/ep_{version}/targets.csv",
        figures=report(
            directory("figures/{machine}/ep_{version}"),
            patterns=["{name}.png"],
            category="GPU latency",
            caption="../report/ep_bench.rst",
        ),
    params:
        run_dir=lambda wildcards: f"results/{wildcards.machine}/ep_{wildcards.version}",
    log:
        text="logs/plot_ep_bench/{machine}_{version}.log",
        json="logs/plot_ep_bench/{machine}_{version}.jsonl",
    benchmark:
        "benchmarks/plot_ep_bench/{machine}_{version}.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "OCCULT_LOG_JSON={log.json} python -m occult.report.gpu_runs --ep --run-dir {params.run_dir}"
        " --figures {output.figures} > {log.text} 2>&1"


rule plot_kernel_bench:
    input:
        csvs=kernel_bench_csvs,
    output:
        summary="results/{machine}/kernels_{version}/summary.csv",
        figure=report(
            "figures/{machine}/kernels_{version}/kernels.png",
            category="GPU latency",
            caption="../report/kernel_bench.rst",
        ),
    params:
        run_dir=lambda wildcards: f"results/{wildcards.machine}/kernels_{wildcards.version}",
        figures=lambda wildcards: f"figures/{wildcards.machine}/kernels_{wildcards.version}",
    log:
        text="logs/plot_kernel_bench/{machine}_{version}.log",
        json="logs/plot_kernel_bench/{machine}_{version}.jsonl",
    benchmark:
        "benchmarks/plot_kernel_bench/{machine}_{version}.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "OCCULT_LOG_JSON={log.json} python -m occult.report.gpu_runs --kernels --run-dir {params.run_dir}"
        " --figures {params.figures} > {log.text} 2>&1"
