#!/usr/bin/env bash
# Build the sweep's third-party baselines on a CUDA machine from their sdists (never committed here).
#
# Usage: [BASELINES="megablocks deepspeed tutel"] tools/build_baselines.sh SDIST_DIR [BUILD_DIR] [PREFIX]
#   SDIST_DIR  stanford_stk-0.7.1.tar.gz, grouped_gemm-0.3.0.tar.gz, megablocks-0.10.0.tar.gz (PyPI sdists:
#              `pip download --no-deps --no-binary :all: stanford-stk==0.7.1 grouped_gemm==0.3.0
#              megablocks==0.10.0`); optionally deepspeed-*.tar.gz with the wheels it needs (hjson, pydantic,
#              pydantic-core, annotated-types, typing-inspection, typing-extensions for the machine's
#              python) and tutel-*.tar.gz (Tutel's source archive: it is not on PyPI).
#   BUILD_DIR  scratch folder for the unpacked sources and the wheels (default /tmp/occult-baselines)
#   PREFIX     where the two grouped_gemm builds go (default <repository>/.thirdparty/baselines, ignored by git)
#
# grouped_gemm is built twice, each from its own unpacked copy (so that no object file of one build
# is reused by the other), into a wheel of its own, installed with `pip install --target`:
#   $PREFIX/gg-cublas    the default build: one cuBLAS GEMM per expert
#   $PREFIX/gg-cutlass   GROUPED_GEMM_CUTLASS=1 at build time (its setup.py adds -DGROUPED_GEMM_CUTLASS):
#                        CUTLASS grouped-GEMM kernels
# Neither goes to site-packages: a sweep process picks one with
# `python -m occult.harness.sweep --grouped-gemm-dir $PREFIX --methods megablocks[:grouped_gemm=cutlass]`,
# and MegaBlocks checks which kernels the imported build runs. stanford-stk and MegaBlocks (and
# DeepSpeed, Tutel) are installed into the running python3's site-packages.
# One compatibility edit: MegaBlocks' csrc/cumsum.h passes CUB's removed `debug_synchronous` argument to
# DeviceScan::{Exclusive,Inclusive}Sum; it is dropped.
#
# Flags: pip --no-deps --no-build-isolation --no-index, TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS
# (default 16). WHEEL_CACHE: a folder of wheels this script built earlier on the same image
# ($BUILD_DIR/wheels: stanford_stk-*.whl, megablocks-*.whl, gg-cublas/*.whl, gg-cutlass/*.whl) is
# installed instead of building (seconds instead of minutes).
# Needs: the machine's CUDA torch, nvcc, ninja.
set -euo pipefail
sdist=$(realpath "${1:?usage: build_baselines.sh SDIST_DIR [BUILD_DIR] [PREFIX]}")
build=${2:-/tmp/occult-baselines}
repo=$(cd "$(dirname "$0")/.." && pwd)
prefix=${3:-$repo/.thirdparty/baselines}
cache=${WHEEL_CACHE:-}
if [ -n "$cache" ] && [ -d "$cache" ]; then cache=$(realpath "$cache"); fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
mkdir -p "$build" "$prefix"
build=$(realpath "$build"); prefix=$(realpath "$prefix")
cd "$build"
pip_install() { python3 -m pip install -q --no-deps --no-build-isolation --no-index "$@"; }
pip_wheel() { python3 -m pip wheel -q --no-deps --no-build-isolation --no-index --no-cache-dir "$@"; }
baselines=${BASELINES:-megablocks deepspeed tutel}
start=$SECONDS
failed=0
fail() { echo "build_baselines: FAILED: $*" >&2; failed=1; }

if [[ " $baselines " == *" deepspeed "* ]]; then
  if ls "$sdist"/deepspeed-*.tar.gz >/dev/null 2>&1; then
    echo "== installing deepspeed"
    ( pip_install "$sdist"/*.whl && DS_BUILD_OPS=0 pip_install "$sdist"/deepspeed-*.tar.gz ) || fail "deepspeed"
  else
    echo "build_baselines: no deepspeed sdist in $sdist: the sweep's deepspeed rows will say unavailable"
  fi
fi

if [[ " $baselines " == *" tutel "* ]]; then
  if ls "$sdist"/tutel-*.tar.gz >/dev/null 2>&1; then
    echo "== building tutel"
    rm -rf tutel-src && mkdir tutel-src && tar xzf "$sdist"/tutel-*.tar.gz -C tutel-src
    ( cd tutel-src/*/ && pip_install . ) || fail "tutel"
  else
    echo "build_baselines: no tutel-*.tar.gz in $sdist: the sweep's tutel rows will say unavailable"
  fi
