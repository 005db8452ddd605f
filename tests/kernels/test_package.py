"""The kernels exist once per process: `kernels/` is `occult.kernels`, whatever imports it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Run from the repository root with it on sys.path (as `python -m` and pytest do). transformers'
# probe for the Hugging Face `kernels` package imports a top-level `kernels`; before the alias in
# kernels/__init__.py that made a second copy whose custom-op registration took over, so a forced
# config set on occult.kernels was not what an autograd-recording call launched.
SCRIPT = """
import importlib, sys
import torch
swiglu_module = importlib.import_module("occult.kernels.grouped_swiglu")
from occult.kernels import grouped_swiglu
import transformers.integrations.hub_kernels
assert sys.modules["kernels"] is sys.modules["occult.kernels"], sys.modules["kernels"]
try:
    import kernels.grouped_swiglu
except ImportError as error:
    assert "import them as occult.kernels" in str(error), error
else:
    raise AssertionError("kernels.grouped_swiglu imported as a second copy")
x = torch.randn(8, 32, requires_grad=True)
w = torch.randn(2, 32, 32, requires_grad=True)
meta = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
swiglu_module.LAST_LAUNCH_META.clear()
with swiglu_module.forced_gemm_meta("_swiglu_fwd_kernel", meta):
    grouped_swiglu(x, torch.arange(8), torch.tensor([0, 4, 8]), w).sum().backward()
assert swiglu_module.LAST_LAUNCH_META["_swiglu_fwd_kernel"] == meta, swiglu_module.LAST_LAUNCH_META
print("one copy")
"""


def test_a_top_level_kernels_import_is_the_one_package():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "one copy" in done.stdout
