rule build_data:
    output:
        manifest=f"{WORK}/data/manifest.json",
        train=f"{WORK}/data/corpus/train.jsonl",
        heldout=f"{WORK}/data/corpus/heldout.jsonl",
        tokenizer=f"{WORK}/data/tokenizer/tokenizer.json",
        instructions=f"{WORK}/data/instructions.jsonl",
    params:
        settings=settings("data", "seed"),
        outdir=f"{WORK}/data",
    log:
        f"logs/build_data/{RUN}.log",
    benchmark:
        f"benchmarks/build_data/{RUN}.tsv"
    threads: 2
    resources:
        mem_mb=4000,
        runtime=30,
    shell:
        "occult data --config {RESOLVED_CONFIG} --out {params.outdir} 2>&1 | tee {log}"
