"""lm-eval (0.4.13) task definitions for the offline evaluation sets written by `occult.stages.data`.

`make_task_dir(eval_dir, tasks, dest)` writes one folder per task, `occult_<task>/occult_<task>.yaml`,
reading `eval_dir/<task>.jsonl` through lm-eval's `json` loader (absolute paths, so the working
directory does not matter). Load them with
`lm_eval.tasks.TaskManager(include_path=str(dest), include_defaults=False)`.

Prompts follow the formats of lm-eval's built-in tasks, written here as Jinja over the
normalised fields of `occult.stages.eval_sets.EVAL_FIELDS`:
- Winogrande is scored by partial evaluation: the two contexts are the sentence up to the blank
  with each option filled in, the continuation is the rest of the sentence (`doc_to_text` gives
  the gold index, which makes lm-eval treat the choices as contexts).
- COPA joins premise and choice with "because"/"therefore"; unlike the built-in task the choices
  carry no leading space, since lm-eval's target delimiter already adds one.
- MMLU is one task over a sample of all 57 subjects (micro-averaged), zero-shot, with the
  built-in per-subject description line.
Tasks are named `occult_<task>` so they never collide with lm-eval's built-ins.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

from occult.provenance import atomic_path

TASK_VERSION = 1
# Benchmarks of the paper's accuracy table that no registry package holds offline (data/README.md):
# the quality study's table lists them as not evaluated rather than substituting others.
UNAVAILABLE_TASKS = ("wsc273", "race", "mathqa")
NOT_AVAILABLE = "not available offline"
ACC = {"metric": "acc", "aggregation": "mean", "higher_is_better": True}
ACC_NORM = {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}

_WINOGRANDE_CHOICES = (
    "{% set blank = sentence.index('_') %}"
    "{{ [sentence[:blank] + option1, sentence[:blank] + option2] }}"
)
_COPA_TEXT = "{{ premise.strip()[:-1] }} {{ 'because' if question == 'cause' else 'therefore' }}"
_COPA_CHOICES = "{{ [choice1[:1].lower() + choice1[1:], choice2[:1].lower() + choice2[1:]] }}"
_QA_TEXT = "Question: {{question}}\nAnswer:"
_MMLU_TEXT = (
    "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\nD. {{choices[3]}}\nAnswer:"
)

# Per task: doc_to_text, doc_to_choice (a field name, a Jinja list or a fixed list), metrics and
# optional extras. doc_to_target is always the normalised gold index `label` (for Winogrande the
# gold index is doc_to_text and doc_to_target is the shared suffix).
PROMPTS: dict[str, dict[str, Any]] = {
    "winogrande": {"doc_to_text": "label", "doc_to_choice": _WINOGRANDE_CHOICES,
                   "doc_to_target": "{{ sentence[sentence.index('_') + 1:].strip() }}", "metrics": [ACC]},
    "piqa": {"doc_to_text": "Question: {{goal}}\nAnswer:", "doc_to_choice": "{{ [sol1, sol2] }}",
             "metrics": [ACC, ACC_NORM]},
    "boolq": {"doc_to_text": "{{passage}}\nQuestion: {{question}}?\nAnswer:", "doc_to_choice": ["no", "yes"],
              "metrics": [ACC]},
    "rte": {"doc_to_text": "{{sentence1}}\nQuestion: {{sentence2}} True or False?\nAnswer:",
            "doc_to_choice": ["True", "False"], "metrics": [ACC]},
    "sst2": {"doc_to_text": "{{sentence}}\nQuestion: Is this sentence positive or negative?\nAnswer:",
             "doc_to_choice": ["negative", "positive"], "metrics": [ACC]},
    "mrpc": {"doc_to_text": "Sentence 1: {{sentence1}}\nSentence 2: {{sentence2}}\n"
                            "Question: Do both sentences mean the same thing?\nAnswer:",
             "doc_to_choice": ["no", "yes"], "metrics": [ACC]},
    "hellaswag": {"doc_to_text": "query", "doc_to_choice": "choices", "metrics": [ACC, ACC_NORM]},
    "arc_easy": {"doc_to_text": _QA_TEXT, "doc_to_choice": "choices", "metrics": [ACC, ACC_NORM]},
    "arc_challenge": {"doc_to_text": _QA_TEXT, "doc_to_choice": "choices", "metrics": [ACC, ACC_NORM]},
    "openbookqa": {"doc_to_text": "question", "doc_to_choice": "choices", "metrics": [ACC, ACC_NORM]},
    "sciq": {"doc_to_text": "{{support.lstrip()}}\nQuestion: {{question}}\nAnswer:", "doc_to_choice": "choices",
             "metrics": [ACC, ACC_NORM]},
    "copa": {"doc_to_text": _COPA_TEXT, "doc_to_choice": _COPA_CHOICES, "metrics": [ACC]},
    "mmlu": {"doc_to_text": _MMLU_TEXT, "doc_to_choice": ["A", "B", "C", "D"], "metrics": [ACC],
             "description": "The following are multiple choice questions (with answers) about "
                            "{{ subject.replace('_', ' ') }}.\n\n"},
}

TASK_NAMES: dict[str, str] = {task: f"occult_{task}" for task in PROMPTS}

# Accuracy of a uniform guess. ARC has a few 3- and 5-way questions: 0.25 is the 4-way value.
CHANCE: dict[str, float] = {
    "winogrande": 0.5, "piqa": 0.5, "boolq": 0.5, "rte": 0.5, "sst2": 0.5, "mrpc": 0.5, "copa": 0.5,
    "hellaswag": 0.25, "arc_easy": 0.25, "arc_challenge": 0.25, "openbookqa": 0.25, "sciq": 0.25, "mmlu": 0.25,
}


class TaskError(ValueError):
    """A requested task is unknown or its data file is missing; the message names it."""


def task_config(task: str, data_file: Path) -> dict[str, Any]:
    """The lm-eval YAML mapping of one task reading `data_file` (made absolute)."""
    if task not in PROMPTS:
        raise TaskError(f"unknown task {task!r} (known: {', '.join(PROMPTS)})")
    prompt = PROMPTS[task]
    config: dict[str, Any] = {
        "task": TASK_NAMES[task],
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(Path(data_file).resolve())}},
        "test_split": "test",
        "output_type": "multiple_choice",
    }
    if "description" in prompt:
        config["description"] = prompt["description"]
    config.update({
        "doc_to_text": prompt["doc_to_text"],
        "doc_to_target": prompt.get("doc_to_target", "label"),
        "doc_to_choice": prompt["doc_to_choice"],
        "metric_list": [dict(m) for m in prompt["metrics"]],
        "metadata": {"version": TASK_VERSION},
    })
    return config


def make_task_dir(eval_dir: Path, tasks: list[str], dest: Path) -> Path:
    """Write `dest/occult_<task>/occult_<task>.yaml` for each task; `dest` is replaced as a whole so
    that no stale task folder remains. Returns `dest`."""
    eval_dir, dest = Path(eval_dir), Path(dest)
    configs = {}
    for task in tasks:
        data_file = eval_dir / f"{task}.jsonl"
        if task in PROMPTS and not data_file.is_file():
            raise TaskError(f"task {task!r}: its data file {data_file} does not exist (run the data stage)")
        configs[task] = task_config(task, data_file)
    with atomic_path(dest) as tmp:
        for task, config in configs.items():
            name = TASK_NAMES[task]
            (tmp / name).mkdir(parents=True)
            text = yaml.safe_dump(config, sort_keys=False, allow_unicode=True, width=1000)
            (tmp / name / f"{name}.yaml").write_text(text, encoding="utf-8")
        if not configs:
            tmp.mkdir(parents=True)
        if dest.exists():
            shutil.rmtree(dest)
    return dest
