"""The SwiGLU gate in the decode GEMV's epilogue: the kernel, ``rlt::swiglu_linear_small``, the pass.

CPU: the kernel under Triton's interpreter against ``F.linear`` + the eager gate (fp32 and bf16,
tiles of 2 to 16 columns, hidden sizes that leave a partial last tile); the gating kernel for many
rows; the op's fallback; the pass on ``SwiGLU`` / ``FusedSwiGLU`` and on the real loop step of tiny
models of every family in bf16 (mock CUDA platform with PDL): the rewritten graph gives the same
bits as the graph without it, and the pass leaves a graph alone when a half is read elsewhere.
GPU (``-m gpu``): the op at the real gate/up shapes, one row (the epilogue) and several (cuBLAS +
the gating kernel), also inside a CUDA graph.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_pass_snapshots import capture
from test_passes import loop_step_inputs, tiny_model

from rlt_compile.kernels import gemv
from rlt_compile.models.layers import FusedSwiGLU, SwiGLU
from rlt_compile.passes.manager import PassContext, PassManager, build_passes
from rlt_compile.platform import Platform


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def pdl(monkeypatch):
    monkeypatch.setattr("rlt_compile.platform.triton_supports_pdl", lambda: True)
    monkeypatch.delenv("RLT_PDL", raising=False)


def _gate(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_n", [2, 4, 16])
@pytest.mark.parametrize(("hidden", "k"), [(24, 40), (13, 70), (1, 16)])
def test_kernel_gates_the_two_halves(interpret, dtype, block_n, hidden, k):
    gen = torch.Generator().manual_seed(block_n + 10 * hidden + k)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = (torch.randn(2 * hidden, k, generator=gen) * k**-0.5).to(dtype)
    y = gemv.linear_gemv(x, w, {"block_n": block_n}, swiglu=True)
    assert y.shape == (1, hidden) and y.dtype == dtype
    # the gate of the GEMV's own (rounded) outputs: only the SiLU's last bit may differ
    want = _gate(gemv.linear_gemv(x, w, {"block_n": block_n}))
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(y.float(), _gate(x.float() @ w.float().T), rtol=10 * tol, atol=10 * tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 8), (2, 37), (5, 1030)])
def test_gating_kernel_for_many_rows_matches_eager(interpret, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * 100 + hidden)
    y = torch.randn(rows, 2 * hidden, generator=gen).to(dtype)
    got = gemv.silu_gate_triton(y)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), _gate(y).float(), rtol=tol, atol=tol)


def test_kernel_rejects_what_it_cannot_gate(interpret):
    with pytest.raises(ValueError, match="swiglu needs one row"):
        gemv.linear_gemv(torch.randn(2, 8), torch.randn(16, 8), swiglu=True)
    with pytest.raises(ValueError, match="even number of output columns"):
        gemv.linear_gemv(torch.randn(1, 8), torch.randn(15, 8), swiglu=True)
    with pytest.raises(ValueError, match="swiglu needs"):
        gemv.linear_gemv(torch.randn(1, 8), torch.randn(16, 8), {"block_n": 3}, swiglu=True)


@pytest.mark.parametrize("rows", [1, 3])
def test_op_falls_back_to_linear_and_the_eager_gate_off_gpu(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 24, generator=gen).bfloat16()
    w = torch.randn(40, 24, generator=gen).bfloat16()
    assert torch.equal(torch.ops.rlt.swiglu_linear_small(x, w), _gate(F.linear(x, w)))


def _run(captured, passes: list[str]):
    gm, inputs = copy.deepcopy(captured[0]), captured[1]
    records = PassManager(build_passes(passes)).run(gm, PassContext(Platform.mock("cuda"), example_inputs=inputs))
    inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    return gm, {r.pass_name: r.message for r in records}, gm(*inputs)


def _ops(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "rlt." in str(n.target)]


@pytest.mark.parametrize("module_type", [SwiGLU, FusedSwiGLU])
@pytest.mark.parametrize("tokens", [1, 3])
def test_pass_folds_the_gate_into_the_gate_up_gemv(pdl, module_type, tokens):
    torch.manual_seed(tokens)
    module = module_type(16, 24).bfloat16()
    captured = capture(module, torch.randn(tokens, 16, dtype=torch.bfloat16))
    _, _, expected = _run(captured, ["fuse_linears", "gemv_swap"])
    fused, log, got = _run(captured, ["fuse_linears", "gemv_swap", "fuse_swiglu_gemv"])
    assert log["fuse_swiglu_gemv"].startswith("1 SwiGLU gates folded")
    assert _ops(fused) == ["rlt.swiglu_linear_small.default", "rlt.linear_small.default"]
    assert torch.equal(got[0], expected[0])


class LeakyGate(torch.nn.Module):
    """A SwiGLU whose up half is also read outside the gate."""

    def __init__(self):
        super().__init__()
        self.mlp = FusedSwiGLU(16, 24)

    def forward(self, x):
        gate, up = self.mlp.fc(x).chunk(2, dim=-1)
        return self.mlp.proj(F.silu(gate) * up), up.sum()


def test_pass_leaves_a_gate_whose_half_is_read_elsewhere(pdl):
    captured = capture(LeakyGate().bfloat16(), torch.randn(1, 16, dtype=torch.bfloat16))
    fused, log, _ = _run(captured, ["gemv_swap", "fuse_swiglu_gemv"])
    assert "fuse_swiglu_gemv" not in log
    assert "rlt.swiglu_linear_small.default" not in _ops(fused)


def test_pass_needs_gemv_swap_first(pdl):
    captured = capture(SwiGLU(16, 24).bfloat16(), torch.randn(1, 16, dtype=torch.bfloat16))
    _, log, _ = _run(captured, ["fuse_linears", "fuse_swiglu_gemv"])
    assert "fuse_swiglu_gemv" not in log


@pytest.mark.parametrize("family", ["ouro", "nanbeige", "huginn"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_pass_on_the_loop_step_gives_the_same_bits(pdl, family, tokens):
    model = tiny_model(family, torch.bfloat16)
    captured = capture(model.loop_step, *loop_step_inputs(model, tokens, torch.bfloat16))
    _, _, expected = _run(captured, ["fuse_linears", "gemv_swap"])
    fused, log, got = _run(captured, ["fuse_linears", "gemv_swap", "fuse_swiglu_gemv"])
    layers = _ops(fused).count("rlt.swiglu_linear_small.default")
    assert layers == {"ouro": 2, "nanbeige": 3, "huginn": 2}[family]
    assert log["fuse_swiglu_gemv"].startswith(f"{layers} SwiGLU gates folded")
    assert torch.equal(got[0], expected[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("hidden", "k"), [(5632, 2048), (10752, 3072), (17920, 5280), (300, 77)])
def test_gpu_op_matches_linear_and_gate(hidden, k):
    gen = torch.Generator(device="cuda").manual_seed(hidden + k)
    w = torch.randn(2 * hidden, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
    for rows in (1, 3):  # the GEMV's epilogue; cuBLAS + the gating kernel
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        y = torch.ops.rlt.swiglu_linear_small(x, w)
        assert y.shape == (rows, hidden)
        torch.testing.assert_close(y.float(), _gate((x.float() @ w.float().T).bfloat16()).float(), rtol=2e-2, atol=2e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = torch.ops.rlt.swiglu_linear_small(x, w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, y)
