"""`occult` command line: one subcommand per pipeline stage (the Snakemake rules call these).

Every subcommand takes `--config` (a YAML file, or a shipped preset's name such as `tiny`;
validated before anything runs) and explicit input/output paths, so each stage also runs
without Snakemake:

    occult data      --config C --out work/tiny/data
    occult pretrain  --config C --data D --out M --log L --structure S
    occult profile   --config C --model M --data D --out P
    occult place     --config C --profile P --out DIR --table T [--cost-model J]
    occult finetune  --config C --variant V --model M --data D --profile P --placements DIR --out M2 --log L
    occult evaluate  --config C --variant V --model M2 --data D --profile P --placements DIR --out J
    occult bench     --config C --profile P --placements DIR --out CSV
    occult report    --config C --results R --figures F
    occult simulate  --config C --out DIR --figures F
    occult place-trace --trace T.npz --devices 2 4 8 --shape olmoe --out DIR   (no --config: a user's trace)

Every subcommand also takes `--log-json PATH` (default: `$OCCULT_LOG_JSON`): machine-readable
JSON-lines logs with a `start`, `progress` records and one `done` or `failed` record
(`occult.logs`). Exit codes: 0 done, 1 failed (bad or missing input: one stderr line naming
the file; anything else: its traceback, then that line), 2 bad configuration.
"""

from __future__ import annotations

import argparse
import logging
import zipfile
from pathlib import Path

from occult.config import ConfigError, load_config
from occult.logs import ENV_LOG_JSON, StagePaused, StageRun, log_event

log = logging.getLogger("occult")
# bad or truncated inputs: one line naming the file, no traceback (a truncated .npz raises BadZipFile/EOFError)
INPUT_ERRORS = (ConfigError, FileNotFoundError, ValueError, zipfile.BadZipFile, EOFError)


def _data(args, cfg) -> None:
    from occult.stages.data import build_data

    build_data(cfg.data, cfg.seed, Path(args.out), config_hash=cfg.hash())


def _pretrain(args, cfg) -> None:
    """One process, or data parallel over the ranks of `torchrun --nproc_per_node=N occult ...`."""
    import os

    from occult.stages.pretrain import pretrain

    def run() -> None:
        pretrain(cfg, Path(args.data), Path(args.out), Path(args.log), Path(args.structure),
                 step_trace=Path(args.step_trace) if args.step_trace else None)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        run()
        return
    import torch

    from occult.harness.ranks import run_in_group

    run_in_group(run, "cuda" if torch.cuda.is_available() else "cpu", world, timeout_s=900.0)


