# Host-time probes on one GPU: how an eager layer's host time moves with the host CPU's speed
# (probe_host), and A/B runs of launch paths and of the shared expert with all arms interleaved in
# one process, so that the host's speed is the same for every arm (compare_train_host,
# compare_shared_host). Never part of `rule all`: ask for the CSV on a GPU machine, e.g.
#   snakemake --workflow-profile workflow/profiles/gpu results/my-box/host_probe_v1/host_probe.csv


rule probe_host:
    output:
        csv="results/{machine}/host_probe_{version}/host_probe.csv",
    params:
        seconds=60,
    log:
        text="logs/probe_host/{machine}_{version}.log",
        json="logs/probe_host/{machine}_{version}.jsonl",
    benchmark:
        "benchmarks/probe_host/{machine}_{version}.tsv"
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
        " python -m occult.harness.host_probe --seconds {params.seconds} --out {output.csv}"
        " --log-json {log.json} > {log.text} 2>&1"


rule compare_train_host:
    output:
        csv="results/{machine}/host_probe_{version}/train_host_ab.csv",
    params:
        rounds=200,
        batch="1 2 4",
    log:
        text="logs/compare_train_host/{machine}_{version}.log",
        json="logs/compare_train_host/{machine}_{version}.jsonl",
    benchmark:
        "benchmarks/compare_train_host/{machine}_{version}.tsv"
    wildcard_constraints:
        machine="[^/]+",
        version="[^/]+",
    conda:
        "../../environment.yml"
    threads: 2
    resources:
        gpus=1,
        mem_mb=32000,
        runtime=30,
    shell:
        "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
        " python -m occult.harness.host_ab train --rounds {params.rounds} --batch {params.batch} --out {output.csv}"
        " --log-json {log.json} > {log.text} 2>&1"


rule compare_shared_host:
    output:
        csv="results/{machine}/host_probe_{version}/shared_host_ab.csv",
    params:
        rounds=400,
        batch="8",
    log:
        text="logs/compare_shared_host/{machine}_{version}.log",
        json="logs/compare_shared_host/{machine}_{version}.jsonl",
    benchmark:
        "benchmarks/compare_shared_host/{machine}_{version}.tsv"
    wildcard_constraints:
        machine="[^/]+",
        version="[^/]+",
    conda:
        "../../environment.yml"
    threads: 2
    resources:
        gpus=1,
        mem_mb=16000,
        runtime=20,
    shell:
        "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
        " python -m occult.harness.host_ab shared --rounds {params.rounds} --batch {params.batch} --out {output.csv}"
        " --log-json {log.json} > {log.text} 2>&1"
