"""MegaBlocks' two grouped_gemm builds and the baselines' settings: which build a process imports,
how the kernels in use are recognised, the settings each adapter reports, and (GPU) MegaBlocks'
output and gradients against the dense reference in bf16 for each build that is installed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from occult.harness.baselines import make_method
from occult.shapes import MoEShape
from occult.harness.baselines.megablocks import GROUPED_GEMM_MODES, backend_mode, use_grouped_gemm_build
from occult.harness.sweep.settings import REL_TOLERANCE
from occult.provenance import REPO_ROOT

BUILDS = REPO_ROOT / ".thirdparty" / "baselines"      # tools/build_baselines.sh's default prefix


def fake_build(root: Path, mode: str) -> None:
    package = root / f"gg-{mode}" / "grouped_gemm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"MODE = {mode!r}\n")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600)


def test_the_chosen_build_is_imported_first_and_a_second_one_is_refused(tmp_path):
    for mode in GROUPED_GEMM_MODES:
        fake_build(tmp_path, mode)
    proc = run_python(f"""
        from occult.harness.baselines.megablocks import use_grouped_gemm_build
        folder = use_grouped_gemm_build({str(tmp_path)!r}, "cutlass")
        import grouped_gemm
        print(grouped_gemm.MODE, folder.name)
        use_grouped_gemm_build({str(tmp_path)!r}, "cutlass")          # the same build again: fine
        try:
            use_grouped_gemm_build({str(tmp_path)!r}, "cublas")
        except RuntimeError as err:
            print("refused:", err)
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, second = proc.stdout.strip().splitlines()
    assert first == "cutlass gg-cutlass"
    assert second.startswith("refused: grouped_gemm: ") and "needs a process of its own" in second


def test_a_missing_build_or_mode_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="gg-cublas holds no grouped_gemm"):
        use_grouped_gemm_build(tmp_path, "cublas")
    with pytest.raises(ValueError, match="mode 'fast'"):
        use_grouped_gemm_build(tmp_path, "fast")


class CublasBackend:
    """grouped_gemm's cuBLAS build as the probe meets it: batch sizes on the GPU are refused."""

    def gmm(self, a, b, batch_sizes, trans_a=False, trans_b=False, c=None):
        raise RuntimeError("Expected batch_sizes.is_cpu() to be true, but got false.")


class CutlassBackend:
    def gmm(self, a, b, batch_sizes, trans_a=False, trans_b=False, c=None):
        return a


