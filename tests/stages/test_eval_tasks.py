"""lm-eval task YAMLs for the offline eval sets: structure, prompt formats, and a real lm-eval run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from occult.stages.data import write_jsonl
from occult.stages.eval_sets import EVAL_FIELDS, load_eval_examples
from occult.stages.tokenizer import train_tokenizer
from occult.stages.eval_tasks import CHANCE, PROMPTS, TASK_NAMES, TaskError, make_task_dir

TASKS = list(EVAL_FIELDS)


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eval")
    for task in TASKS:
        examples, _ = load_eval_examples(task, 4, seed=0)
        write_jsonl(out / f"{task}.jsonl", examples)
    return out


@pytest.fixture(scope="module")
def task_dir(eval_dir, tmp_path_factory) -> Path:
    return make_task_dir(eval_dir, TASKS, tmp_path_factory.mktemp("tasks") / "lm_eval_tasks")


@pytest.fixture(scope="module")
def task_dict(task_dir):
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    return manager.load([TASK_NAMES[t] for t in TASKS])["tasks"]


def test_tables_cover_every_task():
    assert set(PROMPTS) == set(TASK_NAMES) == set(CHANCE) == set(EVAL_FIELDS)
    assert all(name == f"occult_{task}" for task, name in TASK_NAMES.items())
    assert all(0 < p < 1 for p in CHANCE.values())


def test_yaml_layout(task_dir, eval_dir):
    folders = sorted(p.name for p in task_dir.iterdir())
    assert folders == sorted(TASK_NAMES.values())
    for task, name in TASK_NAMES.items():
        config = yaml.safe_load((task_dir / name / f"{name}.yaml").read_text())
        assert config["task"] == name
        assert config["metadata"] == {"version": 1}
        assert config["dataset_path"] == "json" and config["test_split"] == "test"
        data_file = Path(config["dataset_kwargs"]["data_files"]["test"])
        assert data_file.is_absolute() and data_file == (eval_dir / f"{task}.jsonl").resolve()
        assert config["output_type"] == "multiple_choice"
        assert "acc" in [m["metric"] for m in config["metric_list"]]


def test_task_dir_is_replaced_not_merged(eval_dir, tmp_path):
    dest = make_task_dir(eval_dir, ["piqa", "copa"], tmp_path / "tasks")
    make_task_dir(eval_dir, ["copa"], dest)
    assert [p.name for p in dest.iterdir()] == ["occult_copa"]


def test_missing_file_or_unknown_task_is_named(eval_dir, tmp_path):
    with pytest.raises(TaskError, match="'piqa'.*does not exist"):
        make_task_dir(tmp_path, ["piqa"], tmp_path / "tasks")
    with pytest.raises(TaskError, match="unknown task 'race'"):
        make_task_dir(eval_dir, ["piqa", "race"], tmp_path / "tasks")
    assert not (tmp_path / "tasks").exists()


def _first_doc(task_dict, task: str) -> tuple[object, dict]:
    task_obj = task_dict[TASK_NAMES[task]]
    return task_obj, next(iter(task_obj.test_docs()))


def test_prompt_formats_match_the_builtin_tasks(task_dict):
    wino, doc = _first_doc(task_dict, "winogrande")
    blank = doc["sentence"].index("_")
    assert wino.doc_to_text(doc) == doc["label"]                        # partial evaluation
    assert wino.doc_to_choice(doc) == [doc["sentence"][:blank] + doc["option1"],
                                       doc["sentence"][:blank] + doc["option2"]]
    assert wino.doc_to_target(doc) == doc["sentence"][blank + 1:].strip()

    copa, doc = _first_doc(task_dict, "copa")
    connector = "because" if doc["question"] == "cause" else "therefore"
    assert copa.doc_to_text(doc) == doc["premise"].strip()[:-1] + " " + connector
    assert copa.doc_to_choice(doc)[0] == doc["choice1"][0].lower() + doc["choice1"][1:]

    arc, doc = _first_doc(task_dict, "arc_easy")
    assert arc.doc_to_text(doc) == f"Question: {doc['question']}\nAnswer:"
    assert arc.doc_to_choice(doc) == doc["choices"] and arc.doc_to_target(doc) == doc["label"]

    mmlu, doc = _first_doc(task_dict, "mmlu")
    assert mmlu.doc_to_text(doc).endswith(f"D. {doc['choices'][3]}\nAnswer:")
    context = mmlu.fewshot_context(doc, num_fewshot=0)
    assert context.startswith(f"The following are multiple choice questions (with answers) about "
                              f"{doc['subject'].replace('_', ' ')}.")

    for task in TASKS:
        task_obj, doc = _first_doc(task_dict, task)
        choices = task_obj.doc_to_choice(doc)
        assert isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) for c in choices)


def test_lm_eval_runs_every_task_on_a_tiny_model(eval_dir, task_dir):
    import lm_eval.evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = [line for task in TASKS for line in (eval_dir / f"{task}.jsonl").read_text().splitlines()]
    tok = train_tokenizer(texts, 300)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )).eval()
    results = lm_eval.evaluator.simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tok, batch_size=4),
        tasks=[TASK_NAMES[t] for t in TASKS],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        limit=3,
        bootstrap_iters=0,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )
    for task in TASKS:
        row = results["results"][TASK_NAMES[task]]
        assert 0.0 <= row["acc,none"] <= 1.0, (task, row)
        if any(m["metric"] == "acc_norm" for m in PROMPTS[task]["metrics"]):
            assert 0.0 <= row["acc_norm,none"] <= 1.0, (task, row)
        assert results["n-samples"][TASK_NAMES[task]]["effective"] == 3
