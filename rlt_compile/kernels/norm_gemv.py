"""A decode GEMV that normalises its own input: the fused residual-add + RMSNorm kernel folded into
the linear that follows it, accumulated in the GEMV's single pass over the row.

At batch-1 decode the norm kernels between two GEMVs read next to nothing, yet each costs a kernel
boundary and a few dependent memory round trips on the critical path (docs/benchmarks.md, session 8).
Folding the norm into the next GEMV's *prologue* (normalise the row, then multiply) was slower: every
program re-reduces the row before its first multiply (session 11). This kernel never waits for the
norm. Since an RMSNorm only scales its input by one scalar per row, each program multiplies the
unnormalised row and applies the scalars at the end:

* ``rmsnorm``: ``x = norm_b(r)``, ``y = s_r * W (r * g_b)`` with ``s_r = rsqrt(mean(r^2) + eps_b)``.
* ``add_rmsnorm``: ``h = r + d``, ``y = s_h * W (h * g_b)``.
* ``add_rmsnorm2`` (Ouro's sandwich norms): ``h = r + norm_a(d) = r + s_d * d * g_a``, so
  ``W (h * g_b) = W (r * g_b) + s_d * W (d * g_a * g_b)`` (two dot products in one pass) and
  ``sum(h^2) = sum(r^2) + 2 s_d sum(r d g_a) + s_d^2 sum((d g_a)^2)``.

The sums of squares ride along in the same loop (fp32, reduced per chunk like the dot products). One extra program (program 0) writes the residual stream ``h`` exactly as the norm kernel
rounds it (``rmsnorm._norm_row``); it runs beside the GEMV programs, off their path.

Rounding differs from the kernel chain: ``norm_a(d)``, ``h`` and the normalised row are not rounded
to the dtype before the multiply (the stored ``h`` is). In bf16 the outputs stay within the usual
bf16 tolerance of the unfused ops; in fp32 they agree to ~1e-6.

``norm_linear_gemv(...)`` serves one row; with ``rope`` / ``swiglu`` the GEMV's epilogues apply as in
``gemv.linear_gemv``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlt_compile.kernels.gemv import RopeColumns, _output_columns, _store_row, gemv_config, supports_rope
from rlt_compile.kernels.rmsnorm import _add_rows, _norm_row
from rlt_compile.kernels.triton_attention import (
    _interpret,
    _interpreter_scope,
    _kernel,
    _pdl_launch_options,
    _use_pdl,
)

__all__ = ["NORM_MODES", "norm_linear_gemv", "norm_linear_reference"]

# The norm before the linear (``rmsnorm.py``'s ops): the kernel's NORM code.
NORM_MODES = {"rmsnorm": 1, "add_rmsnorm": 2, "add_rmsnorm2": 3}


def _norm_gemv_kernel(
    d_ptr,
    r_ptr,
    wa_ptr,
    wb_ptr,
    h_ptr,
    w_ptr,
    y_ptr,
    N,
    K,
    stride_wn,
    eps_a,
    eps_b,
    cos_ptr,
    sin_ptr,
    rope_lo,
    rope_hi,
    swiglu_half,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NORM: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    SWIGLU: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Programs ``1..`` (``0..`` for ``rmsnorm``, which writes no ``h``): ``BLOCK_N`` output columns of
    ``W norm(...)``; program 0 of the residual modes: the row ``h``."""
    pid = tl.program_id(0)
    if NORM >= 2:
        pid -= 1
    if pid < 0:
        _write_residual(d_ptr, r_ptr, wa_ptr, h_ptr, K, eps_a, BLOCK_H, NORM, USE_PDL)
    else:
        offs_n, mask_n, in_rope = _output_columns(pid, N, rope_lo, rope_hi, swiglu_half, BLOCK_N, ROPE_HALF, SWIGLU)
        offs_k = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
        # weights and norm weights first: no kernel of the step writes them (see gemv.py)
        mask_k = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        g_a = tl.load(wa_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        g_b = tl.load(wb_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc_r = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_d = tl.zeros([BLOCK_N], dtype=tl.float32)
        sq_r = tl.zeros([1], dtype=tl.float32)
        sq_d = tl.zeros([1], dtype=tl.float32)
        dot_rd = tl.zeros([1], dtype=tl.float32)
        sq_e = tl.zeros([1], dtype=tl.float32)
        acc_r, acc_d, sq_r, sq_d, dot_rd, sq_e = _chunk(
            w, d_ptr, r_ptr, offs_k, mask_k, g_a, g_b, acc_r, acc_d, sq_r, sq_d, dot_rd, sq_e, NORM
        )
        for k0 in range(BLOCK_K, K, BLOCK_K):
            kk = k0 + offs_k
            mask_k = kk < K
            w = tl.load(w_rows + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            g_a = tl.load(wa_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)
            g_b = tl.load(wb_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)
            acc_r, acc_d, sq_r, sq_d, dot_rd, sq_e = _chunk(
                w, d_ptr, r_ptr, kk, mask_k, g_a, g_b, acc_r, acc_d, sq_r, sq_d, dot_rd, sq_e, NORM
            )
        if NORM == 3:
            s_d = tl.math.rsqrt(sq_d / K + eps_a)
            sq_h = sq_r + 2.0 * s_d * dot_rd + s_d * s_d * sq_e
            acc = tl.math.rsqrt(sq_h / K + eps_b) * (acc_r + s_d * acc_d)
        else:
            acc = tl.math.rsqrt(sq_r / K + eps_b) * acc_r
        _store_row(acc, y_ptr, pid, offs_n, mask_n, in_rope, cos_ptr, sin_ptr, swiglu_half, BLOCK_N, ROPE_HALF, SWIGLU)


@triton.jit
def _chunk(w, d_ptr, r_ptr, kk, mask_k, g_a, g_b, acc_r, acc_d, sq_r, sq_d, dot_rd, sq_e, NORM: tl.constexpr):
    """One ``BLOCK_K`` chunk of the row: the dot products with the unnormalised input and the sums
    the norms' scales come from (module docstring)."""
    r = tl.load(r_ptr + kk, mask=mask_k, other=0.0)
    wf = w.to(tl.float32)
    if NORM == 3:
        d = tl.load(d_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)
        rf = r.to(tl.float32)
        e = d * g_a
        acc_r += tl.sum(wf * (rf * g_b)[None, :], axis=1)
        acc_d += tl.sum(wf * (e * g_b)[None, :], axis=1)
        sq_r += tl.sum(rf * rf, axis=0)
        sq_d += tl.sum(d * d, axis=0)
        dot_rd += tl.sum(rf * e, axis=0)
        sq_e += tl.sum(e * e, axis=0)
    else:
        if NORM == 2:  # h = r + d, rounded as the residual stream is
            r = _add_rows(r, tl.load(d_ptr + kk, mask=mask_k, other=0.0))
        rf = r.to(tl.float32)
        acc_r += tl.sum(wf * (rf * g_b)[None, :], axis=1)
        sq_r += tl.sum(rf * rf, axis=0)
    return acc_r, acc_d, sq_r, sq_d, dot_rd, sq_e


@triton.jit
def _write_residual(
    d_ptr, r_ptr, wa_ptr, h_ptr, K, eps_a, BLOCK_H: tl.constexpr, NORM: tl.constexpr, USE_PDL: tl.constexpr
):
    """``h = r + d`` or ``h = r + norm_a(d)``, the whole row, rounded like the norm kernel."""
    offs = tl.arange(0, BLOCK_H)
    mask = offs < K
    g_a = tl.load(wa_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    v = tl.load(d_ptr + offs, mask=mask, other=0.0)
    if NORM == 3:
        v = _norm_row(v, g_a, K, eps_a)
    tl.store(h_ptr + offs, _add_rows(tl.load(r_ptr + offs, mask=mask, other=0.0), v), mask=mask)


def norm_linear_reference(
    mode: str,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_b: torch.Tensor,
    eps_b: float,
    d: torch.Tensor | None = None,
    norm_a: torch.Tensor | None = None,
    eps_a: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unfused ops: ``(F.linear(x, weight), h)`` with ``h, x`` from ``rmsnorm.py``'s references."""
    from rlt_compile.kernels import rmsnorm

    if mode == "rmsnorm":
        h, x = None, rmsnorm.rmsnorm_reference(residual, norm_b, eps_b)
    elif mode == "add_rmsnorm":
        h, x = rmsnorm.add_rmsnorm_reference(d, residual, norm_b, eps_b)
    else:
        h, x = rmsnorm.add_rmsnorm2_reference(d, residual, norm_a, norm_b, eps_a, eps_b)
    return torch.nn.functional.linear(x, weight), h


def norm_linear_gemv(
    mode: str,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_b: torch.Tensor,
    eps_b: float,
    d: torch.Tensor | None = None,
    norm_a: torch.Tensor | None = None,
    eps_a: float = 0.0,
    rope: RopeColumns | None = None,
    swiglu: bool = False,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``weight @ x`` for one row, ``x`` the ``mode`` norm's output (``NORM_MODES``): ``rmsnorm``
    normalises ``residual``; ``add_rmsnorm`` ``h = residual + d``; ``add_rmsnorm2`` ``h = residual +
    norm_a(d)``. Returns ``(y [1, N], h [1, K] or None)``; ``rope`` / ``swiglu`` as in ``linear_gemv``.
    CPU tensors run Triton's interpreter."""
    if mode not in NORM_MODES:
        raise ValueError(f"norm_linear_gemv: mode {mode!r} is not one of {sorted(NORM_MODES)}")
    n, k = weight.shape
    code = NORM_MODES[mode]
    rows = [("residual", residual), ("norm_b", norm_b)]
    if code >= 2:
        rows.append(("d", d))
    if code == 3:
        rows.append(("norm_a", norm_a))
    problems = [f"{name} missing" for name, t in rows if t is None]
    problems += [
        f"{name} {tuple(t.shape)} {t.dtype}"
        for name, t in rows
        if t is not None and (t.numel() != k or t.dtype != weight.dtype or not t.is_contiguous())
    ]
    if weight.stride(1) != 1:
        problems.append(f"weight stride {weight.stride()}")
    if rope is not None and not supports_rope(residual.reshape(1, k), weight, rope):
        problems.append(f"rope columns [{rope.lo}, {rope.hi}) of head_dim {rope.head_dim}")
    if problems:
        raise ValueError(
            f"norm_linear_gemv ({mode}) needs one contiguous row of {k} per input in the weight's dtype "
            f"{weight.dtype}; got " + ", ".join(problems)
        )
    cfg = gemv_config(1, n, k, weight.dtype, weight.device)
    cfg.update(config or {})
    if swiglu and (n % 2 or cfg["block_n"] % 2 or rope is not None):
        raise ValueError(f"norm_linear_gemv with swiglu needs an even number of outputs and of columns per tile: {cfg}")
    if rope is not None and (rope.lo % cfg["block_n"] or (rope.hi - rope.lo) % cfg["block_n"]):
        raise ValueError(f"norm_linear_gemv with rope: column tiles must not split a rotary pair: {cfg}")
    n_out = n // 2 if swiglu else n
    y = weight.new_empty((1, n_out))
    h = weight.new_empty((1, k)) if code >= 2 else None
    d_arg = d if d is not None else residual
    interpret = _interpret(weight)
    pdl = _use_pdl(weight)
    with _interpreter_scope(interpret):
        _kernel(_norm_gemv_kernel, interpret)[(triton.cdiv(n, cfg["block_n"]) + (code >= 2),)](
            d_arg,
            residual,
            norm_a if norm_a is not None else norm_b,
            norm_b,
            h if h is not None else y,
            weight,
            y,
            n,
            k,
            weight.stride(0),
            float(eps_a),
            float(eps_b),
            rope.cos if rope is not None else y,
            rope.sin if rope is not None else y,
            rope.lo if rope is not None else 0,
            rope.hi if rope is not None else 0,
            n_out,
            BLOCK_N=cfg["block_n"],
            BLOCK_K=cfg["block_k"],
            BLOCK_H=triton.next_power_of_2(k),
            NORM=code,
            ROPE_HALF=rope.head_dim // 2 if rope is not None else 0,
            SWIGLU=swiglu,
            USE_PDL=pdl,
            num_warps=cfg["warps"],
            num_stages=cfg["stages"],
            **_pdl_launch_options(pdl),
        )
    return y, h