class BrokenBackend:
    def gmm(self, a, b, batch_sizes, trans_a=False, trans_b=False, c=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_the_kernels_in_use_are_told_by_where_they_take_batch_sizes():
    assert backend_mode(CublasBackend(), torch.device("cpu")) == "cublas"
    assert backend_mode(CutlassBackend(), torch.device("cpu")) == "cutlass"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        backend_mode(BrokenBackend(), torch.device("cpu"))


@pytest.mark.parametrize("name, options, config", [
    ("megablocks", {}, "grouped_gemm=cublas"),
    ("megablocks", {"grouped_gemm": "cutlass"}, "grouped_gemm=cutlass"),
    ("megablocks", {"mlp_impl": "sparse"}, "mlp_impl=sparse"),
    ("tutel", {}, "capacity_factor=0"),
    ("tutel", {"adaptive_r": "0", "megablocks_size": "2"}, "capacity_factor=0,adaptive_r=0,megablocks_size=2"),
    ("deepspeed", {}, "drop_tokens=False"),
    ("deepspeed", {"use_tutel": "1"}, "drop_tokens=False,use_tutel=True"),
    ("naive", {}, ""),
])
def test_each_baseline_reports_the_settings_it_runs_with(name, options, config):
    assert make_method(name, **options).config == config


def test_settings_out_of_a_baselines_reach_are_reported():
    shape = MoEShape("t8k2", 8, 2, 32, 16)
    assert make_method("tutel").supports(shape, 2) is None
    assert "D=1 only" in make_method("tutel", adaptive_r="0").supports(shape, 2)
    assert make_method("tutel", adaptive_r="0").supports(shape, 1) is None
    assert "inference on one device" in make_method("tutel", megablocks_size="1").supports(shape, 1, train=True)
    assert make_method("tutel", megablocks_size="1").supports(shape, 1) is None
    with pytest.raises(ValueError, match="mlp_impl 'dense'"):
        make_method("megablocks", mlp_impl="dense")


def megablocks_errors(builds: str, mode: str) -> dict[str, float]:
    """Relative errors (max |got - want| / max |want|) of MegaBlocks' output and of the gradients of x,
    the gate weights and both expert weights, bf16 against moe_dense_ref in fp32 on the same
    bf16-rounded values, D = 1, 100 tokens (not a multiple of any block), one hot expert."""
    from occult.harness.baselines import ExpertWeights
    from occult.kernels.reference import moe_dense_ref

    use_grouped_gemm_build(builds, mode)
    device, dtype = torch.device("cuda"), torch.bfloat16
    shape = MoEShape("mb", 8, 2, 256, 128)
    method = make_method("megablocks", grouped_gemm=mode)
    ok, why = method.available()
    if not ok:
        raise RuntimeError(f"megablocks unavailable: {why}")
    weights = ExpertWeights.random(shape, seed=3)
    rounded = ExpertWeights(weights.w_gate_up_E2FD.to(dtype).float(), weights.w_down_EDF.to(dtype).float())
    method.setup(shape, None, dtype, device, rounded)
    gen = torch.Generator(device=device).manual_seed(4)
    x = torch.randn(100, shape.hidden, generator=gen, device=device).to(dtype)
    logits = torch.randn(100, shape.num_experts, generator=gen, device=device)
    logits[:, 0] += 3.0                                    # expert 0 is hot
    gate, ids = torch.softmax(logits, dim=1).topk(shape.top_k, dim=1)
    dy = torch.randn(x.shape, generator=gen, device=device)

    x_in, gate_in = x.clone().requires_grad_(), gate.clone().requires_grad_()
    y = method.forward(x_in, ids, gate_in)
    (y.float() * dy).sum().backward()
    w1, v1, w2 = method.expert_parameters()
    e, f, d = shape.num_experts, shape.ffn, shape.hidden
    got_gate_up = torch.cat([w1.grad.view(e, f, d), v1.grad.view(e, f, d)], dim=1)
    got_down = w2.grad.view(e, f, d).transpose(1, 2)

    x_ref, gate_ref = x.float().requires_grad_(), gate.clone().requires_grad_()
    gate_up_ref = rounded.w_gate_up_E2FD.to(device).requires_grad_()
    down_ref = rounded.w_down_EDF.to(device).requires_grad_()
    y_ref = moe_dense_ref(x_ref, ids, gate_ref, gate_up_ref, down_ref)
    (y_ref * dy).sum().backward()

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.float() - want).abs().max() / want.abs().max())

    return {"y": rel(y, y_ref.detach()), "x_grad": rel(x_in.grad, x_ref.grad), "gate_grad": rel(gate_in.grad, gate_ref.grad),
            "w_gate_up_grad": rel(got_gate_up, gate_up_ref.grad), "w_down_grad": rel(got_down, down_ref.grad)}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", GROUPED_GEMM_MODES)
def test_megablocks_output_and_gradients_match_the_dense_reference_in_bf16(mode):
    """Each grouped_gemm build in a process of its own (one build per process); tolerance: the
    sweep's bf16 tolerance, relative to the largest reference value of each tensor."""
    if not (BUILDS / f"gg-{mode}" / "grouped_gemm").is_dir():
        pytest.skip(f"no grouped_gemm {mode} build in {BUILDS} (tools/build_baselines.sh makes both)")
    proc = run_python(f"""
        import json
        from tests.harness.test_megablocks import megablocks_errors
        print(json.dumps(megablocks_errors({str(BUILDS)!r}, {mode!r})))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    tolerance = REL_TOLERANCE["bfloat16"]
    assert set(errors) == {"y", "x_grad", "gate_grad", "w_gate_up_grad", "w_down_grad"}
    assert all(err <= tolerance for err in errors.values()), (mode, errors)
