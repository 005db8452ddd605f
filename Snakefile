# occult: the Occult study (ICML 2025) as one DAG. `snakemake --cores all` runs the embedded
# default (config/config.yaml); presets: `--configfile config/presets/<name>.yaml`.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"


wildcard_constraints:
    variant="|".join(VARIANTS),


include: "workflow/rules/data.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/profile.smk"
include: "workflow/rules/placement.smk"
include: "workflow/rules/quality_grid.smk"
include: "workflow/rules/finetune.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/bench.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/gpu.smk"
include: "workflow/rules/gpu_common.smk"
include: "workflow/rules/gpu_bench.smk"
include: "workflow/rules/gpu_host.smk"
include: "workflow/rules/gpu_quality.smk"
include: "workflow/rules/simulate.smk"


rule all:
    input:
        final_outputs(),
    default_target: True
