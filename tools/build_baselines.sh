#!/usr/bin/env bash
# Build MegaBlocks on a CUDA machine from its PyPI sdists (never committed here):
#   stanford-stk 0.7.1, grouped_gemm 0.3.0, megablocks 0.10.0 (`pip download --no-deps --no-binary
#   :all:` them into SDIST_DIR). Tutel is not on PyPI: install it from its own repository as its
#   README says; our adapter uses it whenever `import tutel` works.
# Also DeepSpeed 0.19.8 (pure Python; its C++/CUDA ops are left to its JIT, DS_BUILD_OPS=0): its sdist
#   plus wheels of the requirements the CUDA image lacks, for that image's python (3.12), in SDIST_DIR:
#   `pip download --no-deps deepspeed==0.19.8` and `pip download hjson pydantic --python-version 3.12
#   --platform manylinux2014_x86_64 --only-binary=:all:` (pydantic, pydantic-core, annotated-types,
#   typing-inspection, typing-extensions, hjson).
# Usage: [BASELINES="megablocks deepspeed"] build_baselines.sh SDIST_DIR [BUILD_DIR]
# Wheels: the built wheels are left in $BUILD_DIR/wheels. If WHEEL_CACHE names a folder holding
# wheels of all three (built earlier by this script on the same image), they are installed instead
# of building (≈5 s instead of ≈200 s).
# Needs: the machine's CUDA torch, nvcc, ninja. Installs into the running python3's site-packages.
# One compatibility edit is applied: MegaBlocks' csrc/cumsum.h passes CUB's removed
# `debug_synchronous` argument to DeviceScan::{Exclusive,Inclusive}Sum; it is dropped.
set -euo pipefail
sdist=$(realpath "$1")
build=${2:-/tmp/occult-baselines}
# a relative WHEEL_CACHE is taken from where the script was started, not from the build folder
cache=${WHEEL_CACHE:-}
if [ -n "$cache" ] && [ -d "$cache" ]; then cache=$(realpath "$cache"); fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
mkdir -p "$build"
cd "$build"
pip_install() { python3 -m pip install -q --no-deps --no-build-isolation --no-index "$@"; }
baselines=${BASELINES:-megablocks deepspeed}
start=$SECONDS

if [[ " $baselines " == *" deepspeed "* ]]; then
  if ls "$sdist"/deepspeed-*.tar.gz >/dev/null 2>&1; then
    echo "== installing deepspeed"
    ( pip_install "$sdist"/*.whl && DS_BUILD_OPS=0 pip_install "$sdist"/deepspeed-*.tar.gz ) \
      || echo "build_baselines: FAILED to install deepspeed" >&2
  else
    echo "build_baselines: no deepspeed sdist in $sdist" >&2
  fi
fi
if [[ " $baselines " != *" megablocks "* ]]; then
  python3 -c "import deepspeed; print('import deepspeed: ok', deepspeed.__version__)" \
    || echo "import deepspeed: FAILED"
  echo "build_baselines: done in $((SECONDS - start)) s"
  exit 0
fi

for archive in "$sdist"/stanford_stk-*.tar.gz "$sdist"/grouped_gemm-*.tar.gz "$sdist"/megablocks-*.tar.gz; do
  [ -e "$archive" ] || { echo "build_baselines: missing $archive" >&2; continue; }
  tar xzf "$archive"
done

python3 - <<'PY'
import glob, re
for path in glob.glob("megablocks-*/csrc/cumsum.h"):
    src = open(path).read()
    fixed = re.sub(r",\s*debug_synchronous\)", ")", src)
    fixed = re.sub(r",\s*bool debug_synchronous = false\)", ")", fixed)
    open(path, "w").write(fixed)
    print(f"patched {path}: {src.count('debug_synchronous')} -> {fixed.count('debug_synchronous')} mentions")
PY

if [ -n "$cache" ] && ls "$cache"/stanford_stk-*.whl "$cache"/grouped_gemm-*.whl "$cache"/megablocks-*.whl >/dev/null 2>&1; then
  echo "== installing cached wheels from $cache"
  pip_install "$cache"/stanford_stk-*.whl "$cache"/grouped_gemm-*.whl "$cache"/megablocks-*.whl \
    || echo "build_baselines: FAILED to install cached wheels" >&2
else
  mkdir -p wheels
  for pkg in stanford_stk-* grouped_gemm-* megablocks-* ; do
    [ -d "$pkg" ] || continue
    echo "== building $pkg"
    ( python3 -m pip wheel -q --no-deps --no-build-isolation --no-index -w wheels "./$pkg" \
      && pip_install wheels/"${pkg%%-*}"-*.whl ) || echo "build_baselines: FAILED to build $pkg" >&2
  done
fi
echo "build_baselines: done in $((SECONDS - start)) s"
python3 - <<'PY'
for name in ("stk", "grouped_gemm", "megablocks", "deepspeed"):
    try:
        mod = __import__(name)
        print(f"import {name}: ok ({getattr(mod, '__version__', '?')})")
    except Exception as err:  # report every baseline's state, never hide a failure
        print(f"import {name}: FAILED: {type(err).__name__}: {err}")
PY
