"""The decode GEMV with a fused RMSNorm prologue (``gemv.norm_linear_gemv``).

CPU: under Triton's interpreter, every norm form of ``kernels/rmsnorm.py`` (Ouro's sandwich
``add_rmsnorm2``, Nanbeige's ``add_rmsnorm``, Huginn's ``add_rmsnorm_rmsnorm``, a plain ``rmsnorm``)
followed by the plain, SwiGLU and rotary GEMV epilogues, against the torch references; bad inputs
are refused by name. GPU (``-m gpu``): bf16 and fp32 at Ouro's shapes against the separate norm
kernel + ``F.linear``.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from rlt_compile.kernels import gemv, rmsnorm
from rlt_compile.kernels.gemv import RopeColumns, RowNorm

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _case(form, k, dtype, device, gen):
    """``(RowNorm, (h, out) reference)`` of one norm form on a random row."""

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    y, r, wa, wb = rand(1, k), rand(1, k), rand(k), rand(k)
    if form == "add_rmsnorm2":
        return y, RowNorm(r, wa, wb, 1e-6, 1e-5, 2), rmsnorm.add_rmsnorm2_reference(y, r, wa, wb, 1e-6, 1e-5)
    if form == "add_rmsnorm":
        return y, RowNorm(r, None, wb, 0.0, 1e-5, 1), rmsnorm.add_rmsnorm_reference(y, r, wb, 1e-5)
    if form == "add_rmsnorm_rmsnorm":
        ref = rmsnorm.add_rmsnorm_rmsnorm_reference(y, r, wa, wb, 1e-6, 1e-5)
        return y, RowNorm(r, wa, wb, 1e-6, 1e-5, 1), ref
    out = rmsnorm.rmsnorm_reference(y, wa, 1e-6)
    return y, RowNorm(None, wa, None, 1e-6, 0.0, 0), (out, out)  # h: the last stage's row


def _epilogue(out, w, epilogue, rope):
    y = F.linear(out.float(), w.float())
    if epilogue == "swiglu":
        gate, up = y.to(out.dtype).chunk(2, dim=-1)
        return F.silu(gate.float()) * up.float()
    if epilogue == "rope":
        return gemv.rope_columns_reference(y.to(out.dtype), rope).float()
    return y


FORMS = ["add_rmsnorm2", "add_rmsnorm", "add_rmsnorm_rmsnorm", "rmsnorm"]


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("epilogue", ["plain", "swiglu", "rope"])
@pytest.mark.parametrize(("n", "k"), [(64, 96), (32, 50)])
def test_norm_prologue_matches_norm_then_linear(interpret, form, epilogue, n, k):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{form}-{epilogue}-{n}-{k}".encode()))
    y, norm, (h_ref, out_ref) = _case(form, k, torch.float32, "cpu", gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    rope = None
    if epilogue == "rope":
        cos, sin = torch.randn(1, 8, generator=gen), torch.randn(1, 8, generator=gen)
        rope = RopeColumns(cos, sin, n - 32, n, 16)
    h, out = gemv.norm_linear_gemv(y, norm, w, rope=rope, swiglu=epilogue == "swiglu")
    torch.testing.assert_close(h, h_ref, rtol=1e-6, atol=1e-6)  # fp32: only the sum order differs
    torch.testing.assert_close(out.float(), _epilogue(out_ref, w, epilogue, rope), rtol=1e-5, atol=1e-5)


def test_norm_prologue_fp16_is_exact_to_the_norm(interpret):
    gen = torch.Generator().manual_seed(5)
    y, norm, (h_ref, out_ref) = _case("add_rmsnorm2", 80, torch.float16, "cpu", gen)
    w = (torch.randn(48, 80, generator=gen) / 9).half()
    h, out = gemv.norm_linear_gemv(y, norm, w)
    assert torch.equal(h, h_ref)
    torch.testing.assert_close(out.float(), F.linear(out_ref.float(), w.float()), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rows": 2}, "2 rows"),
        ({"residual_shape": (1, 7)}, "residual"),
        ({"weight_a_shape": (7,)}, "weight_a"),
        ({"mode": 0}, "residual_mode 0"),
    ],
)
def test_norm_prologue_refuses_bad_inputs(interpret, change, message):
    k = 16
    y = torch.randn(change.get("rows", 1), k)
    r = torch.randn(*change.get("residual_shape", (change.get("rows", 1), k)))
    wa = torch.randn(*change.get("weight_a_shape", (k,)))
    norm = RowNorm(r, wa, torch.randn(k), 1e-6, 1e-6, change.get("mode", 2))
    with pytest.raises(ValueError, match=message):
        gemv.norm_linear_gemv(y, norm, torch.randn(8, k))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("epilogue", "n", "k"), [("plain", 6144, 2048), ("swiglu", 11264, 2048), ("rope", 6144, 2048)])
def test_gpu_norm_prologue_matches_norm_kernel_then_linear(dtype, form, epilogue, n, k):
    gen = torch.Generator().manual_seed(n + k)
    y, norm, _ = _case(form, k, dtype, "cuda", gen)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to("cuda", dtype)
    rope = None
    if epilogue == "rope":
        cos, sin = torch.randn(1, 64, generator=gen).cuda(), torch.randn(1, 64, generator=gen).cuda()
        rope = RopeColumns(cos, sin, 0, 4096, 128)
    launch = {
        "add_rmsnorm2": lambda: rmsnorm.add_rmsnorm2_triton(y, norm.residual, norm.weight_a, norm.weight_b, 1e-6, 1e-5),
        "add_rmsnorm": lambda: rmsnorm.add_rmsnorm_triton(y, norm.residual, norm.weight_b, 1e-5),
        "add_rmsnorm_rmsnorm": lambda: rmsnorm.add_rmsnorm_rmsnorm_triton(
            y, norm.residual, norm.weight_a, norm.weight_b, 1e-6, 1e-5
        ),
        "rmsnorm": lambda: (rmsnorm.rmsnorm_triton(y, norm.weight_a, 1e-6),) * 2,
    }[form]
    h_ref, out_ref = launch()
    h, out = gemv.norm_linear_gemv(y, norm, w, rope=rope, swiglu=epilogue == "swiglu")
    torch.cuda.synchronize()
    assert torch.equal(h, h_ref)  # one tree reduction of the same row, the same rounding steps
    ref = _epilogue(out_ref, w, epilogue, rope)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-5), rel
