"""The time model: the bandwidth curve, the link model, method names, the host/GPU time terms,
weight reads under small batches and the shared expert's bytes and launches."""

import dataclasses

import numpy as np
import pytest
import torch

from occult.shapes import get_shape
from occult.sim.calibration import build_cost_model
from occult.sim.columns import SimulateError
from occult.sim.cost_model import (CostModel, HostTerms, LinkModel, LogLogCurve, OtherGpuTerms, builtin_alltoall_curve,
                                   fit_host, gpu_components, layer_time, method_spec, shared_elementwise_bytes,
                                   shared_expert_ms, shared_launches)
from occult.sim.traffic import traffic
from tests.sim.test_measured import gemm_csv, settings


def test_bandwidth_curve_interpolates_in_log_space():
    curve = LogLogCurve(np.array([1e6, 1e8]), np.array([0.01, 0.1]))
    assert curve(1e6) == pytest.approx(0.01) and curve(1e8) == pytest.approx(0.1)
    assert curve(1e7) == pytest.approx(np.sqrt(0.01 * 0.1))           # geometric midpoint
    assert curve(10.0) == pytest.approx(0.01)                          # latency floor
    assert curve(2e8) == pytest.approx(0.2)                            # best bandwidth beyond
    builtin = builtin_alltoall_curve()
    sizes = np.geomspace(1e3, 4e9, 60)
    times = [builtin(s) for s in sizes]
    assert np.all(np.diff(times) >= 0)
    # 1 GiB buffer on 2 GPUs at 660 GB/s: half of it remote
    assert builtin(2**29) == pytest.approx(2**30 / 660e9 * 1e3)
    with pytest.raises(SimulateError, match="increasing"):
        LogLogCurve(np.array([2.0, 1.0]), np.array([1.0, 1.0]))


def test_link_model_adds_the_network_between_nodes():
    link = LinkModel({2: builtin_alltoall_curve()}, gpus_per_node=2, inter_node_bytes_per_ms=50e9 / 1e3,
                     inter_node_latency_ms=0.015)
    bytes_SD = np.full((4, 4), 1e8)
    one_node = LinkModel({2: builtin_alltoall_curve()}, 4, 50e9 / 1e3, 0.015)
    assert link.alltoall_ms(bytes_SD) == pytest.approx(0.015 + 2e8 / 50e9 * 1e3)
    assert one_node.alltoall_ms(bytes_SD) < link.alltoall_ms(bytes_SD)
    assert link.alltoall_ms(np.zeros((1, 1))) == 0.0


def tiny_cost(tmp_path) -> CostModel:
    """Measured curves of the tiny shape plus hand-set calibrated terms."""
    cost = build_cost_model(settings(gemm_csv=gemm_csv(tmp_path / "gemm.csv")))
    return dataclasses.replace(
        cost, kernel_tflops=LogLogCurve(np.array([4.0, 64.0]), np.array([1.0, 10.0]), extend="flat"),
        kernel_train_scale=3.5, other_gpu=OtherGpuTerms(0.01, 5.0, 2.0, 1), naive_ns_per_pair={"fwd": 20.0},
        host={("occult", "fwd", 2): HostTerms(0.5, 1.0, 1, "test"), ("naive", "fwd", 1): HostTerms(0.1, 0.2, 1, "test")})


def test_method_names_map_to_families_and_modes():
    assert method_spec("naive").family == "naive" and method_spec("naive").contiguous
    spec = method_spec("occult-nd2-graph")
    assert (spec.family, spec.mode, spec.max_devices, spec.static) == ("occult-graph", "dedup", 2, True)
    assert method_spec("occult-pe").mode == "per_expert" and method_spec("occult-pe").family == "occult-pe"
    assert method_spec("occult-static").family == "occult-static"
    assert method_spec("occult-trivial").contiguous and method_spec("occult-compute").family == "occult-compute"
    for bad in ("megablocks", "occult-bogus", "occult-pe-graph"):
        with pytest.raises(SimulateError, match="method"):
            method_spec(bad)


