"""occult.routing.profiling: co-activation counts, router-logit statistics, routing files and their checks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from occult.config import load_config
from occult.models.moe import build_tiny_olmoe, default_topk, load_checkpoint, routing_override
from occult.routing.profiling import (
    ProfileError,
    coactivation_counts,
    corpus_windows,
    expert_similarity,
    load_profile,
    load_routing,
    profile,
    read_corpus,
    route_windows,
    sample_routing,
    spread_indices,
)
from tests.models.test_moe import EOT, tiny_model_cfg, write_standin_data

REPO = Path(__file__).resolve().parents[2]
E, K, D = 8, 2, 4   # experts, top-k, devices of the pruning test (2 experts per device)


def small_config(calibration_tokens: int = 1000, heldout_tokens: int = 300):
    model = dataclasses.asdict(tiny_model_cfg())
    return load_config(REPO / "config" / "config.yaml", overrides={
        "model": model,
        "profile": {"calibration_tokens": calibration_tokens, "heldout_tokens": heldout_tokens, "seq_len": 48},
    })


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> tuple[Path, Path]:
    """(data_dir, model_dir) with a tiny random OLMoE checkpoint."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("profiling")
    data_dir = write_standin_data(root / "data")
    tokenizer = AutoTokenizer.from_pretrained(data_dir / "tokenizer")
    eot = tokenizer.convert_tokens_to_ids(EOT)
    model = build_tiny_olmoe(tiny_model_cfg(), len(tokenizer), pad_token_id=eot, bos_token_id=eot,
                             eos_token_id=eot, seed=0)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return data_dir, root / "model"


