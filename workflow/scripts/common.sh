# Shared by the GPU scripts (source it): the GPUs this process may use.
# nvidia-smi lists every GPU of the host and ignores CUDA_VISIBLE_DEVICES, so a script confined to
# some of them (a lane of gpu_session.sh) counts its own list instead.
visible_gpus() {
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .
    else
        nvidia-smi -L | wc -l
    fi
}

# The machine a result came from, for its folder's machine.txt: GPUs (name, memory, driver, max SM
# clock), topology, the host CPU (eager layers are host-bound, and their time moves with it: see
# docs/performance.md, "v9 against the real baselines at D = 1"), torch/triton and the commit.
machine_facts() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    nvidia-smi topo -m
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//') ($(nproc) cores visible)"
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
    echo "commit: ${OCCULT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
}
