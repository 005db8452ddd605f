if CFG.model.source in ("scratch", "upcycle"):

    rule pretrain_model:
        input:
            manifest=rules.build_data.output.manifest,
        output:
            model=directory(f"{WORK}/model/base"),
            loss=report(f"{RESULTS}/model/pretrain_log.csv", category="Model", caption="../report/pretrain.rst"),
            structure=f"{RESULTS}/model/router_structure.json",
        params:
            config=RESOLVED_CONFIG,
            settings=settings("model", "pretrain", "seed"),
            data=data_dir,
        log:
            text=f"logs/pretrain_model/{RUN}.log",
            json=f"logs/pretrain_model/{RUN}.jsonl",
        benchmark:
            f"benchmarks/pretrain_model/{RUN}.tsv"
        conda:
            "../../environment.yml"
        threads: 2
        resources:
            mem_mb=8000,
            runtime=120,
            gpus=0,
        shell:
            "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
            " occult pretrain --config {params.config} --threads {threads} --data {params.data}"
            " --out {output.model} --log {output.loss} --structure {output.structure}"
            " --log-json {log.json} 2>&1 | tee {log.text}"

else:

    rule import_checkpoint:
        output:
            model=directory(f"{WORK}/model/base"),
        params:
            config=RESOLVED_CONFIG,
            settings=settings("model"),
        log:
            text=f"logs/import_checkpoint/{RUN}.log",
            json=f"logs/import_checkpoint/{RUN}.jsonl",
        benchmark:
            f"benchmarks/import_checkpoint/{RUN}.tsv"
        conda:
            "../../environment.yml"
        threads: 1
        resources:
            mem_mb=64000,
            runtime=30,
        shell:
            "occult import-checkpoint --config {params.config} --out {output.model} --log-json {log.json}"
            " 2>&1 | tee {log.text}"
