# Trace-driven scale simulator: validated against the committed GPU sweeps, predictions for
# D = 4 ... 64 and the sweep's own sizes at D = 4, 8, and the check of measured D = 4/8 runs against
# the pre-registered predictions. CPU only; a few minutes.
# (`occult simulate` is the same stage behind the CLI; the module entry keeps tests/test_cli.py's
# fixed stage table unchanged.)


rule simulate_scale:
    input:
        measured=simulate_inputs,
    output:
        validation=report(
            f"{RESULTS}/simulate/validation.csv", category="Scale simulator", caption="../report/simulate.rst"
        ),
        history=f"{RESULTS}/simulate/validation_history.csv",
        predictions=f"{RESULTS}/simulate/predictions.csv",
        predictions_D4_D8=f"{RESULTS}/simulate/predictions_D4_D8.csv",
        cost_model=f"{RESULTS}/simulate/cost_model.json",
        fig_speedup=report(f"{FIGURES}/simulate_speedup.png", category="Scale simulator", caption="../report/simulate.rst"),
        fig_validation=report(
            f"{FIGURES}/simulate_validation.png", category="Scale simulator", caption="../report/simulate.rst"
        ),
    params:
        config=RESOLVED_CONFIG,
        settings=settings("simulate", "seed") if CFG.simulate is not None else "",
        outdir=output_dir,
        figures=simulate_figures_dir,
    log:
        text=f"logs/simulate_scale/{RUN}.log",
        json=f"logs/simulate_scale/{RUN}.jsonl",
    benchmark:
        f"benchmarks/simulate_scale/{RUN}.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=15,
    shell:
        "python -m occult.sim.run --config {params.config} --out {params.outdir} --figures {params.figures}"
        " --log-json {log.json} 2>&1 | tee {log.text}"


rule check_predictions:
    input:
        measured=[committed_path(p) for p in PREDICTION_CHECK_MEASURED],
        preregistered=committed_path(PREDICTION_CHECK_PREDICTIONS) if PREDICTION_CHECK_PREDICTIONS else [],
        current=f"{RESULTS}/simulate/predictions_D4_D8.csv",
    output:
        table=report(f"{RESULTS}/simulate/prediction_check.csv", category="Scale simulator", caption="../report/simulate.rst"),
        summary=f"{RESULTS}/simulate/prediction_check_summary.csv",
        figure=report(f"{FIGURES}/prediction_check.png", category="Scale simulator", caption="../report/simulate.rst"),
    params:
        config=RESOLVED_CONFIG,
        settings=settings("simulate") if CFG.simulate is not None else "",
        outdir=output_dir,
    log:
        text=f"logs/check_predictions/{RUN}.log",
        json=f"logs/check_predictions/{RUN}.jsonl",
    benchmark:
        f"benchmarks/check_predictions/{RUN}.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=5,
    shell:
        "python -m occult.sim.check --config {params.config} --current {input.current} --out {params.outdir}"
        " --figure {output.figure} --log-json {log.json} 2>&1 | tee {log.text}"
