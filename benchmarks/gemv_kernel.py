"""A study, not part of the package: small-batch linear layers (decode GEMVs) in Triton, with the
input's RMSNorm or SiLU-gate fused in. Measured against cuBLAS by ``gemv_bench.py`` beside this file
(docs/benchmarks.md: no faster, so the package does not use it).

At decode a linear ``y = x @ W.T`` has a handful of rows ``M`` and is bound by reading ``W`` once.
Three launchers cover the linears of a looped decoder layer:

* ``gemv_triton(x, W)``: the plain linear;
* ``rmsnorm_linear_triton(x, norm_w, eps, W)``: ``linear(rmsnorm(x) * norm_w, W)``, with the norm's
  rounding exactly as ``models.layers.RMSNorm`` does it (normalise in fp32, cast, then multiply by
  the weight in the input dtype); every program recomputes its rows' norm from ``x`` (a few KB
  from L2), so the normalised activations never go through HBM and no separate kernel runs;
* ``silu_mul_linear_triton(gate_up, W)``: ``linear(silu(gate) * up, W)`` with ``gate``/``up`` the
  two halves of ``gate_up`` (the fused gate/up projection's output), rounded like the eager
  ``F.silu(g) * u``.

The kernel pads the rows to 16 and uses ``tl.dot`` (tensor cores; the padding costs no bandwidth),
with one program per ``BLOCK_N`` output columns so that the weight is read exactly once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rlt_compile.kernels.launch import interpreter_scope, is_interpreted, kernel_for, sm_count

_NONE, _RMSNORM, _SILU_MUL = 0, 1, 2


def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    nw_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    up_offset,
    eps,
    PROLOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if PROLOGUE == 1:  # the rows' RMS, from the whole row of x
        sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            xk = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & (kk[None, :] < K), other=0.0).to(tl.float32)
            sumsq += tl.sum(xk * xk, axis=1)
        rstd = tl.rsqrt(sumsq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        w = tl.load(w_rows + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        xmask = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_rows + kk[None, :], mask=xmask, other=0.0)
        if PROLOGUE == 1:
            normed = (x.to(tl.float32) * rstd[:, None]).to(x_ptr.dtype.element_ty)
            nw = tl.load(nw_ptr + kk, mask=mask_k, other=0.0)
            x = (nw[None, :].to(tl.float32) * normed.to(tl.float32)).to(x_ptr.dtype.element_ty)
        elif PROLOGUE == 2:
            g = x.to(tl.float32)
            act = (g * tl.sigmoid(g)).to(x_ptr.dtype.element_ty)
            u = tl.load(x_rows + up_offset + kk[None, :], mask=xmask, other=0.0)
            x = (act.to(tl.float32) * u.to(tl.float32)).to(x_ptr.dtype.element_ty)
        acc += tl.dot(x.to(w.dtype), tl.trans(w), input_precision=PRECISION)
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gemv_config(n: int, k: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tile choice from shapes only: ``BLOCK_N`` so that the column tiles fill the GPU at least once,
    a long ``BLOCK_K`` run per load (deep enough in flight to saturate HBM)."""
    if device.type == "cpu":  # the interpreter: small tiles exercise the loops
        return {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    sms = sm_count(device)
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < sms:
        block_n //= 2
    block_k = 256 if k >= 256 else max(16, triton.next_power_of_2(k))
    if dtype == torch.float32:
        block_k = min(block_k, 64)
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 4}


def _launch(x2, weight, prologue: int, norm_weight=None, eps: float = 0.0, k=None, up_offset=0, config=None):
    m = x2.shape[0]
    n = weight.shape[0]
    k = weight.shape[1] if k is None else k
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if m == 0:
        return y
    cfg = dict(config or gemv_config(n, k, weight.dtype, x2.device))
    block_m = max(16, triton.next_power_of_2(m))
    interpret = is_interpreted(x2)
    precision = "ieee"
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    with interpreter_scope(interpret):
        kernel_for(_gemv_kernel, interpret)[grid](
            x2,
            weight,
            y,
            norm_weight if norm_weight is not None else weight,
            m,
            n,
            k,
            x2.stride(0),
            weight.stride(0),
            y.stride(0),
            up_offset,
            float(eps),
            PROLOGUE=prologue,
            BLOCK_M=block_m,
            BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"],
            PRECISION=precision,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
    return y


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight must be [N, {k}], got {tuple(weight.shape)}")


# ------------------------------------------------------------------------------ launchers
def gemv_triton(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """``x @ weight.T`` through the Triton kernel (any rows; meant for decode batches of <= 16)."""
    _check(x, weight, x.shape[-1])
    y = _launch(_rows(x), weight.contiguous() if weight.stride(1) != 1 else weight, _NONE, config=config)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def rmsnorm_linear_triton(x, norm_weight, eps: float, weight, config: dict | None = None) -> torch.Tensor:
    _check(x, weight, x.shape[-1])
    y = _launch(_rows(x), weight, _RMSNORM, norm_weight=norm_weight, eps=eps, config=config)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def silu_mul_linear_triton(gate_up, weight, config: dict | None = None) -> torch.Tensor:
    half = gate_up.shape[-1] // 2
    _check(gate_up[..., :half], weight, half)
    x2 = _rows(gate_up)
    y = _launch(x2, weight, _SILU_MUL, k=half, up_offset=half, config=config)
    return y.reshape(*gate_up.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------------------ references
def rmsnorm_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``models.layers.RMSNorm`` exactly."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return norm_weight * xf.to(x.dtype)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
