"""Layer-level A/B of a forward SwiGLU pin, for one process: `python s17_layer_ab.py CONFIG -- SWEEP ARGS`.
CONFIG `base` runs the tree's pins; otherwise BMxBNxBK:wW:sS[:KEY=INT...] replaces the forward SwiGLU
pin (descriptor path) for D = 2048 at F = 1024 and 1408 before the sweep runs in this process."""
import importlib
import sys
from types import MappingProxyType

from occult import sweep
from occult.kernels.tune_kernels import parse_config

swiglu = importlib.import_module("occult.kernels.grouped_swiglu")   # the package re-exports the op under this name

config, args = sys.argv[1], sys.argv[3:]
if config != "base":
    meta = parse_config(config)
    table = dict(swiglu.TUNED_GEMM_META)
    for ffn in (1024, 1408):
        table[("_swiglu_fwd_kernel", 9, 2048, ffn, True)] = MappingProxyType(dict(meta))
    swiglu.TUNED_GEMM_META = MappingProxyType(table)
    print(f"forward SwiGLU pin for F = 1024 and 1408: {dict(meta)}", flush=True)
sys.exit(sweep.main(args))
