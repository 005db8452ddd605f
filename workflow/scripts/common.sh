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
