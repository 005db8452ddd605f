#!/usr/bin/env bash
# One device session (2 or more GPUs) for issues 3, 4, 5 and 8, run detached and polled by back-to-back calls
# (docs/deploy.md, "A device session"):
#   gpu_session.sh start          copy this checkout (with .carry/ and .thirdparty/) to /tmp/occ and
#                                 start the runner with setsid; later calls need carry nothing
#   gpu_session.sh poll SECONDS   wait up to SECONDS (or until the runner is done), print progress,
#                                 and put everything measured so far into $OUT/session.tgz
#   gpu_session.sh run            the runner itself, against one deadline (SESSION_BUDGET_S, 1440 s
#                                 after it starts), stages SESSION_STAGES in the order given
#                                 (default "A Q D1"):
#     A.  GPUs 0 and 1, for at most SESSION_A_S (600): the bf16 GPU tests, the EP runtime's benchmark
#         (gpu_ep_bench.sh), the D=2 training sweep with every baseline, and a D=2 prefill sweep
#         of Occult, MegaBlocks and Tutel on the Qwen and DeepSeek shapes. Baselines build on the
#         CPU meanwhile (build_baselines.sh with the cached wheels, Tutel from its carried source).
#         SESSION_PROFILES (default 16384; empty: none): tokens/GPU of the torch.profiler runs.
#     Q.  all GPUs, for at most SESSION_Q_S: the quality study (gpu_quality.sh pretrain, variants,
#         evaluate with QUALITY_GPUS = the GPUs present), leaving SESSION_D1_S (0) seconds for D1.
#     D1. GPU 0: the D=1 sweeps SESSION_D1_KINDS (default "train decode"), then the kernel config
#         sweep (gpu_tune.sh) unless SESSION_TUNE=0.
#     K.  GPU 0: the bf16 GPU tests of the kernels and the EP layer while the baselines build, then
#         the kernel benchmark with power telemetry (gpu_kernels.sh), for at most SESSION_K_S (420).
#     B.  instead of Q and D1: the quality study on GPU 0 beside D1 on GPU 1 (its torchrun on
#         another port).
#     P.  all GPUs, for at most SESSION_P_S (420): the quality study's data-parallel pre-training.
#     L.  on 4 GPUs: stage A on GPUs 0,1 beside the quality study's remaining phases on GPUs 2,3.
#     DN. all N GPUs, for at most SESSION_DN_S (480): the prefill (SESSION_DN_SIZES, default 2^10,
#         2^12, 2^14, 2^16 tokens per GPU) and training sweeps at D = N with every baseline, then the
#         all-to-all and grouped-GEMM curves at D = N (occult.harness.commbench) with the time left (issue 8).
# Carried inputs: .carry/quality (pack_quality.sh), .carry/trace/routing_heldout.npz,
# .thirdparty/sdist (MegaBlocks, stk, grouped_gemm sdists, tutel-*.tar.gz), .thirdparty/wheels.
set -uo pipefail
. "$(dirname "$0")/common.sh"
ROOT=/tmp/occ; S=/tmp/occ-session; R=$S/out
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

stamp() { echo "[$(date -u +%T) +$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( $1 - $(date +%s) )); }
deadline() { local at=$(( $(date +%s) + $1 )); echo $(( at < $2 ? at : $2 )); }   # now + $1, at most $2

case "${1:?usage: gpu_session.sh start|poll SECONDS|run}" in
start)
    [ -e "$S/started" ] && { echo "already started"; exit 0; }
    mkdir -p "$R" && rm -rf "$ROOT" && cp -a "$PWD" "$ROOT" && date +%s > "$S/started"
    cd "$ROOT" && setsid nohup bash workflow/scripts/gpu_session.sh run > "$S/runner.log" 2>&1 < /dev/null &
    echo "runner started in $ROOT" ;;
