#!/usr/bin/env bash
# Run the quality study on a GPU machine from a pack made by pack_quality.sh, one resumable
# phase per call (each well inside the device tool's 10-minute limit):
#   gpu_quality.sh pretrain   pre-train the mini model (continues an interrupted run)
#   gpu_quality.sh variants   profile, placements, then fine-tune every arm not yet done
#   gpu_quality.sh evaluate   lm-eval every arm not yet scored
#   gpu_quality.sh all        the three in order (machines without a per-call limit; CPU tests)
# A phase that runs out of time exits 3 after saving its progress: call it again.
# Results (JSON/CSV, no checkpoints) are bundled after every phase into $OUT/quality_results.tar.gz
# (plus $OUT/<phase>.log); unpack that into results/<machine>/quality_v1/ on the CPU side.
# env: CARRY (default .carry/quality), OUT (default ./quality-out), PYTHON (default python3),
#      PHASE_LIMIT_S (default 520: seconds per call, setup included), SITE (default /tmp/site),
#      WORK_ROOT (default work: checkpoints and intermediates, never sent back),
#      QUALITY_GPUS (default 1): GPUs to use; with N > 1 pre-training runs data parallel under
#      torchrun and fine-tuning and evaluation run one process per GPU, each on every N-th arm.
#      TRAINBENCH_STEPS (default 10; 0: none), TRAINBENCH_WARMUP (3): occult.harness.trainbench before pre-training,
#      ROUTING_SAMPLE_TOKENS (default 16384): tokens of each routing trace returned in profile/,
#      QUALITY_SHARDS (default QUALITY_GPUS): fine-tuning and evaluation processes, spread round-robin
#      over the GPUs (2 on one GPU overlap one process's host work with the other's kernels).
set -euo pipefail
PHASE=${1:?usage: gpu_quality.sh pretrain|variants|evaluate|all}
CARRY=${CARRY:-.carry/quality}
OUT=${OUT:-$PWD/quality-out}
PY=${PYTHON:-python3}
LIMIT=${PHASE_LIMIT_S:-520}
phase_start=$(date +%s)
SITE=${SITE:-/tmp/site}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export OCCULT_COMMIT=$(cat "$CARRY/COMMIT" 2>/dev/null || echo unknown)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/$PHASE.log") 2>&1
# The code here must be the code packed: otherwise the results name the commit with "-tree-differs".
if [ -f "$CARRY/TREE.sha256" ]; then
    if differs=$(sha256sum --quiet -c "$CARRY/TREE.sha256" 2>&1); then
        echo "code tree: matches $OCCULT_COMMIT"
    else
        export OCCULT_COMMIT="$OCCULT_COMMIT-tree-differs"
        echo "code tree: DIFFERS from the pack's commit (repack with pack_quality.sh); first differences:"
        echo "$differs" | head -5
    fi
else
    export OCCULT_COMMIT="$OCCULT_COMMIT-tree-unchecked"
    echo "code tree: no $CARRY/TREE.sha256 (old pack); results marked tree-unchecked"
fi

