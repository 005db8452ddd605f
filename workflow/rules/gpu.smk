# GPU latency sweeps (issue: real baselines). On a GPU machine, ask for a CSV to measure it, e.g.
#   snakemake --cores all results/my-gpus/sweeps_v3/sweep_prefill_D2.csv
# On any machine, `rule all` redraws the figures of every committed sweep run (no GPU needed).


rule run_gpu_sweep:
    output:
        csv="results/{machine}/sweeps_{version}/sweep_{kind}_D{devices}.csv",
    params:
        shapes="olmoe qwen deepseek",
        methods="occult occult-balanced occult-nd2 occult-nd1 naive megablocks tutel hf fsdp",
    log:
        text="logs/run_gpu_sweep/{machine}_{version}_{kind}_D{devices}.log",
        json="logs/run_gpu_sweep/{machine}_{version}_{kind}_D{devices}.jsonl",
    benchmark:
        "benchmarks/run_gpu_sweep/{machine}_{version}_{kind}_D{devices}.tsv"
    wildcard_constraints:
        kind="prefill|decode|train",
        devices="[0-9]+",
    conda:
        "../../environment.yml"
    threads: 8
    resources:
        gpus=gpus_of_sweep,
        mem_mb=64000,
        runtime=60,
    shell:
        "OCCULT_LOG_JSON={log.json} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
        " torchrun --nproc_per_node={wildcards.devices} -m occult.harness.sweep --kind {wildcards.kind}"
        " --shapes {params.shapes} --methods {params.methods} --repeats 20 --warmup 5"
        " --out {output.csv} > {log.text} 2>&1"


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