def test_layer_time_is_host_before_the_sync_plus_the_longer_of_host_and_gpu_after(tmp_path):
    cost = tiny_cost(tmp_path)
    eager, graph = method_spec("occult"), method_spec("occult-graph")
    assert layer_time(0.3, eager, "fwd", 2, cost)["layer_ms"] == pytest.approx(0.5 + 1.0)    # host-bound
    assert layer_time(4.0, eager, "fwd", 2, cost)["layer_ms"] == pytest.approx(0.5 + 4.0)    # GPU-bound
    assert layer_time(4.0, eager, "fwd", 8, cost)["layer_ms"] == pytest.approx(4.5)          # D=2 terms used at D=8
    assert cost.host_for("occult", "fwd", 8).source.startswith("D=2 terms")
    assert layer_time(4.0, graph, "fwd", 2, cost)["layer_ms"] == 4.0                         # replay: GPU only
    assert np.isnan(layer_time(4.0, eager, "fwd", 1, cost)["layer_ms"])                      # nothing at D ≤ 1
    assert cost.missing(eager, "fwd", 1).startswith("uncalibrated")
    assert cost.missing(eager, "train", 2).startswith("uncalibrated")


def test_host_terms_scale_with_the_host_probe(tmp_path):
    """A slower host (s > 1) stretches pre, post and the shared-expert launches, never the GPU time;
    fit_host recovers the typical host's terms from points measured on hosts of different speeds
    (and misfits them when told every host was typical)."""
    cost = tiny_cost(tmp_path)
    eager = method_spec("occult")
    slow = layer_time(0.3, eager, "fwd", 2, cost, shared_host_ms=0.2, host_scale=2.0)
    assert slow["layer_ms"] == pytest.approx(2 * 0.5 + 2 * (1.0 + 0.2))
    assert (slow["host_pre_ms"], slow["host_post_ms"], slow["host_shared_ms"]) == pytest.approx((1.0, 2.0, 0.4))
    assert layer_time(4.0, eager, "fwd", 2, cost, host_scale=2.0)["layer_ms"] == pytest.approx(1.0 + 4.0)
    gpu = np.array([0.1, 0.5, 2.0, 4.0, 8.0, 0.1, 0.5])
    scale = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.8, 1.8])
    measured = scale * 0.7 + np.maximum(scale * 1.2, gpu)
    pre, post, loss = fit_host(gpu, measured, host_scale=scale)
    assert pre == pytest.approx(0.7, abs=0.005) and post == pytest.approx(1.2, abs=0.005) and loss < 1e-5
    assert fit_host(gpu, measured)[2] > 1e-3


def test_weights_set_a_floor_under_small_batches():
    """Decode-sized calls wait on the active experts' weights (bytes / HBM), large ones on FLOPs."""
    shape = get_shape("olmoe")
    ids = np.array([[e for e in range(8)]])                     # one token, experts 0..7
    one = traffic(ids, np.zeros(64, dtype=np.int64), 1, "dedup", shape.hidden)
    assert one.active_experts_D.tolist() == [8.0]
    cost = CostModel(LinkModel({2: builtin_alltoall_curve()}, 8, 1e9, 0.0), LogLogCurve(np.array([1.0]),
                     np.array([400.0]), extend="flat"), 3.0, {}, 760.0, hbm_bytes_per_ms=4e9,
                     other_gpu=OtherGpuTerms(0.0, 0.0, 1.0, 0))
    spec = method_spec("occult-graph")
    floor = 8 * 3 * shape.hidden * shape.ffn * 2 / 4e9
    math_one = 8 * 6 * shape.hidden * shape.ffn / 400e12 * 1e3
    assert gpu_components(one, shape, spec, "fwd", cost, 1)["kernels_ms"] == pytest.approx(floor + math_one)
    assert gpu_components(one, shape, spec, "train", cost, 1)["kernels_ms"] == pytest.approx(3 * floor + 3 * math_one)
    no_floor = dataclasses.replace(cost, hbm_bytes_per_ms=float("inf"))
    assert gpu_components(one, shape, spec, "fwd", no_floor, 1)["kernels_ms"] < floor / 50
    # the expert kernels' latency floor sits above the weight reads (× 3 passes in fwd+bwd)
    latency = dataclasses.replace(cost, kernel_floor_ms=0.1)
    assert gpu_components(one, shape, spec, "fwd", latency, 1)["kernels_ms"] == pytest.approx(floor + 0.1)
    assert gpu_components(one, shape, spec, "train", latency, 1)["kernels_ms"] == pytest.approx(3 * (floor + 0.1))
    # small calls stream their weights at their own measured rate (kernel_stream_bytes_per_ms), below HBM's
    streamed = dataclasses.replace(latency, kernel_stream_bytes_per_ms=2e9)
    assert gpu_components(one, shape, spec, "fwd", streamed, 1)["kernels_ms"] == pytest.approx(2 * floor + 0.1)
    assert streamed.stream_bytes_per_ms == 2e9 and latency.stream_bytes_per_ms == 4e9
    many = traffic(np.random.default_rng(0).integers(0, 64, (65536, 8)), np.zeros(64, dtype=np.int64), 1, "dedup",
                   shape.hidden)
    flops_ms = 65536 * 8 * 6 * shape.hidden * shape.ffn / 400e12 * 1e3
    # large calls: the math dominates; the weights are read once more on top of it
    assert gpu_components(many, shape, spec, "fwd", cost, 65536)["kernels_ms"] == pytest.approx(flops_ms + 64 * floor / 8)
    assert gpu_components(many, shape, spec, "fwd", streamed, 65536)["kernels_ms"] == pytest.approx(flops_ms + 64 * floor / 8)