# -- setup: wheels (once per machine), the package on the path, the data unpacked
if [ -n "$SITE" ] && ls "$CARRY"/wheels/*.whl >/dev/null 2>&1; then
    wheels=$(cd "$CARRY/wheels" && ls *.whl)
    if [ "$wheels" != "$(cat "$SITE/.occult-wheels" 2>/dev/null)" ]; then     # once per machine and wheel set
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$CARRY"/wheels/*.whl
        echo "$wheels" > "$SITE/.occult-wheels"
    fi
fi
export PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
CONFIG=$CARRY/config.yaml
RUN=$("$PY" -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['run'])" "$CONFIG")
WORK=${WORK_ROOT:-work}/$RUN
RES=$WORK/quality_results
DATA=$WORK/data
mkdir -p "$RES/model" "$RES/profile" "$RES/placement" "$RES/finetune" "$RES/evaluate" "$RES/logs"
if [ ! -f "$DATA/manifest.json" ]; then
    mkdir -p "$DATA" && xz -dc "$CARRY/data.tar.xz" | tar -C "$DATA" -xf -
fi
cp "$CONFIG" "$RES/config.yaml"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
 torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu', 'transformers', transformers.__version__)"

# lm-eval and its carried dependencies must import and load a task on this image: checked in every
# phase (a few seconds), so that a wheel that does not fit shows in the first call, not the last
preflight() {
    "$PY" - "$DATA/eval" <<'PYEOF' || { echo "lm-eval preflight: FAILED (see above); fix the wheels before the evaluate phase"; return 1; }
import sys, tempfile
from pathlib import Path
import datasets, lm_eval
from lm_eval.models.huggingface import HFLM  # noqa: F401
from lm_eval.tasks import TaskManager
from occult.stages.eval_tasks import TASK_NAMES, make_task_dir
task = sorted(p.stem for p in Path(sys.argv[1]).glob("*.jsonl"))[0]
with tempfile.TemporaryDirectory() as tmp:
    manager = TaskManager(include_path=str(make_task_dir(Path(sys.argv[1]), [task], Path(tmp) / "t")), include_defaults=False)
    loaded = manager.load([TASK_NAMES[task]])
    docs = len(list(next(iter(loaded["tasks"].values())).eval_docs))
print(f"lm-eval preflight: ok (lm_eval {lm_eval.__version__ if hasattr(lm_eval, '__version__') else '?'}, "
      f"datasets {datasets.__version__}; {task}: {docs} documents)")
PYEOF
}

remaining() { echo $(( LIMIT - ($(date +%s) - phase_start) )); }
left() { local r; r=$(remaining); [ "$r" -gt 1 ] && echo "$r" || echo 1; }     # `timeout 0` would mean no limit
timing() { "$PY" - "$RES/timings.json" "$1" "$2" <<'PYEOF'
import json, sys, time
from pathlib import Path
path = Path(sys.argv[1]); rows = json.loads(path.read_text()) if path.exists() else []
rows.append({"stage": sys.argv[2], "seconds": float(sys.argv[3]), "at": time.strftime("%Y-%m-%dT%H:%M:%S")})
path.write_text(json.dumps(rows, indent=1) + "\n")
PYEOF
}

bundle() {
    cp "$OUT"/*.log "$RES/logs/" 2>/dev/null || true
    if [ -d "$WORK/model/base" ]; then
        cp "$WORK/model/base/occult_pretrain.json" "$WORK/model/base/config.json" "$RES/model/" 2>/dev/null || true
    fi
    tar -C "$RES" -czf "$OUT/quality_results.tar.gz.tmp" . && mv "$OUT/quality_results.tar.gz.tmp" "$OUT/quality_results.tar.gz"
}
trap bundle EXIT

GPUS=${QUALITY_GPUS:-1}
occult_cli=("$PY" -m occult)      # torchrun's own parser needs the "--" before the stage's flags
[ "$GPUS" -gt 1 ] && occult_cli=("$PY" -m torch.distributed.run --nproc_per_node="$GPUS" -m occult --)

# QUALITY_SHARDS processes (default: one per GPU), shard i on the (i mod GPUS)-th GPU, each on every
# SHARDS-th arm; exit 3 (time limit) wins over 0, any other failure over both. The i-th GPU is that of an
# inherited CUDA_VISIBLE_DEVICES, so a lane confined to GPUs 2,3 stays there. More shards than GPUs put
# several fine-tuning or evaluation processes on one GPU: each arm's result is the same, its timing is shared.
# Each shard gets an equal share of the CPU cores (OMP_NUM_THREADS, unless set). With a thread per core
# each, three shards on one H200 machine took 97 s per checkpoint load against 1.5 s for one process
# alone (results/nvidia-h200/quality_upcycle_v2_partial/logs); on 2 cores, three loads took 36-38 s
# each with 2 threads and 13-14 s with 1 (examples/time_cpu_fixes.py loads).
# Each shard writes to a log file of its own ($RES/logs/<phase function>_shard<i>of<N>.log, bundled with
# the results; `tail -f` it to follow a shard), printed whole, prefixed, once every shard has ended:
# shards sharing one pipe interleaved their progress bars mid-character.
SHARDS=${QUALITY_SHARDS:-$GPUS}
sharded() {
    local pids=() logs=() rc=0 code i device devices log
    local threads=${OMP_NUM_THREADS:-$(( $(nproc) / SHARDS > 0 ? $(nproc) / SHARDS : 1 ))}
    IFS=, read -r -a devices <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((GPUS - 1)))}"
    # processes sharing one GPU: evaluation caps its CUDA allocator at its share (cap_gpu_memory_share)
    local per_gpu=$(( (SHARDS + GPUS - 1) / GPUS ))
    for ((i = 0; i < SHARDS; i++)); do
        if [ "$SHARDS" -gt 1 ]; then
            device=${devices[$(( i % GPUS ))]}
            log="$RES/logs/${FUNCNAME[1]:-sharded}_shard${i}of${SHARDS}.log"
            echo "[gpu $device shard $i] started: $log"
            CUDA_VISIBLE_DEVICES=$device OMP_NUM_THREADS=$threads OCCULT_PROCESSES_PER_GPU=$per_gpu \
                "$@" --shard "$i/$SHARDS" > "$log" 2>&1 &
            logs+=("$device $i $log")
        else
            "$@" &
        fi
        pids+=($!)
    done
    for i in "${pids[@]}"; do
        code=0; wait "$i" || code=$?
        if [ "$code" -ne 0 ] && { [ "$rc" -eq 0 ] || [ "$rc" -eq 3 ]; }; then rc=$code; fi
    done
    for log in "${logs[@]}"; do       # a progress bar's redraws (\r) collapse to its last state
        read -r device i log <<< "$log"
        sed "s/.*\r//; s/^/[gpu $device shard $i] /" "$log"
    done
    return $rc
}

# A shard that fails for another reason than the time limit (exit 3) leaves its arms undone: in
# results/nvidia-h200/quality_upcycle_v3 one of three evaluation processes on one GPU ran out of memory
# beside its neighbours' allocator caches. With time left, one process alone then does what is left
# (each phase skips the arms already done, so nothing runs twice). $1: the phase's function.
retry_alone() {
    local rc=0
    "$1" || rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 3 ] && [ "$SHARDS" -gt 1 ] && [ "$(remaining)" -gt 120 ]; then
        echo "$1: a shard failed (exit $rc); the arms left, in one process"
        rc=0; SHARDS=1 "$1" || rc=$?
    fi
    return $rc
}

run_pretrain() {
    [ -d "$WORK/model/base" ] && { echo "pretrain: done already"; return 0; }
    local t0=$(date +%s) rc=0
    # first, once: the step time under each expert kernel, side by side (and a kernel that fails here
    # fails in seconds, not in the middle of the phase)
    if [ "${TRAINBENCH_STEPS:-10}" -gt 0 ] && [ ! -f "$RES/model/trainbench.csv" ]; then
        timeout 240 "$PY" -m occult.harness.trainbench --config "$CONFIG" --out "$RES/model/trainbench.csv" \
            --steps "${TRAINBENCH_STEPS:-10}" --warmup "${TRAINBENCH_WARMUP:-3}" \
            || { echo "trainbench: FAILED (exit $?); the configured expert kernel may not run here"; return 1; }
        timing trainbench $(( $(date +%s) - t0 )); t0=$(date +%s)
    fi
    timeout --signal=TERM --kill-after=30 "$(left)" "${occult_cli[@]}" pretrain --config "$CONFIG" \
        --data "$DATA" --out "$WORK/model/base" --log "$RES/model/pretrain_log.csv" \
        --structure "$RES/model/router_structure.json" --step-trace "$RES/model/pretrain_steptrace.json" || rc=$?
    timing pretrain $(( $(date +%s) - t0 ))
    [ -d "$WORK/model/base" ] && return 0
    echo "pretrain: paused (exit $rc); state in $WORK/model/base.resume; run this phase again"; return 3
}

run_variants() {
    local t0=$(date +%s)
    if [ ! -f "$RES/profile/profile.json" ]; then
        "$PY" -m occult profile --config "$CONFIG" --model "$WORK/model/base" --data "$DATA" --out "$WORK/profile"
        # what the placement stage reads, small enough to come back: the co-activation statistics
        # and the first ROUTING_SAMPLE_TOKENS tokens of each routing trace (a real trace for the EP
        # benchmark, the placement study and the simulator on a CPU machine)
        cp "$WORK/profile/profile.npz" "$RES/profile/profile.npz"
        for split in calibration heldout; do
            "$PY" -c 'import sys; from occult.routing.profiling import sample_routing; sample_routing(sys.argv[1], sys.argv[2], int(sys.argv[3]))' \
                "$WORK/profile/routing_$split.npz" "$RES/profile/routing_${split}_sample.npz" "${ROUTING_SAMPLE_TOKENS:-16384}"
        done
        cp "$WORK/profile/profile.json" "$RES/profile/profile.json"
        timing profile $(( $(date +%s) - t0 )); t0=$(date +%s)
    fi
    if [ ! -f "$RES/placement/expected_ct.csv" ]; then
        "$PY" -m occult place --config "$CONFIG" --profile "$WORK/profile" --out "$RES/placement" \
            --table "$RES/placement/expected_ct.csv"
        timing place $(( $(date +%s) - t0 )); t0=$(date +%s)
    fi
    local rc=0
    retry_alone finetune_arms || rc=$?
    timing finetune $(( $(date +%s) - t0 ))
    return $rc
}
finetune_arms() {
    local trace=()      # profile steps once: not again in a resumed call or in retry_alone's process
    [ -f "$RES/finetune/steptrace.json" ] || trace=(--step-trace "$RES/finetune/steptrace.json")
    sharded timeout --kill-after=30 "$(left)" "$PY" -m occult.stages.finetune --config "$CONFIG" --model "$WORK/model/base" \
        --data "$DATA" --profile "$WORK/profile" --placements "$RES/placement" --out "$WORK/finetune" \
        --logs "$RES/finetune" "${trace[@]}" --time-limit $(( $(remaining) - 60 ))
}

run_evaluate() {
    local t0=$(date +%s) rc=0
    retry_alone evaluate_arms || rc=$?
    timing evaluate $(( $(date +%s) - t0 ))
    return $rc
}
evaluate_arms() {
    sharded timeout --kill-after=30 "$(left)" "$PY" -m occult.stages.evaluate --config "$CONFIG" --model "$WORK/model/base" \
        --arms "$WORK/finetune" --data "$DATA" --profile "$WORK/profile" --placements "$RES/placement" \
        --out "$RES/evaluate" --time-limit $(( $(remaining) - 90 )) ${EVAL_LIMIT:+--limit $EVAL_LIMIT}
}

case "$PHASE" in
    pretrain) preflight || true; run_pretrain ;;
    variants) preflight || true; run_variants ;;
    evaluate) preflight && run_evaluate ;;
    all) LIMIT=$(( LIMIT * 3 )); run_pretrain && run_variants && run_evaluate ;;
    *) echo "unknown phase $PHASE (pretrain|variants|evaluate|all)" >&2; exit 2 ;;
esac
