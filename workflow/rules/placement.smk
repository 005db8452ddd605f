rule place_experts:
    input:
        profile=rules.profile_coactivation.output.profile,
        calibration=rules.profile_coactivation.output.calibration,
        heldout=rules.profile_coactivation.output.heldout,
    output:
        placements=PLACEMENT_FILES,
        table=report(f"{RESULTS}/placement/expected_ct.csv", category="Placement", caption="../report/placement.rst"),
    params:
        config=RESOLVED_CONFIG,
        settings=settings("placement", "seed"),
        profile=profile_dir,
        outdir=output_dir,
    log:
        f"logs/place_experts/{RUN}.log",
    benchmark:
        f"benchmarks/place_experts/{RUN}.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    shell:
        "occult place --config {params.config} --profile {params.profile} --out {params.outdir}"
        " --table {output.table} 2>&1 | tee {log}"
