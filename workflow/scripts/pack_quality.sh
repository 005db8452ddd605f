#!/usr/bin/env bash
# Pack, on a CPU machine, everything the GPU quality study needs into one ignored folder
# (default .carry/quality/), to travel as a `carry` path of the device tool (64 MiB per call
# together with the repository). Contents:
#   config.yaml       the resolved configuration (the default with the preset on top), validated
#   data.tar.xz       the data stage's output: corpus, tokenizer, instruction pairs, eval sets
#   wheels/           lm-eval and the packages it needs that the GPU image lacks (Python 3.12)
#   COMMIT            the commit the results will be attributed to
#   TREE.sha256       sha256 of every tracked file at that commit (checked where the study runs)
#   manifest.json     sizes, versions, token counts
# Usage: workflow/scripts/pack_quality.sh [PRESET] [DEST]
#   PRESET  default config/presets/mini.yaml; DEST default .carry/quality
#   env: PYTHON (default .venv/bin/python), WHEELS=0 to skip the wheels (tests),
#        PACK_LIMIT_MIB (default 55: the carry plus the repository must stay under 64 MiB),
#        WORK_ROOT (default work: where the data stage writes),
#        MAX_EPOCHS (default 6: refuse a corpus that pre-training would repeat more often),
#        PACK_SEED (default: the preset's seed): another seed for the whole recipe (data order,
#        pre-training, fine-tuning), run "<run>-seed<N>": a second base model of the same recipe
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PRESET=${1:-config/presets/mini.yaml}
DEST=${2:-.carry/quality}
PY=${PYTHON:-.venv/bin/python}
LIMIT_MIB=${PACK_LIMIT_MIB:-55}
WHEEL_PACKAGES="lm_eval datasets dill multiprocess jsonschema jsonschema-specifications referencing rpds-py"

mkdir -p "$DEST"

echo "== resolved config ($PRESET over config/config.yaml)" >&2
"$PY" - "$PRESET" "$DEST/config.yaml" "${PACK_SEED:-}" <<'PYEOF'
import sys
from pathlib import Path
import yaml
from occult.config import load_config, merge
preset, dest, seed = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
raw = merge(yaml.safe_load(Path("config/config.yaml").read_text()), yaml.safe_load(Path(preset).read_text()) or {})
if seed:
    if not seed.isdigit():
        sys.exit(f"pack_quality: PACK_SEED={seed!r}: expected a whole number >= 0")
    raw["seed"], raw["run"] = int(seed), f"{raw['run']}-seed{int(seed)}"
cfg = load_config(raw)                       # validates; one clear error otherwise
text = yaml.safe_dump(cfg.raw, sort_keys=False)
if not dest.exists() or dest.read_text() != text:
    dest.write_text(text)
print(f"run {cfg.run}, config hash {cfg.hash()}", file=sys.stderr)
PYEOF
RUN=$("$PY" -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['run'])" "$DEST/config.yaml")

DATA=${WORK_ROOT:-work}/$RUN/data
echo "== data stage ($DATA)" >&2
if [ ! -f "$DATA/manifest.json" ] || [ "$DEST/config.yaml" -nt "$DATA/manifest.json" ]; then
    "$PY" -m occult data --config "$DEST/config.yaml" --out "$DATA"
fi
if [ ! -f "$DEST/data.tar.xz" ] || [ "$DATA/manifest.json" -nt "$DEST/data.tar.xz" ]; then
    tar -C "$DATA" -cf - manifest.json corpus tokenizer instructions.jsonl eval | xz -T0 -6 > "$DEST/data.tar.xz.tmp"
    mv "$DEST/data.tar.xz.tmp" "$DEST/data.tar.xz"
fi

"$PY" - "$DEST/config.yaml" "$DATA/manifest.json" "${MAX_EPOCHS:-6}" <<'PYEOF'
import json, sys
import yaml
cfg, manifest, max_epochs = yaml.safe_load(open(sys.argv[1])), json.load(open(sys.argv[2])), float(sys.argv[3])
seen = cfg["pretrain"]["steps"] * cfg["pretrain"]["batch_size"] * cfg["pretrain"]["seq_len"]
train = manifest["totals"]["tokens"]["train"]
print(f"pre-training sees {seen:,} tokens = {seen / train:.1f} epochs of {train:,}", file=sys.stderr)
if seen > max_epochs * train:
    sys.exit(f"pack_quality: data.sources {cfg['data']['sources']} give {train:,} train tokens; pre-training would "
             f"repeat them {seen / train:.0f} times (MAX_EPOCHS={max_epochs:g}). Add a source (docs/quality.md) "
             "or shorten pretrain.steps")
PYEOF

if [ "${WHEELS:-1}" != 0 ]; then
    echo "== wheels for Python 3.12 (versions as installed here)" >&2
    mkdir -p "$DEST/wheels"
    for name in $WHEEL_PACKAGES; do
        version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
        stem=$(echo "$name" | tr '-' '_')
        if ! ls "$DEST/wheels/" 2>/dev/null | grep -qi "^${stem}-${version}-"; then
            "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
                -d "$DEST/wheels" "$name==$version"
        fi
    done
fi

git rev-parse --short=12 HEAD 2>/dev/null | tr -d '\n' > "$DEST/COMMIT" || echo unknown > "$DEST/COMMIT"
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || echo -n "-dirty" >> "$DEST/COMMIT"
# The tracked files as they are now: gpu_quality.sh checks the copy it runs on against this list,
# so results are never attributed to COMMIT when the code that made them differs.
git ls-files -z | xargs -0 sha256sum > "$DEST/TREE.sha256.tmp" && mv "$DEST/TREE.sha256.tmp" "$DEST/TREE.sha256"

carry_bytes=$(du -sb "$DEST" | cut -f1)
repo_bytes=$(git ls-files -z | "$PY" -c "import os, sys
print(sum(os.path.getsize(f) for f in sys.stdin.read().split('\0') if f and os.path.isfile(f)))")
"$PY" - "$DEST" "$carry_bytes" "$repo_bytes" "$LIMIT_MIB" "$DATA" <<'PYEOF'
import json, sys
from pathlib import Path
dest, carry, repo, limit = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
data = json.loads((Path(sys.argv[5]) / "manifest.json").read_text())
files = {str(p.relative_to(dest)): p.stat().st_size for p in sorted(dest.rglob("*")) if p.is_file() and p.name != "manifest.json"}
report = {"carry_bytes": carry, "repo_bytes": repo, "limit_mib": limit, "files": files,
          "tokens": data["totals"]["tokens"], "commit": (dest / "COMMIT").read_text()}
(dest / "manifest.json").write_text(json.dumps(report, indent=2) + "\n")
mib = 1 << 20
print(f"carry {carry / mib:.1f} MiB + repository {repo / mib:.1f} MiB = {(carry + repo) / mib:.1f} MiB "
      f"(limit {limit} MiB for the carry); train tokens {data['totals']['tokens']['train']:,}", file=sys.stderr)
if carry > limit * mib:
    sys.exit(f"pack_quality: {dest} is {carry / mib:.1f} MiB, over PACK_LIMIT_MIB={limit}")
PYEOF
echo "$DEST"
