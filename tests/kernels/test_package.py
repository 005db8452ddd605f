"""The kernels exist once per process: `kernels/` is installed as `occult.kernels`, and has no
`__init__.py`, so with the repository root on sys.path (as under `python -m` from the root) the
top-level name `kernels` stays with the Hugging Face package of that name, which transformers imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ONE_COPY = """
import sys
import torch
import transformers.integrations.hub_kernels
from occult.kernels import gemm_configs
from occult.kernels.grouped_swiglu import grouped_swiglu
top = sys.modules.get("kernels")
assert top is None or not hasattr(top, "grouped_swiglu"), top
assert not any(name.startswith("kernels.") and "swiglu" in name for name in sys.modules), sorted(sys.modules)
x = torch.randn(8, 32, requires_grad=True)
w = torch.randn(2, 32, 32, requires_grad=True)
meta = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
gemm_configs.LAST_LAUNCH_META.clear()
with gemm_configs.forced_gemm_meta("_swiglu_fwd_kernel", meta):
    grouped_swiglu(x, torch.arange(8), torch.tensor([0, 4, 8]), w).sum().backward()
assert gemm_configs.LAST_LAUNCH_META["_swiglu_fwd_kernel"] == meta, gemm_configs.LAST_LAUNCH_META
print("one copy")
"""


def test_transformers_and_occult_kernels_load_one_copy_from_the_repository_root():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", ONE_COPY], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "one copy" in done.stdout


OTHER = """
import kernels
assert kernels.WHO == "the other kernels", kernels
assert kernels.sub.VALUE == 7
import occult.kernels.combine
print("the other package")
"""


def test_an_installed_kernels_package_keeps_its_name_behind_the_repository_root(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("from kernels import sub\nWHO = 'the other kernels'\n")
    (tmp_path / "kernels" / "sub.py").write_text("VALUE = 7\n")
    # the repository root comes first on sys.path (cwd); the other package after it
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", OTHER], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "the other package" in done.stdout


def test_the_kernels_folder_is_no_regular_package():
    assert not (ROOT / "kernels" / "__init__.py").exists()
