"""Session 25: host µs of each helper inside the eager training step's launchers (one H200).

The eager layer at D = 1 (DeepSeek shape, batch 1 × 512 tokens, no shared expert), fwd + bwd, 300
steps after 20 of warm-up, each step from a drained GPU. Every helper named below is wrapped (in
every module that imported it) by a timer that adds its inclusive wall time; the table gives µs per
step and calls per step. `JITFunction.run` is Triton's launch."""
import importlib, statistics, time, collections, contextlib
import torch, triton
from occult.ep.launches import _Clock
from occult.baselines import ExpertWeights, get_shape
from occult.sweep import OccultEP, SyntheticRouter, make_inputs

sw = importlib.import_module("occult.kernels.grouped_swiglu")
dr = importlib.import_module("occult.kernels.grouped_down_reduce")
cb = importlib.import_module("occult.kernels.combine")
dp = importlib.import_module("occult.kernels.dispatch_plan")
layer = importlib.import_module("occult.ep.layer")
clock = _Clock()
PARTS = {
    "swiglu_forward": [(sw, "grouped_swiglu_forward")],
    "swiglu_backward": [(sw, "grouped_swiglu_backward")],
    "down_forward": [(dr, "grouped_down_reduce_forward")],
    "down_backward": [(dr, "grouped_down_reduce_backward")],
    "check_swiglu": [(sw, "_check_swiglu")],
    "check_down": [(dr, "_check_down")],
    "check_grouped_args": [(sw, "check_grouped_args"), (dr, "check_grouped_args")],
    "check_row_table": [(sw, "check_row_table"), (dr, "check_row_table"), (cb, "check_row_table")],
    "use_tma": [(sw, "use_tma"), (dr, "use_tma")],
    "swiglu_dx_uses_tma": [(sw, "swiglu_dx_uses_tma")],
    "pair_order_x_operand": [(sw, "_pair_order_x_operand")],
    "gathered_operand_wanted": [(sw, "gathered_operand_wanted"), (dr, "gathered_operand_wanted")],
    "fixed_gemm_meta": [(sw, "fixed_gemm_meta"), (dr, "fixed_gemm_meta")],
    "launch_gemm": [(sw, "launch_gemm"), (dr, "launch_gemm")],
    "swiglu_preact_grad": [(sw, "swiglu_preact_grad")],
    "gather_sum_rows": [(sw, "gather_sum_rows"), (dr, "gather_sum_rows"), (cb, "gather_sum_rows")],
    "gather_scale_rows": [(dr, "gather_scale_rows")],
    "group_pairs_by_expert": [(dp, "group_pairs_by_expert")],
    "triton_run": [(triton.runtime.jit.JITFunction, "run")],
    "torch.empty": [(torch, "empty")],
}
originals = []
for part, sites in PARTS.items():
    for obj, name in sites:
        if hasattr(obj, name):
            fn = getattr(obj, name)
            originals.append((obj, name, fn))
            setattr(obj, name, clock.wrap(part, fn))
# objects captured before patching: BRIM_1 in the backend, the down op's eager Function
dr._GroupedDownReduceEager = cb.eager_function("grouped_down_reduce", dr.grouped_down_reduce_forward,
                                               dr._down_setup_context, dr._down_grad)
dev, dtype = torch.device("cuda"), torch.bfloat16
shape = get_shape("deepseek")
weights = ExpertWeights.random(shape, 0, dev, dtype)
method = OccultEP(torch.zeros(shape.num_experts, dtype=torch.long), "triton")
method.setup(shape, None, dtype, dev, weights)
import dataclasses
method.ops = dataclasses.replace(method.ops, group_pairs=dp.group_pairs_by_expert)
inputs = make_inputs(shape, SyntheticRouter.make(shape, 0), 512, 1, dev, dtype, [None], None, with_grad_output=True)
ids, gate = inputs.routes[None]
params = method.expert_parameters()
totals = []
for i in range(320):
    torch.cuda.synchronize()
    clock.on = i >= 20
    t0 = time.perf_counter()
    for p in params:
        p.grad = None
    x = inputs.x_TD.detach().requires_grad_(); g = gate.detach().requires_grad_()
    y = method.forward(x, ids, g)
    y.backward(inputs.dy_TD)
    if clock.on:
        totals.append(1e6 * (time.perf_counter() - t0))
    clock.on = False
torch.cuda.synchronize()
for obj, name, fn in originals:
    setattr(obj, name, fn)
steps = len(totals)
print(f"step host µs: median {statistics.median(totals):.0f}, mean {statistics.fmean(totals):.0f} ({steps} steps)")
print(f"{'part':>24} {'µs/step':>9} {'calls/step':>10} {'µs/call':>8}")
for part in PARTS:
    if clock.calls[part]:
        print(f"{part:>24} {clock.us[part] / steps:9.1f} {clock.calls[part] / steps:10.1f} {clock.us[part] / clock.calls[part]:8.1f}")
