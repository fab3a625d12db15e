"""The decode GEMV that folds the norm before it (``kernels/norm_gemv.py``).

CPU: the kernel under Triton's interpreter (fp32) against the unfused references (the norm ops, then
``F.linear``), for each norm mode, several K chunks, the rotary and SwiGLU epilogues, and bad inputs.
GPU (``-m gpu``): bf16 / fp32 parity at Ouro's and Nanbeige's shapes, and a CUDA-graph chain of two
folds with PDL (the second reads the first's ``h``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlt_compile.kernels.gemv import RopeColumns, rope_columns_reference
from rlt_compile.kernels.norm_gemv import NORM_MODES, norm_linear_gemv, norm_linear_reference

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(k, n, gen, device="cpu", dtype=torch.float32):
    def rand(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale + shift).to(dtype)

    return {
        "weight": rand(n, k, scale=k**-0.5),
        "residual": rand(1, k),
        "d": rand(1, k, scale=4.0),  # a sublayer output on another scale than the residual stream
        "norm_a": rand(k, scale=0.2, shift=1.0),
        "norm_b": rand(k, scale=0.2, shift=1.0),
    }


def _run(fn, mode, t, **kwargs):
    return fn(mode, t["weight"], t["residual"], t["norm_b"], 1e-6, d=t["d"], norm_a=t["norm_a"], eps_a=1e-5, **kwargs)


@pytest.mark.parametrize("mode", sorted(NORM_MODES))
@pytest.mark.parametrize(("n", "k", "block_k"), [(40, 96, 32), (17, 33, 16), (64, 64, 64)])
def test_fold_matches_norm_then_linear(interpret, mode, n, k, block_k):
    t = _inputs(k, n, torch.Generator().manual_seed(n * k + len(mode)))
    y, h = _run(norm_linear_gemv, mode, t, config={"block_k": block_k})
    y_ref, h_ref = _run(norm_linear_reference, mode, t)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    if mode == "rmsnorm":
        assert h is None
    else:
        torch.testing.assert_close(h, h_ref, rtol=0, atol=0)  # the residual stream is rounded like eager


@pytest.mark.parametrize("mode", sorted(NORM_MODES))
def test_fold_epilogues(interpret, mode):
    t = _inputs(64, 48, torch.Generator().manual_seed(5))
    y_ref, _ = _run(norm_linear_reference, mode, t)
    gate, up = y_ref.chunk(2, dim=-1)
    y, _ = _run(norm_linear_gemv, mode, t, swiglu=True)
    torch.testing.assert_close(y, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    gen = torch.Generator().manual_seed(6)
    rope = RopeColumns(torch.rand(1, 8, generator=gen), torch.rand(1, 8, generator=gen), 16, 48, 16)
    y, _ = _run(norm_linear_gemv, mode, t, rope=rope)
    torch.testing.assert_close(y, rope_columns_reference(y_ref, rope), rtol=1e-5, atol=1e-5)


def test_fold_rejects_what_it_cannot_serve(interpret):
    t = _inputs(32, 16, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="is not one of"):
        _run(norm_linear_gemv, "layernorm", t)
    with pytest.raises(ValueError, match=r"d missing"):
        norm_linear_gemv("add_rmsnorm", t["weight"], t["residual"], t["norm_b"], 1e-6)
    with pytest.raises(ValueError, match=r"residual \(2, 32\)"):
        norm_linear_gemv("rmsnorm", t["weight"], torch.randn(2, 32), t["norm_b"], 1e-6)
    with pytest.raises(ValueError, match=r"norm_a \(31,\)"):
        norm_linear_gemv("add_rmsnorm2", t["weight"], t["residual"], t["norm_b"], 1e-6, t["d"], torch.ones(31))
    with pytest.raises(ValueError, match="swiglu needs an even number"):
        _run(norm_linear_gemv, "rmsnorm", _inputs(32, 15, torch.Generator().manual_seed(2)), swiglu=True)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", sorted(NORM_MODES))
@pytest.mark.parametrize(("n", "k"), [(6144, 2048), (11264, 2048), (7680, 2560), (1000, 300)])
def test_fold_gpu_matches_norm_then_linear(dtype, mode, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    t = _inputs(k, n, gen, "cuda", dtype)
    y, h = _run(norm_linear_gemv, mode, t)
    y_ref, h_ref = _run(norm_linear_reference, mode, {key: v.double() for key, v in t.items()})
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol)
    if h is not None:
        _, h_eager = _run(norm_linear_reference, mode, t)
        torch.testing.assert_close(
            h, h_eager, rtol=0 if dtype == torch.bfloat16 else 1e-6, atol=0 if dtype == torch.bfloat16 else 1e-6
        )
    y_swiglu, _ = _run(norm_linear_gemv, mode, t, swiglu=True)
    gate, up = y_ref.chunk(2, dim=-1)
    torch.testing.assert_close(y_swiglu.double(), F.silu(gate) * up, rtol=3 * tol, atol=3 * tol)


@pytest.mark.gpu
@requires_gpu
def test_fold_chain_in_a_cuda_graph():
    """Two folds in a row inside a CUDA graph (PDL on sm_90): the second reads the first's ``h`` and
    output; a replay after new inputs gives the eager chain's result."""
    dtype, k, n = torch.bfloat16, 2048, 2048
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = _inputs(k, n, gen, "cuda", dtype)
    w2 = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(dtype)
    out = {}

    def chain(fn):
        y, h = _run(fn, "add_rmsnorm2", t)
        return fn("add_rmsnorm2", w2, h, t["norm_a"], 1e-6, d=y, norm_a=t["norm_b"], eps_a=1e-6)

    def step():
        out["y"], out["h"] = chain(norm_linear_gemv)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    t["residual"].copy_(torch.randn(1, k, generator=gen, device="cuda").to(dtype))
    graph.replay()
    torch.cuda.synchronize()
    y_ref, h_ref = chain(norm_linear_reference)
    torch.testing.assert_close(out["y"].float(), y_ref.float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out["h"].float(), h_ref.float(), rtol=2e-2, atol=2e-2)
