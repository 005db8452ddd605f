"""The kernels exist once per process: `kernels/` is `occult.kernels`, whatever imports it, and the
top-level name `kernels` goes to the Hugging Face package of that name when it is installed."""

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
from occult._top_level_kernels import installed_elsewhere
if installed_elsewhere("kernels", sys.modules["occult.kernels"].__file__) is None:
    assert sys.modules["kernels"] is sys.modules["occult.kernels"], sys.modules["kernels"]
    try:
        import kernels.grouped_swiglu
    except ImportError as error:
        assert "import them as occult.kernels" in str(error), error
    else:
        raise AssertionError("kernels.grouped_swiglu imported as a second copy")
else:  # the Hugging Face package (transformers >= 5.25 requires it) keeps its name
    assert sys.modules["kernels"] is not sys.modules["occult.kernels"]
    assert "grouped_swiglu" not in vars(sys.modules["kernels"])
    assert not hasattr(sys.modules["kernels"], "grouped_swiglu_ref")
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


FAKE_PACKAGE_SCRIPT = """
import sys
import kernels
assert kernels.WHO == "the other kernels", kernels
assert kernels.sub.VALUE == 7
import occult.kernels
assert sys.modules["kernels"] is kernels and kernels is not occult.kernels
assert callable(occult.kernels.grouped_swiglu)
print("handed over")
"""

FAKE_INIT = "from kernels.sub import VALUE\nfrom kernels import sub\nWHO = 'the other kernels'\n"


def _fake_kernels_package(where: Path, init: str) -> None:
    (where / "kernels").mkdir()
    (where / "kernels" / "__init__.py").write_text(init)
    (where / "kernels" / "sub.py").write_text("VALUE = 7\n")


def test_the_top_level_name_goes_to_another_installed_kernels_package(tmp_path):
    _fake_kernels_package(tmp_path, FAKE_INIT)
    # the repository root comes first on sys.path (cwd), as under pytest; the other package after it
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", FAKE_PACKAGE_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "handed over" in done.stdout


def test_a_failing_other_kernels_package_fails_loudly_and_leaves_no_half_module(tmp_path):
    _fake_kernels_package(tmp_path, "raise RuntimeError('broken other kernels')\n")
    script = (
        "import sys\n"
        "try:\n    import kernels\n"
        "except RuntimeError as error:\n    assert 'broken other kernels' in str(error)\n"
        "else:\n    raise AssertionError('imported')\n"
        "assert 'kernels' not in sys.modules, sys.modules.get('kernels')\n"
        "print('raised')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "raised" in done.stdout
