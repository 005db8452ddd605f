"""The pipeline stages the Snakemake rules call (through `occult <stage>` or `python -m`)."""
