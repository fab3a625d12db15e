"""Fused residual-add + RMSNorm: one Triton kernel and the ``rlt::*rmsnorm*`` custom ops.

Every op rounds exactly like the eager model (``models/layers.py: RMSNorm``) in the input dtype:
the norm squares, averages and normalises in fp32, casts back to the dtype, then multiplies by the
weight in the dtype (the fp32 product of two 16-bit values is exact, so "fp32 multiply, then one
rounding" is the dtype's multiply); the residual add is one dtype add. Only the order of the sum
of squares differs from eager (a tree reduction), so results match eager to the fp32 rounding of
that sum.

Ops (weights are 1-D ``[hidden]`` of the input's dtype; inputs ``[..., hidden]``, same shape):

* ``rlt::rmsnorm(x, weight, eps) -> out``
* ``rlt::add_rmsnorm(y, residual, weight, eps) -> (h, out)``: ``h = residual + y``,
  ``out = rmsnorm(h)`` (pre-norm layers: Nanbeige / Llama).
* ``rlt::add_rmsnorm2(y, residual, weight_a, weight_b, eps_a, eps_b) -> (h, out)``:
  ``h = residual + rmsnorm_a(y)``, ``out = rmsnorm_b(h)`` (Ouro's sandwich norms: a sublayer's
  post-norm, the residual add and the next sublayer's pre-norm or ``model.norm``).
* ``rlt::add_rmsnorm_rmsnorm(y, residual, weight_a, weight_b, eps_a, eps_b) -> (h, out)``:
  ``h = rmsnorm_a(residual + y)``, ``out = rmsnorm_b(h)`` (Huginn's blocks renormalise the
  residual stream, then the next sublayer normalises it again).

One kernel serves all four (constexpr flags pick the stages); one program per row, the whole row
in registers (``BLOCK = next_power_of_2(hidden)``, masked; hidden sizes up to Huginn's 5280).
On CUDA/ROCm tensors the ops launch the kernel; on CPU tensors they run the torch reference (the
``fuse_rmsnorm`` pass only rewrites graphs for GPUs; Inductor's CPU code is one loop already).
The launchers themselves accept CPU tensors and then run Triton's interpreter (tests; fp32/fp16
only: bf16 is not exact there).

PDL: on CUDA tensors with ``platform.pdl_enabled()`` the kernel is launched with ``launch_pdl`` and
calls ``gdc_launch_dependents()`` + ``gdc_wait()`` before it reads the activations, like the
attention kernels (``triton_attention``'s module docstring); the norm weights (parameters, which no
kernel of a step writes) are read before the wait, as the decode GEMV reads its weights. After the
wait the input row and the residual row load together, so each kernel waits for one memory round
trip before its reductions (``_EARLY_RESIDUAL``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlt_compile.kernels.launch import (
    interpreter_scope,
    is_interpreted,
    kernel_for,
    pdl_launch_options,
    pdl_mode,
    pdl_trigger_first,
    pdl_wait,
)

__all__ = [
    "add_rmsnorm2_reference",
    "add_rmsnorm2_triton",
    "add_rmsnorm_reference",
    "add_rmsnorm_rmsnorm_reference",
    "add_rmsnorm_rmsnorm_triton",
    "add_rmsnorm_triton",
    "rmsnorm_reference",
    "rmsnorm_triton",
]

# RESIDUAL: where the residual add happens relative to norm a.
_NO_RESIDUAL, _ADD_BEFORE_NORM, _ADD_AFTER_NORM = 0, 1, 2
# With the add after norm a (Ouro), load the residual row together with the input row, so the kernel
# waits for one memory round trip before its first reduction, not one before and one after it. The
# old order stays selectable for A/B runs (benchmarks/gemv_chain_bench.py --variants; H200, session
# 19: Ouro chain 3.660 vs 3.684 ms).
_EARLY_RESIDUAL = True


# ----------------------------------------------------------------------------------------------
# Kernel (a plain function; wrapped with JITFunction / InterpretedFunction on first use)
# ----------------------------------------------------------------------------------------------


def _fused_rmsnorm_kernel(
    y_ptr,
    res_ptr,
    wa_ptr,
    wb_ptr,
    h_ptr,
    out_ptr,
    n_cols,
    stride_y,
    stride_r,
    stride_h,
    stride_o,
    eps_a,
    eps_b,
    BLOCK: tl.constexpr,
    NORM_A: tl.constexpr,
    RESIDUAL: tl.constexpr,
    NORM_B: tl.constexpr,
    EARLY_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Per row: ``v = y``; [RESIDUAL == 1: ``v = r + v``]; [NORM_A: ``v = norm_a(v)``];
    [RESIDUAL == 2: ``v = r + v``]; store ``v`` to ``h``; [NORM_B: store ``norm_b(v)`` to ``out``]."""
    pdl_trigger_first(USE_PDL)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    # The norm weights are parameters, never written by the previous kernel: read them before the
    # PDL wait, so their latency overlaps the previous kernel instead of following the reduction.
    if NORM_A:
        w_a = tl.load(wa_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM_B:
        w_b = tl.load(wb_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    v = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0)
    dtype = v.dtype
    if (RESIDUAL == 1) | ((RESIDUAL == 2) & EARLY_RESIDUAL):
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
    if RESIDUAL == 1:
        v = (r.to(tl.float32) + v.to(tl.float32)).to(dtype)
    if NORM_A:
        xf = v.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps_a)
        v = (w_a * (xf * rstd).to(dtype).to(tl.float32)).to(dtype)
    if RESIDUAL == 2:
        if not EARLY_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        v = (r.to(tl.float32) + v.to(tl.float32)).to(dtype)
    tl.store(h_ptr + row * stride_h + offs, v, mask=mask)
    if NORM_B:
        xf = v.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps_b)
        tl.store(out_ptr + row * stride_o + offs, (w_b * (xf * rstd).to(dtype).to(tl.float32)).to(dtype), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as ``[rows, n]`` with unit stride along the row (a view when possible)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _num_warps(block: int) -> int:
    return max(1, min(block // 256, 16))


def _launch(
    y: torch.Tensor,
    residual: torch.Tensor | None,
    weight_a: torch.Tensor | None,
    weight_b: torch.Tensor | None,
    eps_a: float,
    eps_b: float,
    residual_mode: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = y.shape[-1]
    for name, t in (("residual", residual), ("weight_a", weight_a), ("weight_b", weight_b)):
        if t is None:
            continue
        if t.dtype != y.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != input dtype {y.dtype}")
        if name == "residual" and t.shape != y.shape:
            raise ValueError(f"residual shape {tuple(t.shape)} != input shape {tuple(y.shape)}")
        if name != "residual" and tuple(t.shape) != (n,):
            raise ValueError(f"{name} must be [{n}], got {tuple(t.shape)}")
    h = y.new_empty(y.shape)
    out = y.new_empty(y.shape) if weight_b is not None else None
    if y.numel() == 0:
        return h, out
    y2 = _rows(y, n)
    r2 = _rows(residual, n) if residual is not None else y2
    h2, o2 = h.view(-1, n), (out.view(-1, n) if out is not None else h.view(-1, n))
    wa = weight_a.contiguous() if weight_a is not None else y2
    wb = weight_b.contiguous() if weight_b is not None else y2
    block = triton.next_power_of_2(n)
    interpret = is_interpreted(y)
    pdl = pdl_mode(y)
    with interpreter_scope(interpret):
        kernel_for(_fused_rmsnorm_kernel, interpret)[(y2.shape[0],)](
            y2,
            r2,
            wa,
            wb,
            h2,
            o2,
            n,
            y2.stride(0),
            r2.stride(0),
            h2.stride(0),
            o2.stride(0),
            float(eps_a),
            float(eps_b),
            BLOCK=block,
            NORM_A=weight_a is not None,
            RESIDUAL=residual_mode,
            NORM_B=weight_b is not None,
            EARLY_RESIDUAL=_EARLY_RESIDUAL,
            USE_PDL=pdl,
            num_warps=_num_warps(block),
            enable_fp_fusion=False,  # no FMA across the product and the residual add (fp32: eager rounds both)
            **pdl_launch_options(pdl),
        )
    return h, out


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rmsnorm(x) * weight`` (CPU tensors: Triton's interpreter)."""
    return _launch(x, None, weight, None, eps, 0.0, _NO_RESIDUAL)[0]


def add_rmsnorm_triton(
    y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + y``, ``out = rmsnorm(h) * weight``."""
    return _launch(y, residual, None, weight, 0.0, eps, _ADD_BEFORE_NORM)


def add_rmsnorm2_triton(
    y: torch.Tensor,
    residual: torch.Tensor,
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    eps_a: float,
    eps_b: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + rmsnorm_a(y)``, ``out = rmsnorm_b(h)``."""
    return _launch(y, residual, weight_a, weight_b, eps_a, eps_b, _ADD_AFTER_NORM)


def add_rmsnorm_rmsnorm_triton(
    y: torch.Tensor,
    residual: torch.Tensor,
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    eps_a: float,
    eps_b: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = rmsnorm_a(residual + y)``, ``out = rmsnorm_b(h)``."""
    return _launch(y, residual, weight_a, weight_b, eps_a, eps_b, _ADD_BEFORE_NORM)


# ----------------------------------------------------------------------------------------------
# Torch references (the model's arithmetic, op for op)
# ----------------------------------------------------------------------------------------------


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rmsnorm_reference(y, residual, weight, eps):
    h = residual + y
    return h, rmsnorm_reference(h, weight, eps)


def add_rmsnorm2_reference(y, residual, weight_a, weight_b, eps_a, eps_b):
    h = residual + rmsnorm_reference(y, weight_a, eps_a)
    return h, rmsnorm_reference(h, weight_b, eps_b)


def add_rmsnorm_rmsnorm_reference(y, residual, weight_a, weight_b, eps_a, eps_b):
    h = rmsnorm_reference(residual + y, weight_a, eps_a)
    return h, rmsnorm_reference(h, weight_b, eps_b)


# ----------------------------------------------------------------------------------------------
# Custom ops: Triton on GPU tensors, the reference on CPU tensors
# ----------------------------------------------------------------------------------------------


def _on_gpu(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"  # ROCm tensors are "cuda" tensors too


@torch.library.custom_op("rlt::rmsnorm", mutates_args=())
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _on_gpu(x):
        return rmsnorm_triton(x, weight, eps)
    return rmsnorm_reference(x, weight, eps).contiguous()


@torch.library.custom_op("rlt::add_rmsnorm", mutates_args=())
def add_rmsnorm(
    y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_gpu(y):
        return add_rmsnorm_triton(y, residual, weight, eps)
    return tuple(t.contiguous() for t in add_rmsnorm_reference(y, residual, weight, eps))


@torch.library.custom_op("rlt::add_rmsnorm2", mutates_args=())
def add_rmsnorm2(
    y: torch.Tensor,
    residual: torch.Tensor,
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    eps_a: float,
    eps_b: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_gpu(y):
        return add_rmsnorm2_triton(y, residual, weight_a, weight_b, eps_a, eps_b)
    return tuple(t.contiguous() for t in add_rmsnorm2_reference(y, residual, weight_a, weight_b, eps_a, eps_b))


@torch.library.custom_op("rlt::add_rmsnorm_rmsnorm", mutates_args=())
def add_rmsnorm_rmsnorm(
    y: torch.Tensor,
    residual: torch.Tensor,
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    eps_a: float,
    eps_b: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_gpu(y):
        return add_rmsnorm_rmsnorm_triton(y, residual, weight_a, weight_b, eps_a, eps_b)
    return tuple(t.contiguous() for t in add_rmsnorm_rmsnorm_reference(y, residual, weight_a, weight_b, eps_a, eps_b))


# Fake impls: fresh contiguous tensors shaped like the input (what both real impls return).
@rmsnorm.register_fake
def _rmsnorm_fake(x, weight, eps):
    return x.new_empty(x.shape)


@add_rmsnorm.register_fake
def _add_rmsnorm_fake(y, residual, weight, eps):
    return y.new_empty(y.shape), y.new_empty(y.shape)


def _two_norm_fake(y, residual, weight_a, weight_b, eps_a, eps_b):
    return y.new_empty(y.shape), y.new_empty(y.shape)


add_rmsnorm2.register_fake(_two_norm_fake)
add_rmsnorm_rmsnorm.register_fake(_two_norm_fake)