fi

if [[ " $baselines " == *" megablocks "* ]]; then
  for name in stanford_stk grouped_gemm megablocks; do
    ls "$sdist"/$name-*.tar.gz >/dev/null 2>&1 || fail "no $name-*.tar.gz in $sdist"
  done
  if [ -n "$cache" ] && ls "$cache"/stanford_stk-*.whl "$cache"/megablocks-*.whl "$cache"/gg-cublas/*.whl \
      "$cache"/gg-cutlass/*.whl >/dev/null 2>&1; then
    echo "== using the wheels in $cache"
    wheels=$cache
  else
    wheels=$build/wheels
    rm -rf src && mkdir -p src/cublas src/cutlass "$wheels"/gg-cublas "$wheels"/gg-cutlass
    tar xzf "$sdist"/stanford_stk-*.tar.gz -C src
    tar xzf "$sdist"/megablocks-*.tar.gz -C src
    tar xzf "$sdist"/grouped_gemm-*.tar.gz -C src/cublas
    tar xzf "$sdist"/grouped_gemm-*.tar.gz -C src/cutlass
    python3 - src/megablocks-*/csrc/cumsum.h <<'PY'
import re, sys
for path in sys.argv[1:]:
    src = open(path).read()
    fixed = re.sub(r",\s*debug_synchronous\)", ")", src)
    fixed = re.sub(r",\s*bool debug_synchronous = false\)", ")", fixed)
    open(path, "w").write(fixed)
    print(f"patched {path}: {src.count('debug_synchronous')} -> {fixed.count('debug_synchronous')} mentions")
PY
    echo "== building stanford_stk"; pip_wheel -w "$wheels" src/stanford_stk-*/ || fail "stanford_stk"
    echo "== building megablocks"; pip_wheel -w "$wheels" src/megablocks-*/ || fail "megablocks"
    echo "== building grouped_gemm (cuBLAS)"
    GROUPED_GEMM_CUTLASS=0 pip_wheel -w "$wheels"/gg-cublas src/cublas/grouped_gemm-*/ || fail "grouped_gemm cublas"
    echo "== building grouped_gemm (CUTLASS, GROUPED_GEMM_CUTLASS=1)"
    GROUPED_GEMM_CUTLASS=1 pip_wheel -w "$wheels"/gg-cutlass src/cutlass/grouped_gemm-*/ || fail "grouped_gemm cutlass"
  fi
  pip_install "$wheels"/stanford_stk-*.whl "$wheels"/megablocks-*.whl || fail "installing stk and megablocks"
  for mode in cublas cutlass; do
    rm -rf "${prefix:?}/gg-$mode"
    pip_install --target "$prefix/gg-$mode" "$wheels"/gg-$mode/grouped_gemm-*.whl || fail "installing grouped_gemm $mode"
  done
fi
echo "build_baselines: done in $((SECONDS - start)) s"

cd "$repo"
python3 - <<'PY'
for name in ("stk", "megablocks", "deepspeed", "tutel"):
    try:
        mod = __import__(name)
        print(f"import {name}: ok ({getattr(mod, '__version__', '?')})")
    except Exception as err:  # report every baseline's state, never hide a failure
        print(f"import {name}: FAILED: {type(err).__name__}: {err}")
PY
if [[ " $baselines " == *" megablocks "* ]]; then
  for mode in cublas cutlass; do       # each build in a process of its own: which kernels does it run?
    python3 - "$prefix" "$mode" <<'PY' || fail "grouped_gemm $mode does not import or run"
import sys
import torch
from occult.harness.baselines.megablocks import grouped_gemm_mode, use_grouped_gemm_build
prefix, mode = sys.argv[1:]
use_grouped_gemm_build(prefix, mode)
import grouped_gemm  # noqa: F401
if not torch.cuda.is_available():
    print(f"grouped_gemm {mode}: imported (no GPU to probe its kernels)")
    sys.exit(0)
found, where = grouped_gemm_mode(torch.device("cuda"))
print(f"grouped_gemm {mode}: {where} runs the {found} kernels")
sys.exit(0 if found == mode else 1)
PY
  done
fi
exit $failed
