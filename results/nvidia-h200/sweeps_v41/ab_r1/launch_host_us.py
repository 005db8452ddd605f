"""Session 25 diagnostic: where a Triton launch's host time goes, and what a direct launch of the
cached CompiledKernel costs, for the SwiGLU forward kernel at DeepSeek's batch-1 training shape."""
import statistics, time, sys
import torch, triton
from triton.runtime import driver
import triton.runtime.jit as jit
import importlib; gs = importlib.import_module("occult.kernels.grouped_swiglu")
print("torch", torch.__version__, "triton", triton.__version__, flush=True)
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
T, E, k, D, F = 512, 64, 6, 2048, 1408
x = torch.randn(T, D, device=dev, generator=g).bfloat16()
ids = torch.rand(T, E, device=dev, generator=g).topk(k, dim=1).indices
w = (torch.randn(E, 2 * F, D, device=dev, generator=g) * D ** -0.5).bfloat16()
flat = ids.reshape(-1); order = torch.argsort(flat, stable=True)
pair_row = (order // k).to(torch.int32)
offsets = torch.zeros(E + 1, dtype=torch.int32, device=dev); offsets[1:] = torch.bincount(flat, minlength=E).cumsum(0)
M = pair_row.numel()
h = torch.empty(M, F, dtype=torch.bfloat16, device=dev); pre = h
args = (x, pair_row, offsets, w, h, pre, M, D, F, E, *x.stride(), *w.stride(), *h.stride(), *pre.stride())
meta = dict(gs.SMALL_GEMM_META)
consts = dict(SAVE_PREACT=False, TMA=False, EVEN_K=True, PRECISION="ieee" if False else gs.dot_precision(torch.bfloat16),
              GROUP_SIZE=gs.GROUP_M, EXPERTS_P2=64)
# the kernel may need X_TMA etc defaults; use the launcher's own path once to learn its meta
gs.grouped_swiglu_forward(x, pair_row, offsets, w, False)
print("last meta", gs.LAST_LAUNCH_META, flush=True)
kern = gs._swiglu_fwd_kernel
grid = (gs.gemm_programs(gs.m_tile_bound(M, E, meta["BLOCK_M"]) * gs.cdiv(F, meta["BLOCK_N"]), meta, dev),)
ck = kern[grid](*args, **consts, **meta)
torch.cuda.synchronize()
ref = h.clone()

def per_call(fn, n=300):
    ts = []
    for i in range(n):
        if i % 50 == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter(); fn(); ts.append(1e6 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    return statistics.median(ts)

res = {}
res["jit kernel[grid](...)"] = per_call(lambda: kern[grid](*args, **consts, **meta))
res["launcher grouped_swiglu_forward"] = per_call(lambda: gs.grouped_swiglu_forward(x, pair_row, offsets, w, False))
device = driver.active.get_current_device()
kernel_cache, kernel_key_cache, target, backend, binder = kern.device_caches[device]
res["get_current_device"] = per_call(lambda: driver.active.get_current_device())
res["get_current_stream"] = per_call(lambda: driver.active.get_current_stream(device))
res["binder"] = per_call(lambda: binder(*args, **consts, **meta))
bound, spec, opts = binder(*args, **consts, **meta)
res["compute_cache_key"] = per_call(lambda: jit.compute_cache_key(kernel_key_cache, spec, opts))
stream = driver.active.get_current_stream(device)
res["launch_metadata"] = per_call(lambda: ck.launch_metadata(grid, stream, *bound.values()))
vals = tuple(bound.values())
run = ck.run
def direct():
    run(grid[0], 1, 1, stream, ck.function, ck.packed_metadata, None, None, None, *vals)
res["direct CompiledKernel.run"] = per_call(direct)
h.zero_(); direct(); torch.cuda.synchronize()
print("direct == jit output:", torch.equal(h, ref), flush=True)
def direct_full():
    s = torch.cuda.current_stream().cuda_stream
    run(grid[0], 1, 1, s, ck.function, ck.packed_metadata, None, None, None, *args, *[None] * 0)
try:
    # positional non-constexpr args only (constexprs dropped): does the launcher accept it?
    h.zero_(); direct_full(); torch.cuda.synchronize(); print("args-only run ok, equal:", torch.equal(h, ref))
    res["direct, args only + torch stream"] = per_call(direct_full)
except Exception as e:
    print("args-only run failed:", type(e).__name__, str(e)[:200])
try:
    from torch._inductor.runtime.static_cuda_launcher import StaticallyLaunchedCudaKernel
    print("torch static launcher available")
except Exception as e:
    print("no torch static launcher:", e)
print(f"{'what':>40} {'host us/call':>12}")
for name, us in res.items():
    print(f"{name:>40} {us:12.1f}")
