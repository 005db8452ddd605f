"""In-process A/B (session 15): host µs of the eager one-device forward with the kernel ops called
directly (A, the code) and through their torch custom ops (B, direct_call_ok patched to False),
interleaved A B A B ... in one process, at 1,024 and 16,384 tokens."""
import importlib, json, sys
from occult.ep.launches import host_breakdown
mods = [importlib.import_module(f"occult.kernels.{m}") for m in ("combine", "grouped_swiglu", "grouped_down_reduce")]
real = mods[0].direct_call_ok
def setmode(direct):
    for m in mods:
        m.direct_call_ok = real if direct else (lambda *a: False)
rows = []
for rnd in range(4):
    for direct in (True, False):
        setmode(direct)
        for tokens in (1024, 16384):
            r = host_breakdown(tokens, repeats=100)
            rows.append({"round": rnd, "direct": direct, "tokens": tokens, **r})
setmode(True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
print(f"{'direct':>7} {'tokens':>6} {'total':>8} {'swiglu':>8} {'sw_launch':>9} {'down':>8} {'dn_launch':>9}")
for r in rows:
    print(f"{str(r['direct']):>7} {r['tokens']:>6} {r['total']:8.1f} {r['swiglu']:8.1f} {r['swiglu_launcher']:9.1f} "
          f"{r['down_reduce']:8.1f} {r['down_launcher']:9.1f}")
