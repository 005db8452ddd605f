"""Provenance and atomic output: every result records where it came from.

`provenance(cfg)` gives the git commit, resolved-config hash, package versions, hardware and
seed. `atomic_path(path)` yields a temporary path beside `path` and renames it into place only
when the block finishes, so a killed job never leaves a half-written output.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import json
import os
import platform
import random
import shutil
import subprocess
import zlib
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "triton", "transformers", "lm_eval", "snakemake", "pandas", "numpy")


def git_commit(root: Path = REPO_ROOT) -> str:
    """Short commit of the checkout at `root`, "-dirty" when tracked code or config differs from it
    (changes under results/ and figures/, and to documentation: docs/ and *.md, do not count);
    $OCCULT_COMMIT where git cannot tell; "unknown (installed occult VERSION)" outside a checkout.

    A set $OCCULT_COMMIT wins over git: a copied checkout's .git can be stale or missing, and
    whoever copied it knows the commit (tools/remote/README.md)."""
    pinned = os.environ.get("OCCULT_COMMIT", "").strip()
    if pinned:
        return pinned
    if not (root / ".git").exists():      # an installed package (site-packages), not a checkout
        from occult import __version__
        return f"unknown (installed occult {__version__})"
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        # Committed outputs (results/, figures/) are rewritten by the pipeline itself, and no stage
        # reads the documentation: a change there does not make the code that produces them dirty.
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
             ".", ":(exclude)results", ":(exclude)figures", ":(exclude)docs", ":(exclude)*.md"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("OCCULT_COMMIT", "unknown")


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def cpu_model() -> str | None:
    """The CPU's model name (Linux `/proc/cpuinfo`), else None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def hardware() -> dict[str, Any]:
    """CPU and GPU facts. `cpu_isa` is the vector instruction set torch's CPU kernels dispatch to
    (AVX2, AVX512, ...): CPU float results can differ in the last bits between machines that differ in it."""
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                            "cpu_model": cpu_model()}
    try:
        import torch

        info["cpu_isa"] = torch.backends.cpu.get_cpu_capability()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
            info["interconnect"] = gpu_interconnect(info["gpu_count"], _nvidia_smi_topology())
    except ImportError:
        pass
    return info


def gpu_interconnect(gpu_count: int, topology: str | None) -> str:
    """How GPU0 reaches the other GPUs, from `nvidia-smi topo -m` (e.g. "NV18": 18 NVLinks;
    "PIX"/"PHB"/"SYS": PCIe paths), the distinct link types joined by "/"."""
    if gpu_count < 2:
        return "single GPU"
    for line in (topology or "").splitlines():
        fields = line.split()
        if line.startswith("GPU0"):            # GPU0's row (the header row starts with whitespace)
            links = [f for f in fields[1:gpu_count + 1] if f != "X"]
            if links:
                return "/".join(sorted(set(links)))
    return "unknown (nvidia-smi topo -m unavailable)"


@functools.lru_cache(maxsize=1)
def _nvidia_smi_topology() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(config_hash: str | None = None, seed: int | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "commit": git_commit(),
        "config_hash": config_hash,
        "seed": seed,
        "versions": package_versions(),
        "hardware": hardware(),
        "python": platform.python_version(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path`; move it onto `path` only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        if tmp.is_dir() and path.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            if tmp.is_dir():
                shutil.rmtree(tmp)
            else:
                tmp.unlink()


def write_json(path: str | Path, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def write_csv(path: str | Path, frame, meta: dict[str, Any] | None = None) -> None:
    """Write a pandas frame; `meta` goes to a `<path>.meta.json` sidecar."""
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False, float_format="%.6g")
    if meta is not None:
        write_json(Path(str(path) + ".meta.json"), meta)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    import torch

    torch.manual_seed(seed)


def derive_seed(*parts: object) -> int:
    """A stable 31-bit seed from any parts (same in every process, unlike `hash`)."""
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF
