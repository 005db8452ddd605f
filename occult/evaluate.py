"""lm-eval on one variant: the model, its variant's routing rule, the offline tasks.

Runs `lm_eval.simple_evaluate` with `HFLM` on the model instance over task YAMLs generated from
the data stage's evaluation sets; lm-eval's own results JSON is kept, and a summary with
accuracy, standard error and chance level per task is added for the report.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from occult.config import Config, parse_variant
from occult.provenance import provenance, seed_everything, write_json

log = logging.getLogger(__name__)


def evaluate(cfg: Config, variant_name: str, model_dir: Path, data_dir: Path, profile_dir: Path,
             placements_dir: Path, out_json: Path, limit: int | None = None) -> dict:
    """Evaluate one variant; writes `out_json` (summary + lm-eval's results) and returns it."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from occult.evaltasks import CHANCE, TASK_NAMES, make_task_dir
    from occult.models import load_checkpoint, set_routing
    from occult.variants import routing_for_variant

    variant = parse_variant(variant_name)
    seed_everything(cfg.seed)
    model, tokenizer = load_checkpoint(model_dir, device="cuda" if torch.cuda.is_available() else "cpu")
    model.eval()
    set_routing(model, routing_for_variant(cfg, variant, placements_dir, profile_dir))
    tasks = list(cfg.data.eval_tasks)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="occult-tasks-") as tmp:
        task_dir = make_task_dir(data_dir / "eval", tasks, Path(tmp))
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.evaluate.batch_size,
                  max_length=cfg.model.max_seq_len)
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=[TASK_NAMES[t] for t in tasks],
            task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
            bootstrap_iters=100,        # acc has a closed-form stderr; no bootstrap is drawn for it
            limit=limit,
            random_seed=cfg.seed,
            numpy_random_seed=cfg.seed,
            torch_random_seed=cfg.seed,
            log_samples=False,
        )
    set_routing(model, None)
    scores = []
    for task in tasks:
        res = out["results"][TASK_NAMES[task]]
        scores.append({
            "task": task,
            "acc": res.get("acc,none"),
            "acc_stderr": res.get("acc_stderr,none"),
            "acc_norm": res.get("acc_norm,none"),
            "acc_norm_stderr": res.get("acc_norm_stderr,none"),
            "chance": CHANCE[task],
            "n": out.get("n-samples", {}).get(TASK_NAMES[task], {}).get("effective"),
        })
    summary = {
        "variant": variant.name,
        "scores": scores,
        "elapsed_s": time.perf_counter() - start,
        "provenance": provenance(cfg.hash(), cfg.seed, stage="evaluate", variant=variant.name),
        "lm_eval": {"results": out["results"], "configs": out.get("configs"),
                    "versions": out.get("versions"), "n-samples": out.get("n-samples"),
                    "config": out.get("config")},
    }
    write_json(out_json, json.loads(json.dumps(summary, default=str)))
    log.info("variant %s evaluated in %.1f s", variant.name, summary["elapsed_s"])
    return summary
