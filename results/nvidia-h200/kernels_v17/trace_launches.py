"""Session 18: which launch writes the small-problem config into LAST_LAUNCH_META during the pinned test."""
import importlib, sys, threading, traceback
import pytest
m = importlib.import_module("occult.kernels.grouped_swiglu")
orig = m.launch_gemm
def traced(tuned, kernel, grid, args, consts, dtype, num_pairs, shape=None):
    name = m.kernel_name(kernel)
    meta = m.fixed_gemm_meta(dtype, num_pairs, name, shape, args[0].device if shape is not None else None,
                             bool(consts.get("TMA", False)))
    if name == "_swiglu_fwd_kernel" and ("PINNED_PHASE" in m.__dict__):
        print(f"LAUNCH {name} pairs={num_pairs} shape={shape} dtype={dtype} forced={name in m._FORCED_META} "
              f"meta={dict(meta) if meta else None} thread={threading.current_thread().name}", flush=True)
        traceback.print_stack(limit=12)
    return orig(tuned, kernel, grid, args, consts, dtype, num_pairs, shape)
m.launch_gemm = traced
class Plugin:
    def pytest_runtest_setup(self, item):
        if "pinned" in item.name:
            m.PINNED_PHASE = True
            print("MODULE", id(m), id(sys.modules["occult.kernels.grouped_swiglu"]), flush=True)
    def pytest_runtest_teardown(self, item):
        m.__dict__.pop("PINNED_PHASE", None)
sys.exit(pytest.main(["-q", "-s", "-p", "no:cacheprovider", "tests/kernels", "-m", "gpu", "-x"] + sys.argv[1:], plugins=[Plugin()]))
