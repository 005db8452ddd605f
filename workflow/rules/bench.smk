rule bench_layer:
    input:
        heldout=rules.profile_coactivation.output.heldout,
        placements=PLACEMENT_FILES,
    output:
        csv=f"{RESULTS}/bench/ep_cpu.csv",
    params:
        settings=settings("bench", "model", "seed"),
        profile=f"{WORK}/profile",
        placements=f"{RESULTS}/placement",
    log:
        f"logs/bench_layer/{RUN}.log",
    benchmark:
        f"benchmarks/bench_layer/{RUN}.tsv"
    threads: 2
    resources:
        mem_mb=8000,
        runtime=60,
    shell:
        "occult bench --config {RESOLVED_CONFIG} --profile {params.profile}"
        " --placements {params.placements} --out {output.csv} 2>&1 | tee {log}"
