"""The fused residual-add + RMSNorm in the decode GEMV's last program: kernel, op, pass.

CPU: the kernel under Triton's interpreter (fp32 and fp16, every norm mode, tiles that leave a
partial last one) against the GEMV followed by the fused norm kernel (same bits) and the norm's
torch reference; the arrival counter is left at zero; bad arguments are rejected; the op's
fallback; the pass on the real loop step of tiny models of every family in bf16 (mock CUDA platform
with PDL) gives the same bits as the graph without it, and leaves a linear that is read elsewhere.
GPU (``-m gpu``): the op at the real shapes against the separate kernels, also inside a CUDA graph.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_pass_snapshots import capture
from test_passes import loop_step_inputs, tiny_model

from rlt_compile.kernels import gemv, rmsnorm, triton_attention
from rlt_compile.passes.manager import PassContext, PassManager, build_passes
from rlt_compile.platform import Platform

MODES = {"add_rmsnorm": 1, "add_rmsnorm2": 2, "add_rmsnorm_rmsnorm": 2}


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def pdl(monkeypatch):
    monkeypatch.setattr("rlt_compile.platform.triton_supports_pdl", lambda: True)
    monkeypatch.delenv("RLT_PDL", raising=False)


def _norm_inputs(n: int, mode: str, dtype, gen, device="cpu"):
    residual = torch.randn(1, n, generator=gen).to(dtype).to(device)
    weights = [(torch.rand(n, generator=gen) + 0.5).to(dtype).to(device) for _ in range(MODES[mode])]
    eps = [1e-6, 1e-5][: MODES[mode]]
    return residual, weights, eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("n", "k", "block_n"), [(40, 48, 16), (37, 20, 2), (5, 70, 4)])
def test_kernel_normalises_the_output_row(interpret, dtype, mode, n, k, block_n):
    gen = torch.Generator().manual_seed(n * 100 + k + block_n)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    residual, weights, eps = _norm_inputs(n, mode, dtype, gen)
    h, out = gemv.linear_gemv_norm(x, w, residual, weights, eps, mode, config={"block_n": block_n})
    y = gemv.linear_gemv(x, w, {"block_n": block_n})
    want = getattr(rmsnorm, f"{mode}_triton")(y, residual, *weights, *eps)
    assert torch.equal(h, want[0]) and torch.equal(out, want[1])
    ref = getattr(rmsnorm, f"{mode}_reference")(y, residual, *weights, *eps)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, ref[1], rtol=tol, atol=tol)
    assert not triton_attention._COUNTERS[torch.device("cpu"), "gemv_norm"].any()  # left zeroed


def test_kernel_rejects_bad_norm_arguments(interpret):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 8), torch.randn(16, 8)
    residual, weights, eps = _norm_inputs(16, "add_rmsnorm2", torch.float32, gen)
    with pytest.raises(ValueError, match="unknown mode 'rmsnorm'"):
        gemv.linear_gemv_norm(x, w, residual, weights, eps, "rmsnorm")
    with pytest.raises(ValueError, match="takes 1 norm weight"):
        gemv.linear_gemv_norm(x, w, residual, weights, eps, "add_rmsnorm")
    with pytest.raises(ValueError, match=r"residual must be \(1, 16\)"):
        gemv.linear_gemv_norm(x, w, residual[:, :8], weights, eps, "add_rmsnorm2")
    with pytest.raises(ValueError, match=r"norm weights must be \[16\]"):
        gemv.linear_gemv_norm(x, w, residual, [weights[0][:8], weights[1]], eps, "add_rmsnorm2")
    with pytest.raises(ValueError, match="norm epilogue needs one row"):
        gemv.linear_gemv_norm(torch.randn(2, 8), w, residual.expand(2, 16), weights, eps, "add_rmsnorm2")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("rows", [1, 3])
def test_op_falls_back_to_linear_and_the_norm_op_off_gpu(mode, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 24, generator=gen).bfloat16()
    w = torch.randn(40, 24, generator=gen).bfloat16()
    residual, weights, eps = _norm_inputs(40, mode, torch.bfloat16, gen)
    residual = residual.expand(rows, 40).contiguous()
    got = torch.ops.rlt.linear_norm_small(x, w, residual, weights, eps, mode)
    want = getattr(torch.ops.rlt, mode)(F.linear(x, w), residual, *weights, *eps)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _run(captured, passes: list[str]):
    gm, inputs = copy.deepcopy(captured[0]), captured[1]
    records = PassManager(build_passes(passes)).run(gm, PassContext(Platform.mock("cuda"), example_inputs=inputs))
    inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    return gm, {r.pass_name: r.message for r in records}, gm(*inputs)


def _ops(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "rlt." in str(n.target)]


BASE = ["fuse_linears", "fuse_rmsnorm", "gemv_swap"]


@pytest.mark.parametrize("family", ["ouro", "nanbeige", "huginn"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_pass_on_the_loop_step_gives_the_same_bits(pdl, family, tokens):
    model = tiny_model(family, torch.bfloat16)
    captured = capture(model.loop_step, *loop_step_inputs(model, tokens, torch.bfloat16))
    before, _, expected = _run(captured, BASE)
    fused, log, got = _run(captured, [*BASE, "fuse_gemv_rmsnorm"])
    count = _ops(fused).count("rlt.linear_norm_small.default")
    norms = sum(op.split(".")[1] in MODES for op in _ops(before))
    assert count == norms == {"ouro": 4, "nanbeige": 6, "huginn": 4}[family]  # every residual norm takes a GEMV
    assert log["fuse_gemv_rmsnorm"].startswith(f"{count} residual-add + RMSNorm folded")
    assert sum(op.split(".")[1] in MODES for op in _ops(fused)) == norms - count
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


class ResidualFirst(torch.nn.Module):
    """``residual + o_proj(x)`` (the linear as the add's second operand), then a pre-norm."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 24, bias=False)
        self.norm_weight = torch.nn.Parameter(torch.rand(24) + 0.5)

    def forward(self, x, residual):
        return torch.ops.rlt.add_rmsnorm(residual, self.proj(x), self.norm_weight, 1e-6)


class LinearReadTwice(ResidualFirst):
    def forward(self, x, residual):
        y = self.proj(x)
        return torch.ops.rlt.add_rmsnorm(y, residual, self.norm_weight, 1e-6), y.sum()


def test_pass_takes_the_linear_as_either_operand_of_the_add(pdl):
    module = ResidualFirst().bfloat16()
    captured = capture(module, torch.randn(1, 16).bfloat16(), torch.randn(1, 24).bfloat16())
    _, _, expected = _run(captured, ["gemv_swap"])
    fused, log, got = _run(captured, ["gemv_swap", "fuse_gemv_rmsnorm"])
    assert _ops(fused) == ["rlt.linear_norm_small.default"]
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_pass_leaves_a_linear_read_elsewhere(pdl):
    captured = capture(LinearReadTwice().bfloat16(), torch.randn(1, 16).bfloat16(), torch.randn(1, 24).bfloat16())
    fused, log, _ = _run(captured, ["gemv_swap", "fuse_gemv_rmsnorm"])
    assert "fuse_gemv_rmsnorm" not in log
    assert "rlt.linear_norm_small.default" not in _ops(fused)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("n", "k"), [(2048, 2048), (2048, 5632), (3072, 10752), (5280, 17920), (300, 77)])
def test_gpu_op_matches_the_separate_kernels(mode, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    residual, weights, eps = _norm_inputs(n, mode, torch.bfloat16, torch.Generator().manual_seed(n), "cuda")
    h, out = torch.ops.rlt.linear_norm_small(x, w, residual, weights, eps, mode)
    want = getattr(torch.ops.rlt, mode)(torch.ops.rlt.linear_small(x, w), residual, *weights, *eps)
    # the GEMV is the same; the norm may round its sum of squares differently (FMA) by one bit
    torch.testing.assert_close(h.float(), want[0].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), want[1].float(), rtol=2e-2, atol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = torch.ops.rlt.linear_norm_small(x, w, residual, weights, eps, mode)
    for _ in range(3):  # the counter is reset by every launch
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed[0], h) and torch.equal(replayed[1], out)