def prune_to_one_device(layer_index: int, logits_TE: torch.Tensor):
    """N_d = 1: keep the device of the best expert, take the top-k among its experts."""
    per_device = E // D
    best_T = logits_TE.argmax(-1)
    device_TE = torch.arange(E) // per_device
    outside_TE = device_TE[None, :] != (best_T // per_device)[:, None]
    return default_topk(logits_TE.masked_fill(outside_TE, float("-inf")), K)


def test_profile_writes_consistent_counts(workspace, tmp_path):
    data_dir, model_dir = workspace
    cfg = small_config()
    profile(cfg, model_dir, data_dir, tmp_path)
    prof = load_profile(tmp_path / "profile.npz")
    assert prof.tokens == 1000 and prof.top_k == K and prof.num_experts == E
    assert prof.layers.tolist() == [0, 1]
    for l in range(2):
        c = prof.coactivation[l]
        assert np.array_equal(c, c.T), "co-activation must be symmetric"
        assert np.array_equal(np.diag(c), prof.load[l])
        assert prof.load[l].sum() == prof.tokens * K
        assert (c >= 0).all() and c.dtype == np.int64
    assert np.allclose(prof.logit_gram, np.swapaxes(prof.logit_gram, 1, 2))

    calib = load_routing(tmp_path / "routing_calibration.npz")
    held = load_routing(tmp_path / "routing_heldout.npz")
    assert calib.ids.shape == (2, 1000, K) and calib.ids.dtype == np.int16
    assert held.ids.shape == (2, 300, K)
    assert calib.source_names == ("code", "prose") and len(calib.sources) == 1000
    assert set(np.unique(calib.sources)) == {0, 1}
    for l in range(2):
        assert np.array_equal(coactivation_counts(torch.from_numpy(calib.ids[l]), E), prof.coactivation[l])

    meta = json.loads((tmp_path / "profile.json").read_text())
    assert meta["provenance"]["config_hash"] == cfg.hash()
    assert meta["splits"]["calibration"]["tokens"] == 1000
    assert sum(meta["splits"]["heldout"]["tokens_per_source"].values()) == 300
    assert set(meta["files"]["profile.npz"]["arrays"]) == {
        "coactivation", "load", "logit_gram", "logit_sum", "tokens", "layers", "top_k", "num_experts"}

    # a sample of the trace reads back equal to its runs of the whole trace; one run: the first tokens
    sampled = sample_routing(tmp_path / "routing_heldout.npz", tmp_path / "sample.npz", 120, stretches=4)
    back = load_routing(tmp_path / "sample.npz")
    keep = np.concatenate([np.arange(0, 30), np.arange(90, 120), np.arange(180, 210), np.arange(270, 300)])
    assert back.ids.dtype == np.uint8 and np.array_equal(back.ids, held.ids[:, keep])
    assert np.array_equal(back.sources, held.sources[keep]) and back.source_names == held.source_names
    assert np.array_equal(back.layers, held.layers) and np.array_equal(sampled.ids, held.ids[:, keep])
    first = sample_routing(tmp_path / "routing_heldout.npz", tmp_path / "first.npz", 120, stretches=1)
    assert np.array_equal(first.ids, held.ids[:, :120])
    with pytest.raises(ValueError, match="tokens=0"):
        sample_routing(tmp_path / "routing_heldout.npz", tmp_path / "none.npz", 0)
    assert not (tmp_path / "none.npz").exists()

    sim = prof.similarity()
    assert sim.shape == (2, E, E)
    assert np.all(sim <= 1.0) and np.all(sim >= -1.0)
    assert np.allclose(np.diagonal(sim, axis1=1, axis2=2), 1.0)


def test_profile_with_pruned_routing_override(workspace, tmp_path):
    data_dir, model_dir = workspace
    profile(small_config(), model_dir, data_dir, tmp_path, routing=prune_to_one_device)
    for name in ("routing_calibration.npz", "routing_heldout.npz"):
        ids = load_routing(tmp_path / name).ids.astype(np.int64)
        devices = ids // (E // D)
        assert (devices == devices[..., :1]).all(), "pruned tokens must stay on one device"
    prof = load_profile(tmp_path / "profile.npz")
    same_device = (np.arange(E)[:, None] // (E // D)) == (np.arange(E)[None, :] // (E // D))
    assert prof.coactivation[:, ~same_device].sum() == 0
    assert prof.load.sum(axis=1).tolist() == [prof.tokens * K] * 2

    # the same override through the library path, against unpruned routing of the same windows
    model, tokenizer = load_checkpoint(model_dir)
    windows = corpus_windows(data_dir / "corpus" / "heldout.jsonl", tokenizer, 200, 48, seed=0)
    free = route_windows(model, windows, logit_stats=False)
    with routing_override(model, prune_to_one_device):
        pruned = route_windows(model, windows, logit_stats=False)
    assert free.coactivation_LEE[:, ~same_device].sum() > 0
    assert pruned.coactivation_LEE[:, ~same_device].sum() == 0


def test_expert_similarity_definition():
    rng = np.random.default_rng(0)
    z_NE = rng.normal(size=(500, 6)) + np.array([3.0, 0, 0, 0, 0, 0])
    z_NE[:, 5] = 0.0
    gram, total = (z_NE.T @ z_NE)[None], z_NE.sum(0)[None]
    plain = expert_similarity(gram, total, 500)[0]
    norms = np.linalg.norm(z_NE, axis=0)
    assert np.isclose(plain[0, 1], z_NE[:, 0] @ z_NE[:, 1] / (norms[0] * norms[1]))
    centred = expert_similarity(gram, total, 500, centred=True)[0]
    assert np.allclose(centred[:5, :5], np.corrcoef(z_NE[:, :5].T))
    assert plain[5, 5] == 1.0 and (plain[5, :5] == 0).all() and (centred[:5, 5] == 0).all()


def test_truncated_or_malformed_files_are_rejected(tmp_path):
    good = dict(
        coactivation=np.zeros((1, 4, 4), np.int64), load=np.zeros((1, 4), np.int64),
        logit_gram=np.zeros((1, 4, 4)), logit_sum=np.zeros((1, 4)), tokens=np.int64(0),
        layers=np.array([0]), top_k=np.int64(2), num_experts=np.int64(4),
    )
    np.savez(tmp_path / "good.npz", **good)
    assert load_profile(tmp_path / "good.npz").num_experts == 4

    data = (tmp_path / "good.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ProfileError, match="cut.npz"):
        load_profile(tmp_path / "cut.npz")
    np.savez(tmp_path / "shape.npz", **{**good, "load": np.zeros((1, 5), np.int64)})
    with pytest.raises(ProfileError, match=r"shape.npz: array 'load' has shape \[1, 5\]"):
        load_profile(tmp_path / "shape.npz")
    np.savez(tmp_path / "dtype.npz", **{**good, "coactivation": np.zeros((1, 4, 4))})
    with pytest.raises(ProfileError, match="'coactivation' has dtype float64"):
        load_profile(tmp_path / "dtype.npz")
    np.savez(tmp_path / "missing.npz", **{k: v for k, v in good.items() if k != "logit_sum"})
    with pytest.raises(ProfileError, match=r"missing.npz: missing arrays \['logit_sum'\]"):
        load_profile(tmp_path / "missing.npz")
    with pytest.raises(ProfileError, match="absent.npz"):
        load_routing(tmp_path / "absent.npz")


def test_read_corpus_names_bad_lines(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"source": "a", "text": "ok"}\n{"source": "a"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_corpus(bad)
    good = tmp_path / "good.jsonl"
    good.write_text('{"source": "a", "text": "one"}\n\n{"source": "b", "text": ""}\n')
    assert read_corpus(good) == [("a", "one")]
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        read_corpus(tmp_path / "absent.jsonl")


def test_read_corpus_keeps_unicode_line_separators_inside_texts(tmp_path):
    """json.dumps(ensure_ascii=False) leaves U+2028, U+2029, U+0085 and \\x1c raw; they are text."""
    texts = ["a\u2028b", "c\u2029d", "e\u0085f", "g\x1ch", "i\x0bj"]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"source": "s", "text": t}, ensure_ascii=False) + "\n" for t in texts),
                    encoding="utf-8")
    assert read_corpus(path) == [("s", t) for t in texts]


@pytest.mark.parametrize("total,tokens,stretches", [(1000, 160, 16), (1000, 17, 16), (50, 7, 16), (10, 10, 4),
                                                    (10, 25, 4), (99, 90, 3)])
def test_spread_indices_take_equal_runs_from_the_whole_split(total, tokens, stretches):
    keep = spread_indices(total, tokens, stretches)
    assert len(keep) == min(tokens, total) and len(np.unique(keep)) == len(keep)
    assert keep[0] == 0 and keep[-1] == total - 1 and np.all(np.diff(keep) > 0)
    runs = np.split(keep, np.flatnonzero(np.diff(keep) > 1) + 1)
    lengths = [len(run) for run in runs]
    assert len(runs) <= stretches and max(lengths) - min(lengths) <= 1 or len(runs) == 1


def test_a_spread_sample_mixes_sources_as_the_whole_split_does():
    """Documents come in source blocks (a long one first): the first tokens hold one source, runs
    spread over the split hold each in its share."""
    sources = np.repeat([0, 1, 2, 3], [4000, 3000, 2000, 1000])
    first, spread = sources[:1024], sources[spread_indices(len(sources), 1024)]
    whole = np.bincount(sources, minlength=4) / len(sources)
    assert np.bincount(first, minlength=4)[0] == 1024
    assert np.abs(np.bincount(spread, minlength=4) / 1024 - whole).max() < 0.05