poll)
    # a machine released between calls (more than its idle time passed) comes back bare: say so at
    # once instead of waiting the whole poll for a runner that is not there
    [ -e "$S/started" ] || { echo "no session on this machine: it was released and a fresh one answered"; exit 4; }
    end=$(( $(date +%s) + ${2:-540} ))
    while [ ! -e "$R/done" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    [ -e "$R/done" ] && echo "runner: done" || echo "runner: still running"
    cp "$S/runner.log" "$R/runner.log" 2>/dev/null
    tar -C "$R" --exclude=wheels -czf "$OUT/session.tgz" . && tail -40 "$S/runner.log"
    # the baselines' wheels once (WHEEL_CACHE for a later session on the same image)
    [ -e "$R/done" ] && [ "${POLL_WHEELS:-0}" = 1 ] && cp "$R"/wheels/*.whl "$OUT/" 2>/dev/null
    newest=$(ls -t "$R"/quality/*.log 2>/dev/null | head -1)     # the quality study's own progress
    [ -n "$newest" ] && { echo "-- $newest"; tr '\r' '\n' < "$newest" | grep -v '^\s*$' | tail -4; } ;;
run)
    T0=$(date +%s); END=$(( T0 + ${SESSION_BUDGET_S:-1440} ))
    export OCCULT_COMMIT=${OCCULT_COMMIT:-$(cat .carry/quality/COMMIT 2>/dev/null || echo unknown)}
    machine_facts > "$R/machine.txt" 2>&1
    python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/install.log" 2>&1 || tail -5 "$R/install.log"
    here=workflow/scripts; trace=$ROOT/.carry/trace/routing_heldout.npz; sdist=$ROOT/.thirdparty/sdist
    build=""     # the baselines build on the CPU while the GPUs work, for the stages that run them
    case " ${SESSION_STAGES:-A Q D1} " in *" A "*|*" D1 "*|*" B "*|*" DN "*|*" L "*) ;; *) build=skip ;; esac
    [ "$build" = skip ] || ( WHEEL_CACHE=$ROOT/.thirdparty/wheels bash $here/build_baselines.sh "$sdist" /tmp/occult-baselines
      mkdir -p /tmp/occult-tutel && tar xzf "$sdist"/tutel-*.tar.gz -C /tmp/occult-tutel
      ( cd /tmp/occult-tutel/*/ && python3 -m pip install -q --no-deps --no-build-isolation --no-index . ) \
        && python3 -c 'import tutel; print("import tutel: ok")' || echo "tutel: FAILED to install"
      mkdir -p "$R/wheels" && cp /tmp/occult-baselines/wheels/*.whl "$R/wheels/" 2>/dev/null ) > "$R/build.log" 2>&1 &
    [ "$build" = skip ] || build=$!
    stage_A() {     # EP benchmark and baselines on all GPUs, until the deadline $1
        local until=$1 group
        stamp "A: GPU tests"
        timeout 300 python3 -m pytest tests/kernels tests/ep -m gpu -q -p no:cacheprovider > "$R/gpu_tests.log" 2>&1
        tail -2 "$R/gpu_tests.log"
        wait $build 2>/dev/null; tail -3 "$R/build.log"
        stamp "A: EP runtime benchmark"
        timeout "$(left $until)" env EP_BENCH_AB=0 EP_BENCH_PROFILES="${SESSION_PROFILES-16384}" bash $here/gpu_ep_bench.sh "$R/ep" "$trace"
        if [ "$(left $until)" -gt 60 ]; then
            stamp "A: D=2 training sweep"
            timeout "$(left $until)" env SWEEP_DS=2 bash $here/gpu_sweeps.sh "$R/sweeps" train
        fi
        mkdir -p "$R/sweeps/parts"
        for group in "occult occult-graph naive megablocks" "tutel"; do
            [ "$(left $until)" -gt 30 ] || break
            stamp "A: D=2 prefill, Qwen and DeepSeek: $group"
            local part="$R/sweeps/parts/prefill_qwen_deepseek_D2_${group%% *}.csv"
            timeout "$(left $until)" torchrun --nproc_per_node=2 -m occult.harness.sweep --kind prefill --shapes qwen deepseek \
                --methods $group --sizes 1024 4096 16384 --repeats 20 --warmup 5 --timeout-s 120 --out "$part" 2>&1 \
                | tee "$part.log" | grep -v "^W1\|^\*\*\*\|it/s\]\|point/s\]" | tail -12
        done
        # a command stopped by the deadline can leave ranks behind, holding a GPU and port 29500
        # (the pattern matches each torchrun's own command line too, and never the quality lane's)
        pkill -f "occult.harness.sweep|occult.harness.ep_profile" 2>/dev/null; sleep 2
    }
    quality() {     # gpu_quality.sh's three phases until the deadline $1, on QUALITY_GPUS GPUs
        local until=$1 phase
        for phase in ${QUALITY_PHASES:-pretrain variants evaluate}; do
            [ "$(left $until)" -gt 30 ] || { echo "quality: no time left for $phase"; return 3; }
            WORK_ROOT=/tmp/quality-work OUT=$R/quality PHASE_LIMIT_S=$(left $until) \
                bash $here/gpu_quality.sh $phase > /dev/null 2>&1 || { echo "quality $phase: exit $?"; return 3; }
            echo "quality $phase: done at +$(( $(date +%s) - T0 ))s"
        done
    }
    d1_lane() {     # D=1 sweeps, then the config sweep, until the deadline $1 (on the visible GPU)
        local until=$1
        wait $build 2>/dev/null
        timeout "$(left $until)" env SWEEP_DS=1 bash $here/gpu_sweeps.sh "$R/sweeps" ${SESSION_D1_KINDS:-train decode} \
            > "$R/sweeps_D1.log" 2>&1
        [ "${SESSION_TUNE:-1}" = 1 ] && [ "$(left $until)" -gt 120 ] && TUNE_LIMIT_S=$(( $(left $until) - 100 )) \
            timeout "$(left $until)" bash $here/gpu_tune.sh "$R/tune" > "$R/tune_run.log" 2>&1
        echo "D=1 lane: done at +$(( $(date +%s) - T0 ))s"
    }
    dn_stage() {    # the sweeps at D = every GPU, then the communication curves, until the deadline $1
        local until=$1 D=$gpus
        wait $build 2>/dev/null; tail -3 "$R/build.log"
        timeout "$(left $until)" env SWEEP_DS=$D SWEEP_PREFILL_SIZES="${SESSION_DN_SIZES:-1024 4096 16384 65536}" \
            SWEEP_GROUP_S=300 bash $here/gpu_sweeps.sh "$R/sweeps_D$D" prefill train > "$R/sweeps_D$D.log" 2>&1
        grep "^== " "$R/sweeps_D$D.log"
        if [ "$(left $until)" -gt 60 ]; then
            stamp "DN: all-to-all and grouped-GEMM curves at D=$D"
            timeout "$(left $until)" torchrun --nproc_per_node="$D" -m occult.harness.commbench --out "$R/comm_D$D" \
                > "$R/comm_D$D.log" 2>&1 || echo "commbench: exit $?"
        fi
        pkill -f "occult.harness.sweep|occult.harness.commbench" 2>/dev/null; sleep 2
    }
    kernel_stage() {     # bf16 GPU tests (beside the build), then the kernel bench, until the deadline $1
        local until=$1
        mkdir -p "$R/kernels"
        CUDA_VISIBLE_DEVICES=0 timeout "$(left $until)" python3 -m pytest tests/kernels tests/ep -m gpu -q \
            -p no:cacheprovider > "$R/kernels/gpu_tests.log" 2>&1
        tail -3 "$R/kernels/gpu_tests.log"
        wait $build 2>/dev/null; tail -3 "$R/build.log"
        [ "$(left $until)" -gt 60 ] && CUDA_VISIBLE_DEVICES=0 timeout "$(left $until)" env GPU_TESTS=none \
            bash $here/gpu_kernels.sh "$R/kernels" > "$R/kernels_bench.log" 2>&1
        tail -4 "$R/kernels_bench.log"
    }
    gpus=$(visible_gpus)
    for stage in ${SESSION_STAGES:-A Q D1}; do
        [ "$(left $END)" -gt 60 ] || { stamp "no time left for stage $stage"; break; }
        case "$stage" in
            A) stamp "A: on GPUs 0,1 (D=2)"     # issue 3's and 4's D=2 numbers, also on a bigger machine
               CUDA_VISIBLE_DEVICES=0,1 stage_A "$(deadline "${SESSION_A_S:-600}" $END)" ;;
            Q) stamp "Q: quality on all $gpus GPUs"
               QUALITY_GPUS=$gpus quality "$(deadline "${SESSION_Q_S:-100000}" $(( END - ${SESSION_D1_S:-0} )))" ;;
            K) stamp "K: GPU tests, then the kernel benchmark on GPU 0"
               kernel_stage "$(deadline "${SESSION_K_S:-420}" $END)" ;;
            D1) stamp "D1: D=1 sweeps and the kernel config sweep on GPU 0"
                CUDA_VISIBLE_DEVICES=0 d1_lane $END ;;
            DN) stamp "DN: sweeps at D=$gpus"
                dn_stage "$(deadline "${SESSION_DN_S:-480}" $END)" ;;
            P) stamp "P: quality pre-training, data parallel on all $gpus GPUs"
               QUALITY_PHASES=pretrain QUALITY_GPUS=$gpus quality "$(deadline "${SESSION_P_S:-420}" $END)" ;;
            L) stamp "L: stage A on GPUs 0,1 beside the rest of the quality study on GPUs 2,3"
               CUDA_VISIBLE_DEVICES=0,1 stage_A "$(deadline "${SESSION_A_S:-600}" $END)" &
               CUDA_VISIBLE_DEVICES=2,3 QUALITY_GPUS=2 PET_MASTER_PORT=29611 quality $END &
               wait ;;
            B) stamp "B: quality on GPU 0; D=1 sweeps and the kernel config sweep on GPU 1"
               CUDA_VISIBLE_DEVICES=0 QUALITY_GPUS=1 quality $END &
               CUDA_VISIBLE_DEVICES=1 PET_MASTER_PORT=29611 d1_lane $END &
               wait ;;
            *) stamp "unknown stage $stage (A K Q D1 B DN P L)" ;;
        esac
    done
    stamp "runner done"; touch "$R/done" ;;
esac
