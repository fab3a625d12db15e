"""Decode linears (GEMVs) in Triton, launched early through PDL, reading their weights first.

At batch-1 decode every linear ``y = x @ W.T`` reads ``W`` once and is bound by that read, but a
single GEMV of a few MB cannot reach HBM bandwidth on its own: its first bytes arrive only after
its launch, and its predecessor's tail leaves the GPU idle. With PDL (Programmatic Dependent
Launch, see ``triton_attention``'s docstring) this kernel is launched while its predecessor still
runs (cuBLAS GEMVs neither let their successor launch early nor start early themselves), and each
program loads its first weight tile *before* ``gdc_wait()``: the weights never depend on the
previous kernel. Only the activations (a few KB) are read after the wait. Measured on the H200's
Ouro decode chain (``benchmarks/gemv_chain_bench.py``): 1.18x over cuBLAS GEMVs, of which the early
weight tile is under 1%; the rest is the early launch and small tiles (2 output columns per
program at one row: thousands of programs keep many loads in flight).

``linear_gemv(x, weight, silu_mul=False)`` handles up to ``MAX_ROWS`` rows: one row without ``tl.dot``
(a multiply + sum in fp32), more rows as a ``tl.dot`` tile padded to 16 rows. Accumulation is fp32
with one rounding to the output dtype, like cuBLAS; only the summation order differs. ``silu_mul=True`` forms the input itself from a SwiGLU's gate/up
row (``silu(gate) * up``, rounded like eager), so the down projection needs no separate kernel.
``rlt::linear_small`` and ``rlt::silu_mul_linear_small`` wrap it as a custom op whose implementation falls
back to ``F.linear`` for more than ``OP_MAX_ROWS`` rows, non-CUDA tensors or unsupported layouts, so
graphs with any batch bucket stay valid; the ``gemv_swap`` pass puts it in place of the decode linears.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rlt_compile import envs
from rlt_compile.kernels.launch import (
    interpreter_scope,
    is_interpreted,
    kernel_for,
    pdl_launch_options,
    pdl_mode,
    pdl_trigger_first,
    pdl_wait,
    sm_count,
)
from rlt_compile.kernels.reference import apply_rope_half

__all__ = [
    "CONFIG_KEYS",
    "MAX_ROWS",
    "RopeColumns",
    "gemv_config",
    "linear_gemv",
    "linear_small",
    "rope_columns_reference",
    "rope_columns_triton",
    "rope_linear_small",
    "silu_gate_triton",
    "silu_mul_linear_small",
    "supports_gemv",
    "swiglu_linear_small",
    "supports_rope",
]

MAX_ROWS = 16
# The custom ops send at most this many rows to Triton and more to cuBLAS: on the H200 the 16-row
# tl.dot tile ran 1.1-1.6x slower than cuBLAS at 2-8 rows on Nanbeige's linears, and a dot-free
# multiply + sum broadcast over 2-4 rows 1.8-6.5x slower (docs/benchmarks.md, session 6).
OP_MAX_ROWS = 1
# The rotary epilogue's cos/sin load with the activations, right after the PDL wait, instead of after
# the loop (a dependent memory round trip at the kernel's tail). The old order stays selectable for
# A/B runs (benchmarks/gemv_chain_bench.py --variants; H200, session 19: Ouro chain 3.660 vs 3.698 ms).
_EARLY_ROPE = True
# Keys of ``linear_gemv``'s ``config`` and of ``RLT_GEMV_CONFIG`` (``gemv_config`` gives the defaults).
CONFIG_KEYS = frozenset({"block_n", "block_k", "warps", "stages", "prefetch", "dot", "acc_2d"})
# ``RLT_GEMV_CONFIG`` only: apply an entry to the weights of this many rows / columns only (one shape's A/B;
# entries for several shapes are separated by ``;``).
SHAPE_KEYS = frozenset({"only_n", "only_k"})
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    up_offset,
    cos_ptr,
    sin_ptr,
    rope_lo,
    rope_hi,
    swiglu_half,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    SILU_MUL: tl.constexpr,
    USE_DOT: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    SWIGLU: tl.constexpr,
    EARLY_ROPE: tl.constexpr,
    ACC_2D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_trigger_first(USE_PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if SWIGLU:  # outputs j of the program from gate row j and up row swiglu_half + j, interleaved
        offs_out = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        offs_n = offs_out + (tl.arange(0, BLOCK_N) % 2) * swiglu_half
    if ROPE_HALF > 0:  # columns in [rope_lo, rope_hi): each program takes whole (d, d + half) pairs
        in_rope = (pid * BLOCK_N >= rope_lo) & (pid * BLOCK_N < rope_hi)
        pair = (pid * BLOCK_N - rope_lo + tl.arange(0, BLOCK_N)) // 2
        rope_cols = rope_lo + (pair // ROPE_HALF) * (2 * ROPE_HALF) + pair % ROPE_HALF
        rope_cols += (tl.arange(0, BLOCK_N) % 2) * ROPE_HALF
        offs_n = tl.where(in_rope, rope_cols, offs_n)
    mask_n = offs_n < N
    if SWIGLU:
        mask_n = offs_out < swiglu_half
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    if PREFETCH:  # the weights do not depend on the previous kernel: read them before waiting
        w_first = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k[None, :] < K), other=0.0)
    pdl_wait(USE_PDL)
    if (ROPE_HALF > 0) & EARLY_ROPE:  # with the activations, not after the loop: one round trip fewer
        cos, sin = _rope_factors(offs_n, cos_ptr, sin_ptr, ROPE_HALF, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    if ACC_2D:  # one row: each lane's fp32 partial sums, reduced across lanes once after the loop
        acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    start = 0
    if PREFETCH:
        x = _activations(x_rows, offs_k, mask_m[:, None] & (offs_k[None, :] < K), up_offset, SILU_MUL)
        acc += _tile_product(x, w_first, USE_DOT, ACC_2D)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        w = tl.load(w_rows + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = _activations(x_rows, kk, mask_m[:, None] & mask_k[None, :], up_offset, SILU_MUL)
        acc += _tile_product(x, w, USE_DOT, ACC_2D)
    if ACC_2D:
        acc = tl.sum(acc, axis=1)
    if BLOCK_M == 1:
        out = acc.to(y_ptr.dtype.element_ty)
        if ROPE_HALF > 0:
            if not EARLY_ROPE:
                cos, sin = _rope_factors(offs_n, cos_ptr, sin_ptr, ROPE_HALF, BLOCK_N)
            out = tl.where(in_rope, _rotate_pairs(out, cos, sin, BLOCK_N), out)
        if SWIGLU:
            gate, up = tl.split(tl.reshape(out, [BLOCK_N // 2, 2]))
            offs_y = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(y_ptr + offs_y, _silu_gate(gate, up), mask=offs_y < swiglu_half)
        else:
            tl.store(y_ptr + offs_n, out, mask=mask_n)
    else:
        y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _rope_factors(cols, cos_ptr, sin_ptr, ROPE_HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cos/sin ``[BLOCK_N // 2]`` of the program's output column pairs ``(d, d + half)``: a
    pair's frequency index (outside the rotary columns any in-bounds index; the result is discarded)."""
    j, _ = tl.split(tl.reshape(cols % ROPE_HALF, [BLOCK_N // 2, 2]))
    return tl.load(cos_ptr + j), tl.load(sin_ptr + j)


@triton.jit
def _rotate_pairs(y, cos, sin, BLOCK_N: tl.constexpr):
    """Rotate-half rotary on one row's output columns, laid out as pairs ``(d, d + half)`` of a
    head: ``(a, b) -> (a cos - b sin, b cos + a sin)`` in fp32 on the rounded outputs with cos/sin
    rounded to the output dtype (the model's ``apply_rope_half`` as Inductor computes it), rounded
    once."""
    lo, hi = tl.split(tl.reshape(y.to(tl.float32), [BLOCK_N // 2, 2]))
    a, b = _rotate(lo, hi, cos, sin, y.dtype)
    return tl.reshape(tl.join(a, b), [BLOCK_N]).to(y.dtype)


@triton.jit
def _rotate(a, b, cos, sin, dtype: tl.constexpr):
    """``(a cos - b sin, b cos + a sin)`` in fp32, cos/sin first rounded to ``dtype`` (the rounding of
    the models' ``apply_rope_half``, whose tables are cast to the activations' dtype)."""
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    a, b = a.to(tl.float32), b.to(tl.float32)
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def _tile_product(x, w, USE_DOT: tl.constexpr, ACC_2D: tl.constexpr):
    """``x [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K].T`` in fp32: one row as a ``[BLOCK_N]`` multiply +
    sum (no ``tl.dot``: its 16-row padding and shared-memory staging cost more than the weight read
    at one row), or with ``ACC_2D`` the ``[BLOCK_N, BLOCK_K // 8]`` sums of 8 consecutive products
    (what one 16-byte load gives a lane: no cross-lane reduction), summed by the caller after its
    loop; more rows as ``tl.dot`` on a 16-row tile."""
    if USE_DOT:
        product = tl.dot(x.to(w.dtype), tl.trans(w), input_precision="ieee")
    elif ACC_2D:  # each lane's 8 consecutive products (one 16-byte load) summed in its registers
        product = w.to(tl.float32) * x.to(tl.float32)
        product = tl.sum(tl.reshape(product, [product.shape[0], product.shape[1] // 8, 8]), axis=2)
    else:
        product = tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)
    return product


@triton.jit
def _activations(x_rows, kk, mask, up_offset, SILU_MUL: tl.constexpr):
    """The GEMV's input columns ``kk``: ``x`` itself, or ``silu(gate) * up`` from a gate/up row
    (``up`` at ``up_offset``), rounded like the eager ``F.silu(gate) * up`` in the input dtype."""
    x = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
    if SILU_MUL:
        x = _silu_gate(x, tl.load(x_rows + up_offset + kk[None, :], mask=mask, other=0.0))
    return x


@triton.jit
def _silu_gate(gate, up):
    """``silu(gate) * up`` rounded like the eager ``F.silu(gate) * up`` in the inputs' dtype: the SiLU
    in fp32 rounded once, the product in fp32 rounded once."""
    g = gate.to(tl.float32)
    act = (g * tl.sigmoid(g)).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)


def _silu_gate_kernel(y_ptr, out_ptr, stride_y, stride_out, half, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """``out[r, j] = silu(y[r, j]) * y[r, half + j]`` (``_silu_gate``); grid: rows x column
    blocks. The SwiGLU op's path for more rows than the GEMV serves."""
    pdl_trigger_first(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < half
    y_row = y_ptr + row * stride_y
    gate = tl.load(y_row + cols, mask=mask, other=0.0)
    up = tl.load(y_row + half + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, _silu_gate(gate, up), mask=mask)


def _rope_columns_kernel(
    y_ptr,
    cos_ptr,
    sin_ptr,
    stride_y,
    stride_c,
    lo,
    n_pairs,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """In place on ``y [rows, N]``: the rotate-half rotary of columns ``[lo, lo + 2 * n_pairs)``
    (heads of ``2 * HALF``), rounded like the GEMV's epilogue (``_rotate_pairs``). Grid: rows x
    pair blocks. The op's path for more rows than the GEMV serves."""
    pdl_trigger_first(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    pair = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = pair < n_pairs
    j = pair % HALF
    cols = lo + (pair // HALF) * (2 * HALF) + j
    y_row = y_ptr + row * stride_y
    a = tl.load(y_row + cols, mask=mask, other=0.0)
    b = tl.load(y_row + cols + HALF, mask=mask, other=0.0)
    cos = tl.load(cos_ptr + row * stride_c + j, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + row * stride_c + j, mask=mask, other=0.0)
    ra, rb = _rotate(a, b, cos, sin, a.dtype)
    tl.store(y_row + cols, ra.to(a.dtype), mask=mask)
    tl.store(y_row + cols + HALF, rb.to(a.dtype), mask=mask)


def gemv_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, silu_mul: bool = False) -> dict:
    """Tiles from shapes only (CUDA-graph safe). One row: no ``tl.dot``, 2 output columns per program
    and a 1024-long run of each weight row per load, 2048-long for rows of 4096 or more unless that
    splits a grid resident at once into two waves (``_long_runs_add_a_wave``). Measured on the H200
    (docs/benchmarks.md, session 13, with the early PDL trigger): Ouro's down projection 1.03x on the
    decode chain (same run); end to end, Nanbeige 0.95x under plain 2048-long runs (same run), whose
    1536-program o and down grids they split, and across calls Ouro and Huginn about 1.03x and 1.05x.
    More rows: a ``tl.dot`` tile of 16 columns x 256 (checked
    spill-free within 64 KiB of shared memory by ``kernels/aot.py``; half as long with the SiLU
    gate, whose extra operand spilled registers on sm_90 at 256). The prefetched first tile is
    ``block_n x block_k``. ``acc_2d`` (16-bit rows on the GPU): one row reduces across lanes once
    after its loop instead of per tile, so no reduction and barrier sit between its weight loads
    (sm_90: 30-32 registers, as without it). Measured on the H200 (docs/benchmarks.md, session 19,
    same call): Ouro-1.4B 3.583 vs 3.764 ms/token, Nanbeige 3.678 vs 3.847. A one-row weight whose
    2-column grid fills at most half the resident programs (``_fills_half_a_wave``) takes 4 columns
    per program, 2048-long runs and 8 warps: Ouro's o and down projections (2048 x 2048 and
    2048 x 5632, 1024 programs on 132 SMs); rows longer than 4096 take 4096-long runs (two loads
    of Ouro's 5632-long down rows, not three). End to end (docs/benchmarks.md): the o tile gave
    Ouro-1.4B 3.448 against 3.491 ms/token on the H200 (session 22), the down tile 4.351 against
    4.372-4.375 on the H100 (session 23), its 4096-long runs 4.339 against 4.372 (H100, session 25,
    same process; 1024-long runs: 4.571); on Ouro's q/k/v and gate/up GEMVs (grids of 1536 and 2816
    such programs) the same tile was 1-3% slower."""
    dot = m > 1
    acc_2d, warps = False, 4
    if device.type == "cpu":  # the interpreter: small tiles exercise the loops
        block_n, block_k, stages = 16, 32, 1
    else:
        acc_2d = not dot and dtype != torch.float32
        if dot:  # tl.dot tiles are staged through shared memory: keep 3 stages within 64 KiB (gfx942)
            block_n, block_k = 16, (256 if dtype != torch.float32 else 64) // (2 if silu_mul else 1)
        elif dtype == torch.float32:
            block_n, block_k = 2, 256
        elif _fills_half_a_wave(n // 2, device):
            block_n, block_k, warps = 4, (4096 if k > 4096 else 2048), 8
        else:
            block_n, block_k = 2, (2048 if k >= 4096 and not _long_runs_add_a_wave(n // 2, device) else 1024)
        block_k, stages = min(block_k, max(16, triton.next_power_of_2(k))), 3
    return dict(block_n=block_n, block_k=block_k, warps=warps, stages=stages, prefetch=True, dot=dot, acc_2d=acc_2d)


# Resident one-row programs per SM on sm_90 (kernels/aot.py): 1024-long runs use ~31 registers, so the
# 64-warp limit allows 16 programs of 4 warps; 2048-long runs use ~47, which allows 10.
_PROGRAMS_PER_SM_SHORT, _PROGRAMS_PER_SM_LONG = 16, 10


def _fills_half_a_wave(programs: int, device: torch.device) -> bool:
    """Whether a grid of ``programs`` short-run programs fills at most half of what the SMs hold at
    once: there, fewer programs each keeping a whole 4-column tile in flight read faster."""
    return programs <= _PROGRAMS_PER_SM_SHORT * sm_count(device) // 2


def _long_runs_add_a_wave(programs: int, device: torch.device) -> bool:
    """Whether a grid of ``programs`` that is resident at once with 1024-long runs would need a
    second wave with 2048-long ones. Long runs read twice the weights per program before its PDL
    wait and keep more bytes in flight; they lost only where they split a single wave (Nanbeige's
    o and down projections, 1536 programs: 0.95x; docs/benchmarks.md, session 13)."""
    sms = sm_count(device)
    return _PROGRAMS_PER_SM_LONG * sms < programs <= _PROGRAMS_PER_SM_SHORT * sms


@dataclass(frozen=True)
class RopeColumns:
    """Output columns ``[lo, hi)`` of a linear hold whole heads of ``head_dim`` to rotate with
    rotate-half rotary; ``cos``/``sin`` are the model's ``[T, head_dim // 2]`` fp32 tables."""

    cos: torch.Tensor
    sin: torch.Tensor
    lo: int
    hi: int
    head_dim: int


def supports_rope(x: torch.Tensor, weight: torch.Tensor, rope: RopeColumns) -> bool:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    half = rope.head_dim // 2
    return (
        rows == 1
        and rope.head_dim % 2 == 0
        and 0 <= rope.lo < rope.hi <= weight.shape[0]
        and (rope.hi - rope.lo) % rope.head_dim == 0
        and tuple(rope.cos.shape) == tuple(rope.sin.shape) == (1, half)
        and rope.cos.is_contiguous()
        and rope.sin.is_contiguous()
    )


def rope_columns_reference(y: torch.Tensor, rope: RopeColumns) -> torch.Tensor:
    """``y`` with columns ``[lo, hi)`` rotated per head exactly as the models' eager
    ``apply_rope_half`` does (in ``y``'s dtype); the other columns unchanged."""
    rows = y.reshape(-1, y.shape[-1])
    region = rows[:, rope.lo : rope.hi].reshape(rows.shape[0], -1, rope.head_dim)
    rotated = apply_rope_half(region, rope.cos, rope.sin).reshape(rows.shape[0], -1)
    out = torch.cat([rows[:, : rope.lo], rotated, rows[:, rope.hi :]], dim=-1)
    return out.reshape(y.shape)


def rope_columns_triton(y: torch.Tensor, rope: RopeColumns) -> torch.Tensor:
    """``rope_columns_reference`` as one Triton launch, in place on ``y`` ``[rows, N]`` (contiguous
    rows; ``cos``/``sin`` ``[rows, head_dim // 2]``); returns ``y``."""
    rows = y.shape[0]
    half = rope.head_dim // 2
    n_pairs = (rope.hi - rope.lo) // 2
    block = min(1024, triton.next_power_of_2(max(n_pairs, 1)))
    interpret = is_interpreted(y)
    pdl = pdl_mode(y)
    cos, sin = rope.cos.contiguous(), rope.sin.contiguous()
    with interpreter_scope(interpret):
        kernel_for(_rope_columns_kernel, interpret)[(rows, triton.cdiv(n_pairs, block))](
            y,
            cos,
            sin,
            y.stride(0),
            cos.stride(0),
            rope.lo,
            n_pairs,
            HALF=half,
            BLOCK=block,
            USE_PDL=pdl,
            num_warps=4,
            **pdl_launch_options(pdl),
        )
    return y


def supports_gemv(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> bool:
    """Whether ``linear_gemv`` serves this call (else ``F.linear`` does). With ``silu_mul`` the
    input is a gate/up row ``[..., 2K]``."""
    k = x.shape[-1] // 2 if silu_mul else x.shape[-1]
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        weight.dim() == 2
        and weight.stride(1) == 1
        and x.dtype == weight.dtype
        and weight.dtype in _DTYPES
        and 0 < rows <= MAX_ROWS
        and k == weight.shape[1]
        and (not silu_mul or x.shape[-1] == 2 * k)
    )


def _overrides(n: int, k: int, config: dict | None) -> dict:
    """The first ``RLT_GEMV_CONFIG`` entry whose ``only_n`` / ``only_k`` match the weight's ``[n, k]``
    (or that names no shape), under ``config``; unknown keys in any entry are a ValueError."""
    entries = envs.rlt_gemv_configs()
    unknown = set(config or {}) - CONFIG_KEYS
    for entry in entries:
        unknown |= set(entry) - CONFIG_KEYS - SHAPE_KEYS
    if unknown:
        raise ValueError(
            f"unknown GEMV config keys {sorted(unknown)} (config or RLT_GEMV_CONFIG); valid: {sorted(CONFIG_KEYS)}"
            f", and in RLT_GEMV_CONFIG {sorted(SHAPE_KEYS)}"
        )
    env = next((e for e in entries if e.get("only_n", n) == n and e.get("only_k", k) == k), {})
    return {**{key: v for key, v in env.items() if key not in SHAPE_KEYS}, **(config or {})}


def linear_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: dict | None = None,
    silu_mul: bool = False,
    rope: RopeColumns | None = None,
    swiglu: bool = False,
) -> torch.Tensor:
    """``x @ weight.T`` through the Triton GEMV (``x``: ``[..., K]`` with at most ``MAX_ROWS`` rows);
    with ``silu_mul``, ``(silu(gate) * up) @ weight.T`` for ``gate, up = x.chunk(2, -1)``; with
    ``rope`` (one row only), the output columns ``[lo, hi)`` rotated as heads of ``head_dim``; with
    ``swiglu`` (one row only, ``weight`` a gate/up pair ``[2I, K]``, gate rows first), ``silu(gate) *
    up`` of the two halves of the output, ``[..., I]``."""
    if rope is not None and not supports_rope(x, weight, rope):
        raise ValueError(
            f"linear_gemv with rope needs one row, a column range [lo, hi) of whole heads inside the output "
            f"and cos/sin of [1, head_dim // 2]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"columns [{rope.lo}, {rope.hi}), head_dim {rope.head_dim}, cos {tuple(rope.cos.shape)}"
        )
    if not supports_gemv(x, weight, silu_mul):
        raise ValueError(
            f"linear_gemv{' (silu_mul)' if silu_mul else ''} needs <= {MAX_ROWS} rows, a [N, K] weight with "
            f"unit stride over K and one dtype; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype} stride {weight.stride()}"
        )
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    n, k = weight.shape
    cfg = gemv_config(m, n, k, weight.dtype, x.device, silu_mul)
    cfg.update(_overrides(n, k, config))
    use_dot = bool(cfg["dot"])
    if m > 1 and not use_dot:
        raise ValueError(f"linear_gemv: {m} rows need the tl.dot tile (config dot=True); only one row runs without it")
    if rope is not None and (use_dot or rope.lo % cfg["block_n"] or (rope.hi - rope.lo) % cfg["block_n"]):
        raise ValueError(f"linear_gemv with rope: one row and column tiles that split no rotary pair; got {cfg}")
    if swiglu and (use_dot or rope is not None or n % 2 or cfg["block_n"] % 2):
        raise ValueError(
            f"linear_gemv with swiglu needs one row, no rope, an even number of output columns and of columns "
            f"per tile; got {m} rows, weight {tuple(weight.shape)}, {cfg}"
        )
    n_out = n // 2 if swiglu else n
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    interpret = is_interpreted(x)
    pdl = pdl_mode(x)
    with interpreter_scope(interpret):
        kernel_for(_gemv_kernel, interpret)[(triton.cdiv(n, cfg["block_n"]),)](
            x2,
            weight,
            y,
            m,
            n,
            k,
            x2.stride(0),
            weight.stride(0),
            y.stride(0),
            k,
            rope.cos if rope is not None else y,
            rope.sin if rope is not None else y,
            rope.lo if rope is not None else 0,
            rope.hi if rope is not None else 0,
            n_out,
            BLOCK_M=max(16, triton.next_power_of_2(m)) if use_dot else 1,
            BLOCK_N=cfg["block_n"],
            BLOCK_K=cfg["block_k"],
            PREFETCH=bool(cfg["prefetch"]),
            SILU_MUL=silu_mul,
            USE_DOT=use_dot,
            ROPE_HALF=rope.head_dim // 2 if rope is not None else 0,
            SWIGLU=swiglu,
            EARLY_ROPE=_EARLY_ROPE,
            ACC_2D=bool(cfg["acc_2d"]) and not use_dot and cfg["block_k"] >= 8,
            USE_PDL=pdl,
            num_warps=cfg["warps"],
            num_stages=cfg["stages"],
            **pdl_launch_options(pdl),
        )
    return y.reshape(*x.shape[:-1], n_out)


def silu_gate_triton(y: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate, up = y.chunk(2, -1)`` (``y`` ``[rows, 2I]``, contiguous rows) as one
    Triton launch, rounded like eager."""
    rows, half = y.shape[0], y.shape[1] // 2
    out = y.new_empty((rows, half))
    block = min(1024, triton.next_power_of_2(max(half, 1)))
    interpret = is_interpreted(y)
    pdl = pdl_mode(y)
    with interpreter_scope(interpret):
        kernel_for(_silu_gate_kernel, interpret)[(rows, triton.cdiv(half, block))](
            y,
            out,
            y.stride(0),
            out.stride(0),
            half,
            BLOCK=block,
            USE_PDL=pdl,
            num_warps=4,
            **pdl_launch_options(pdl),
        )
    return out


def _op_serves(x: torch.Tensor) -> bool:
    return x.is_cuda and x.numel() <= OP_MAX_ROWS * x.shape[-1]


@torch.library.custom_op("rlt::linear_small", mutates_args=())
def linear_small(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias): the Triton GEMV for decode-sized CUDA inputs, else ``F.linear``."""
    if _op_serves(x) and supports_gemv(x, weight):
        return linear_gemv(x, weight)
    return F.linear(x, weight)


@linear_small.register_fake
def _linear_small_fake(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("rlt::silu_mul_linear_small", mutates_args=())
def silu_mul_linear_small(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(F.silu(gate) * up, weight)`` for ``gate, up = gate_up.chunk(2, -1)`` (a SwiGLU's
    down projection): one Triton GEMV that forms its input itself for decode-sized CUDA inputs."""
    if _op_serves(gate_up) and supports_gemv(gate_up, weight, silu_mul=True):
        return linear_gemv(gate_up, weight, silu_mul=True)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, weight)


@torch.library.custom_op("rlt::rope_linear_small", mutates_args=())
def rope_linear_small(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lo: int, hi: int, head_dim: int
) -> torch.Tensor:
    """``F.linear(x, weight)`` with output columns ``[lo, hi)`` (whole heads of ``head_dim``: a fused
    QKV's q and k) rotated by rotate-half rotary from ``cos``/``sin`` ``[T, head_dim // 2]``: the
    rotation in the Triton GEMV's epilogue for one CUDA row; more CUDA rows: ``F.linear`` then one
    rotary kernel in place (``rope_columns_triton``); elsewhere ``F.linear`` then the reference."""
    rope = RopeColumns(cos, sin, lo, hi, head_dim)
    if _op_serves(x) and supports_gemv(x, weight) and supports_rope(x, weight, rope):
        return linear_gemv(x, weight, rope=rope)
    y = F.linear(x, weight)
    rows = y.reshape(-1, y.shape[-1])
    if y.is_cuda and rows.is_contiguous() and cos.shape == sin.shape == (rows.shape[0], head_dim // 2):
        rope_columns_triton(rows, rope)  # one kernel, not the eager rotation's chain of ops
        return y
    return rope_columns_reference(y, rope)


@torch.library.custom_op("rlt::swiglu_linear_small", mutates_args=())
def swiglu_linear_small(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate, up = F.linear(x, weight).chunk(2, -1)`` (a SwiGLU's fused gate/up
    projection, gate rows first): the gate in the Triton GEMV's epilogue for one CUDA row; more CUDA
    rows: ``F.linear`` then one gating kernel (``silu_gate_triton``); elsewhere eager."""
    if _op_serves(x) and supports_gemv(x, weight) and weight.shape[0] % 2 == 0:
        return linear_gemv(x, weight, swiglu=True)
    y = F.linear(x, weight)
    rows = y.reshape(-1, y.shape[-1])
    if y.is_cuda and rows.is_contiguous() and y.shape[-1] % 2 == 0:
        return silu_gate_triton(rows).reshape(*y.shape[:-1], y.shape[-1] // 2)
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


@swiglu_linear_small.register_fake
def _swiglu_linear_small_fake(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


@rope_linear_small.register_fake
def _rope_linear_small_fake(x, weight, cos, sin, lo, hi, head_dim):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@silu_mul_linear_small.register_fake
def _silu_mul_linear_small_fake(gate_up, weight):
    return gate_up.new_empty((*gate_up.shape[:-1], weight.shape[0]))