def test_shared_expert_elementwise_bytes_match_the_sweeps_shared_expert():
    """The model's element-wise HBM bytes of the shared expert equal what the sweep's `SharedExpert`
    (and the step's `y + shared(x)`) reads and writes in its non-GEMM ops, counted under a dispatch
    mode on the CPU; the term adds bytes / HBM rate to the shared expert's time (x 3 in fwd+bwd)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from occult.shapes import SharedExpert

    gemms = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.linear.default,
             torch.ops.aten.t.default, torch.ops.aten.slice.Tensor, torch.ops.aten.view.default,
             torch.ops.aten._unsafe_view.default, torch.ops.aten.expand.default}

    class ElementwiseBytes(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func not in gemms:
                tensors = [a for a in args if isinstance(a, torch.Tensor)] + [out]
                ElementwiseBytes.total += sum(t.numel() * t.element_size() for t in tensors)
            return out

    tokens = 16
    for name in ("tiny-shared", "tiny"):
        shape = get_shape(name)
        if not shape.shared_ffn:
            assert shared_elementwise_bytes(shape, tokens) == 0.0
            continue
        module = SharedExpert(shape, 0, torch.device("cpu"), torch.bfloat16)
        x, y = torch.randn(tokens, shape.hidden, dtype=torch.bfloat16), torch.randn(tokens, shape.hidden, dtype=torch.bfloat16)
        with torch.no_grad(), ElementwiseBytes():
            _ = y + module(x)
        # the [T, 1] sigmoid gate's own reads and writes are the only bytes the model leaves out
        assert ElementwiseBytes.total - shared_elementwise_bytes(shape, tokens) == 3 * tokens * 2
    qwen = get_shape("qwen")
    hbm = 4300e9 / 1e3
    extra = shared_expert_ms(qwen, 16384, "fwd", 755, hbm) - max(
        2 * 3 * qwen.hidden * qwen.shared_ffn * 16384 / 755e12 * 1e3, 0.0)
    assert extra == pytest.approx(shared_elementwise_bytes(qwen, 16384) / hbm)
    assert shared_expert_ms(qwen, 16384, "train", 755, hbm) == pytest.approx(3 * shared_expert_ms(qwen, 16384, "fwd", 755, hbm))


def test_shared_expert_launches_are_counted_on_the_sweeps_module():
    """The ops `occult.shapes.SharedExpert` adds to a call: Qwen's sigmoid gate adds its own GEMM,
    sigmoid and product; the backward adds more than the forward; no shared expert, no ops."""
    qwen, deepseek = get_shape("qwen"), get_shape("deepseek")
    # forward: gate_up (t, mm), 2 slices, silu, product, down (t, mm), the sum into the output = 9
    assert shared_launches(deepseek, "fwd") == 9
    assert shared_launches(qwen, "fwd") == 9 + 4                      # gate: t, mm, sigmoid, mul
    assert shared_launches(dataclasses.replace(qwen, shared_gate=False), "fwd") == 9
    assert shared_launches(qwen, "train") > 2 * shared_launches(qwen, "fwd")
    assert shared_launches(get_shape("olmoe"), "train") == 0
    assert shared_launches(dataclasses.replace(qwen, shared_ffn=0), "fwd") == 0
