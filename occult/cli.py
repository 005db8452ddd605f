"""`occult` command line: one subcommand per pipeline stage (the Snakemake rules call these).

Every subcommand takes `--config` (a YAML file, validated before anything runs) and explicit
input/output paths, so each stage also runs without Snakemake:

    occult data      --config C --out work/tiny/data
    occult pretrain  --config C --data D --out M --log L --structure S
    occult profile   --config C --model M --data D --out P
    occult place     --config C --profile P --out DIR --table T
    occult finetune  --config C --variant V --model M --data D --profile P --placements DIR --out M2 --log L
    occult evaluate  --config C --variant V --model M2 --data D --profile P --placements DIR --out J
    occult bench     --config C --profile P --placements DIR --out CSV
    occult report    --config C --results R --figures F
"""

from __future__ import annotations

import argparse
import logging
import sys
import zipfile
from pathlib import Path

from occult.config import ConfigError, load_config

log = logging.getLogger("occult")


def _data(args, cfg) -> None:
    from occult.data import build_data

    build_data(cfg.data, cfg.seed, Path(args.out), config_hash=cfg.hash())


def _pretrain(args, cfg) -> None:
    from occult.pretrain import pretrain

    pretrain(cfg, Path(args.data), Path(args.out), Path(args.log), Path(args.structure))


def _import_checkpoint(args, cfg) -> None:
    """Check that the checkpoint loads as an MoE model, then link it into the work tree."""
    from occult.models import load_checkpoint, moe_layers

    source = Path(cfg.model.checkpoint).resolve()
    model, _ = load_checkpoint(source)
    log.info("checkpoint %s: %d MoE layers", source, len(moe_layers(model)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.symlink_to(source, target_is_directory=True)


def _profile(args, cfg) -> None:
    from occult.profiling import profile

    profile(cfg, Path(args.model), Path(args.data), Path(args.out))


def _place(args, cfg) -> None:
    from occult.placement import run_placement

    run_placement(cfg, Path(args.profile), Path(args.out), Path(args.table))


def _finetune(args, cfg) -> None:
    from occult.finetune import finetune

    finetune(cfg, args.variant, Path(args.model), Path(args.data), Path(args.profile),
             Path(args.placements), Path(args.out), Path(args.log))


def _evaluate(args, cfg) -> None:
    from occult.evaluate import evaluate

    evaluate(cfg, args.variant, Path(args.model), Path(args.data), Path(args.profile),
             Path(args.placements), Path(args.out))


def _bench(args, cfg) -> None:
    from occult.bench import run_bench

    run_bench(cfg, Path(args.profile), Path(args.placements), Path(args.out))


def _report(args, cfg) -> None:
    from occult.report import make_report

    make_report(cfg, Path(args.results), Path(args.figures))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="occult", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")

    def stage(name: str, func, help_: str, *paths: tuple[str, str]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--config", required=True, help="workflow config YAML (validated first)")
        p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
        for flag, text in paths:
            p.add_argument(flag, required=True, help=text)
        p.set_defaults(func=func)
        return p

    stage("data", _data, "build corpus, tokenizer, instruction pairs and eval sets",
          ("--out", "output directory"))
    stage("pretrain", _pretrain, "pre-train the tiny OLMoE from scratch",
          ("--data", "data directory"), ("--out", "checkpoint directory"),
          ("--log", "loss log CSV"), ("--structure", "router-structure JSON"))
    stage("import-checkpoint", _import_checkpoint, "validate and link a local HF MoE checkpoint",
          ("--out", "checkpoint directory (a link to model.checkpoint)"))
    stage("profile", _profile, "co-activation, loads and router-logit statistics",
          ("--model", "checkpoint directory"), ("--data", "data directory"), ("--out", "profile directory"))
    stage("place", _place, "expert placements for every device count and method",
          ("--profile", "profile directory"), ("--out", "placement directory"), ("--table", "E[C_T] table CSV"))
    p = stage("finetune", _finetune, "fine-tune one variant (SFT or collaboration pruning)",
              ("--model", "base checkpoint"), ("--data", "data directory"), ("--profile", "profile directory"),
              ("--placements", "placement directory"), ("--out", "output checkpoint"), ("--log", "loss log CSV"))
    p.add_argument("--variant", required=True, help="raw | sft | prune<N>-<router|sim>")
    p = stage("evaluate", _evaluate, "lm-eval one variant on the offline tasks",
              ("--model", "variant checkpoint"), ("--data", "data directory"), ("--profile", "profile directory"),
              ("--placements", "placement directory"), ("--out", "results JSON"))
    p.add_argument("--variant", required=True, help="raw | sft | prune<N>-<router|sim>")
    stage("bench", _bench, "EP layer on CPU gloo ranks: per-expert vs dedup dispatch",
          ("--profile", "profile directory"), ("--placements", "placement directory"), ("--out", "CSV"))
    stage("report", _report, "tables and figures from the results",
          ("--results", "results directory"), ("--figures", "figures directory"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr, force=True)
    try:
        cfg = load_config(args.config)
    except ConfigError as err:
        print(f"occult {args.stage}: config error: {err}", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    log.info("stage %s, run %s, config %s", args.stage, cfg.run, cfg.hash())
    try:
        args.func(args, cfg)
    except (ConfigError, FileNotFoundError, ValueError, zipfile.BadZipFile, EOFError) as err:
        # bad or truncated inputs: one line, no traceback (a truncated .npz raises BadZipFile/EOFError)
        print(f"occult {args.stage}: error: {err}", file=sys.stderr)
        return 1
    return 0