def _import_checkpoint(args, cfg) -> None:
    """Check that the checkpoint loads as an MoE model, then link it into the work tree."""
    from occult.models.moe import load_checkpoint, moe_layers

    source = Path(cfg.model.checkpoint).resolve()
    model, _ = load_checkpoint(source)
    log.info("checkpoint %s: %d MoE layers", source, len(moe_layers(model)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.symlink_to(source, target_is_directory=True)


def _profile(args, cfg) -> None:
    from occult.routing.profiling import profile

    profile(cfg, Path(args.model), Path(args.data), Path(args.out))


def _place(args, cfg) -> None:
    from occult.stages.place import run_placement

    run_placement(cfg, Path(args.profile), Path(args.out), Path(args.table),
                  Path(args.cost_model) if args.cost_model else None)


def _finetune(args, cfg) -> None:
    from occult.stages.finetune import finetune

    finetune(cfg, args.variant, Path(args.model), Path(args.data), Path(args.profile),
             Path(args.placements), Path(args.out), Path(args.log))


def _evaluate(args, cfg) -> None:
    from occult.stages.evaluate import evaluate

    evaluate(cfg, args.variant, Path(args.model), Path(args.data), Path(args.profile),
             Path(args.placements), Path(args.out))


def _bench(args, cfg) -> None:
    from occult.stages.bench import run_bench

    run_bench(cfg, Path(args.profile), Path(args.placements), Path(args.out))


def _report(args, cfg) -> None:
    from occult.report.study import make_report

    make_report(cfg, Path(args.results), Path(args.figures))


def _simulate(args, cfg) -> None:
    from occult.sim.inputs import simulator_settings
    from occult.sim.run import run_simulate

    if cfg.simulate is None:
        raise ConfigError("simulate: the configuration has no simulate section")
    run_simulate(simulator_settings(cfg.simulate), cfg.seed, Path(args.out), Path(args.figures), config_hash=cfg.hash())


def _place_trace(args, cfg) -> None:
    from occult.stages.place_trace import run

    run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="occult", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")

    def stage(name: str, func, help_: str, *paths: tuple[str, str], outputs: tuple[str, ...] = ("--out",)
              ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--config", required=True,
                       help="workflow config YAML, or the name of a shipped preset (tiny, mini, upcycle, olmoe: "
                            "config/presets/ on top of config/config.yaml); validated first")
        p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
        p.add_argument("--log-json", default=None, metavar="PATH",
                       help=f"append JSON-lines logs here (default: ${ENV_LOG_JSON}; none when unset)")
        for flag, text in paths:
            p.add_argument(flag, required=True, help=text)
        p.set_defaults(func=func, outputs=outputs)
        return p

    stage("data", _data, "build corpus, tokenizer, instruction pairs and eval sets",
          ("--out", "output directory"))
    stage("pretrain", _pretrain, "pre-train the tiny OLMoE from scratch",
          ("--data", "data directory"), ("--out", "checkpoint directory"),
          ("--log", "loss log CSV"), ("--structure", "router-structure JSON"),
          outputs=("--out", "--log", "--structure")).add_argument(
        "--step-trace", default=None, metavar="JSON",
        help="also write a torch.profiler summary of 5 training steps here (occult.harness.steptrace)")
    stage("import-checkpoint", _import_checkpoint, "validate and link a local HF MoE checkpoint",
          ("--out", "checkpoint directory (a link to model.checkpoint)"))
    stage("profile", _profile, "co-activation, loads and router-logit statistics",
          ("--model", "checkpoint directory"), ("--data", "data directory"), ("--out", "profile directory"))
    stage("place", _place, "expert placements for every device count and method",
          ("--profile", "profile directory"), ("--out", "placement directory"), ("--table", "E[C_T] table CSV"),
          outputs=("--out", "--table")).add_argument(
        "--cost-model", default=None, metavar="JSON",
        help="the latency placement's cost model (a simulate stage's cost_model.json; default: the shipped one)")
    p = stage("finetune", _finetune, "fine-tune one variant (SFT or collaboration pruning)",
              ("--model", "base checkpoint"), ("--data", "data directory"), ("--profile", "profile directory"),
              ("--placements", "placement directory"), ("--out", "output checkpoint"), ("--log", "loss log CSV"),
              outputs=("--out", "--log"))
    p.add_argument("--variant", required=True, help="raw | sft | prune<N>-<router|sim>")
    p = stage("evaluate", _evaluate, "lm-eval one variant on the offline tasks",
              ("--model", "variant checkpoint"), ("--data", "data directory"), ("--profile", "profile directory"),
              ("--placements", "placement directory"), ("--out", "results JSON"))
    p.add_argument("--variant", required=True, help="raw | sft | prune<N>-<router|sim>")
    stage("bench", _bench, "EP layer on CPU gloo ranks: per-expert vs dedup dispatch",
          ("--profile", "profile directory"), ("--placements", "placement directory"), ("--out", "CSV"))
    stage("report", _report, "tables and figures from the results",
          ("--results", "results directory"), ("--figures", "figures directory"),
          outputs=("--results", "--figures"))
    stage("simulate", _simulate, "scale simulator: validation against GPU sweeps, predictions to D=64",
          ("--out", "output directory (validation.csv, predictions.csv, predictions_D4_D8.csv)"),
          ("--figures", "figures directory"), outputs=("--out", "--figures"))
    from occult.stages.place_trace import add_arguments

    p = sub.add_parser("place-trace", help="placements of your own routing trace (docs/placement.md)",
                       description="placements of your own routing trace (an npz of calib and heldout top-k ids)")
    add_arguments(p)
    p.add_argument("--log-json", default=None, metavar="PATH",
                   help=f"append JSON-lines logs here (default: ${ENV_LOG_JSON}; none when unset)")
    p.set_defaults(func=_place_trace, outputs=("--out",), config=None)
    return parser


def _outputs(args: argparse.Namespace) -> list[str]:
    return [getattr(args, flag.lstrip("-").replace("-", "_")) for flag in args.outputs]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with StageRun(args.stage, args.log_json) as run:
        cfg = None
        if args.config is not None:          # every stage but place-trace
            try:
                cfg = load_config(args.config)
            except ConfigError as err:
                return run.failed(err, exit_code=2, brief=True, label="config error")
            log_event("config", f"stage {args.stage}, run {cfg.run}, config {cfg.hash()}", logger=log,
                      run=cfg.run, config_hash=cfg.hash(), config=args.config)
        if getattr(args, "threads", None):
            import torch

            torch.set_num_threads(args.threads)
        try:
            args.func(args, cfg)
        except INPUT_ERRORS as err:
            return run.failed(err, brief=True)
        except StagePaused as err:          # e.g. pretrain at its time limit: run the same command again
            return run.failed(err, exit_code=err.exit_code, brief=True, label="paused")
        except BaseException as err:  # noqa: BLE001 - recorded with its traceback; the exit code says it failed
            return run.failed(err)
        return run.done(_outputs(args))
