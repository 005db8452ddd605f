"""cProfile of the one-device eager forward's host work (session 15 diagnostic): tottime per function."""
import cProfile, pstats, sys, io, torch
from occult.ep import layer
tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
dev = torch.device("cuda"); g = torch.Generator(device=dev).manual_seed(0)
E, k, D, F = 64, 8, 2048, 1024
x = torch.randn(tokens, D, device=dev, generator=g).bfloat16()
ids = torch.rand(tokens, E, device=dev, generator=g).topk(k, dim=1).indices
w = torch.rand(tokens, k, device=dev, generator=g)
wgu = (torch.randn(E, 2 * F, D, device=dev, generator=g) * D ** -0.5).bfloat16()
wd = (torch.randn(E, D, F, device=dev, generator=g) * F ** -0.5).bfloat16()
pl = torch.zeros(E, dtype=torch.long)
ops = layer.get_backend("triton")
with torch.no_grad():
    for _ in range(20):
        layer.ep_moe(x, ids, w, pl, wgu, wd, backend=ops)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    for _ in range(300):
        torch.cuda.synchronize()
        prof.enable(); layer.ep_moe(x, ids, w, pl, wgu, wd, backend=ops); prof.disable()
    torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(45); print(s.getvalue())
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45); print(s.getvalue())
