"""occult as an installed package: a wheel built from the repository, installed in a fresh virtual
environment, runs its command line, one stage, the example and docs/library.md's calls from a
directory outside the checkout.

The new environment sees the test environment's site-packages (torch, transformers, ...) through
a `.pth` path entry, so only occult itself comes from the wheel: a path entry does not run the
test environment's own `.pth` hooks, among them an editable install's finder for the checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from occult.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "occult", "kernels", "config")   # what the build reads


def _run(cmd: list, cwd: Path, env: dict | None = None, timeout: float = 300) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _build_wheel(tmp: Path) -> Path:
    """A wheel built from a copy of the checkout's files (the build writes into its source tree)."""
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(REPO / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", src],
         cwd=tmp)
    (wheel,) = (tmp / "dist").glob("occult-*.whl")
    return wheel


def _venv_with_wheel(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).strip())
    outer = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "test_environment.pth").write_text("".join(f"{path}\n" for path in outer))
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], cwd=tmp)
    return venv


def _write_profile(profile_dir: Path, num_experts: int = 16, k: int = 4, layers: int = 2, tokens: int = 300) -> None:
    """A small profile: the three files `occult place` reads."""
    rng = np.random.default_rng(0)
    profile_dir.mkdir(parents=True)
    ids = np.stack([np.argsort(rng.random((2 * tokens, num_experts)), axis=1)[:, :k] for _ in range(layers)])
    calib, heldout = ids[:, :tokens], ids[:, tokens:]
    hot = np.zeros((layers, tokens, num_experts), dtype=np.int64)
    np.put_along_axis(hot, calib, 1, axis=2)
    coact = np.einsum("lne,lnf->lef", hot, hot)
    np.savez(profile_dir / "profile.npz", coactivation=coact, load=hot.sum(1), layers=np.arange(layers))
    for name, trace in (("calibration", calib), ("heldout", heldout)):
        np.savez(profile_dir / f"routing_{name}.npz", ids=trace.astype(np.int16), layers=np.arange(layers))


def _stages() -> list[str]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    venv = _venv_with_wheel(tmp_path, _build_wheel(tmp_path))
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "OCCULT_COMMIT")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    python, occult = venv / "bin" / "python", venv / "bin" / "occult"

    where = _run([python, "-c", "import occult, sys; print(occult.__file__); print(sys.prefix)"], cwd=work, env=env)
    module, prefix = where.split()
    assert Path(prefix).resolve() in Path(module).resolve().parents, f"occult imported from {module}"

    assert "place" in _run([occult, "--help"], cwd=work, env=env)
    for stage in _stages():
        wanted = "--trace" if stage == "place-trace" else "--config"   # place-trace reads a trace, no config
        assert wanted in _run([occult, stage, "--help"], cwd=work, env=env), stage

    _write_profile(work / "profile")
    _run([occult, "place", "--config", "tiny", "--profile", "profile", "--out", "placement",
          "--table", "placement/expected_ct.csv"], cwd=work, env=env)
    assert sorted(p.name for p in (work / "placement").glob("D*.json")) == sorted(
        f"D{d}_{m}.json" for d in (2, 4, 8) for m in ("contiguous", "greedy", "swap", "latency"))   # latency: the shipped cost model
    provenance = json.loads((work / "placement" / "D2_greedy.json").read_text())["provenance"]
    assert provenance["commit"].startswith("unknown (installed occult "), provenance["commit"]
    bad = subprocess.run([occult, "place", "--config", "no-such-preset", "--profile", "profile", "--out", "x",
                          "--table", "x.csv"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no-such-preset does not exist" in bad.stderr, bad.stderr

    shutil.copy2(REPO / "examples" / "communicate_less.py", work)
    out = _run([python, "communicate_less.py", "--tokens", "256"], cwd=work, env=env)
    assert "occult: E[C_T]" in out, out

    shutil.copy2(REPO / "tests" / "library_calls.py", work)
    assert "library calls ok" in _run([python, "library_calls.py", REPO / "docs" / "library.md"], cwd=work, env=env)
