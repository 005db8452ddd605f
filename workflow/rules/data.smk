rule build_data:
    output:
        manifest=f"{WORK}/data/manifest.json",
        train=f"{WORK}/data/corpus/train.jsonl",
        heldout=f"{WORK}/data/corpus/heldout.jsonl",
        tokenizer=f"{WORK}/data/tokenizer/tokenizer.json",
        instructions=f"{WORK}/data/instructions.jsonl",
    params:
        config=RESOLVED_CONFIG,
        settings=settings("data", "seed"),
        outdir=output_dir,
    log:
        text=f"logs/build_data/{RUN}.log",
        json=f"logs/build_data/{RUN}.jsonl",
    benchmark:
        f"benchmarks/build_data/{RUN}.tsv"
    conda:
        "../../environment.yml"
    threads: 2
    resources:
        mem_mb=4000,
        runtime=30,
    shell:
        "occult data --config {params.config} --out {params.outdir} --log-json {log.json} 2>&1 | tee {log.text}"
