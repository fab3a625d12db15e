"""A whole sandwich-norm decoder layer (Ouro) for one decode row in one persistent Triton launch.

At batch-1 decode an Ouro layer is a chain of dependent kernels (norm, q/k/v GEMV, attention, o
GEMV, norm, gate/up GEMV, down GEMV) of which only the GEMVs move many bytes; the norms and the
attention are a few dependent memory round trips each, and while they run HBM idles (session-8
critical path in docs/benchmarks.md: 16 of the 20 us a layer spent above its weight-read floor).
This kernel runs the layer as *phases* of one grid of ``nprog`` programs (one per SM, all
resident), separated by grid barriers (an arrival counter in global memory):

    0  prologue: h = residual + norm_a(y) (or h = residual), x = norm_in(h), every program for itself
       (a 2-4 KB row: recomputing it is cheaper than a kernel); q/k/v GEMV rows of the program
    1  attention: program (head, split) attends over its slice of the context (rotary of q and of the
       new key applied here; the new K/V row written to the cache); the last split of a head to
       finish merges the slices (arrival counter per head, as the decode attention kernel does)
    2  o GEMV rows
    3  prologue: h2 = h + norm_in2(o), x2 = norm_post(h2); gate/up GEMV rows with the SwiGLU gate
       in the epilogue (a program pairs gate row j with up row I + j)
    4  down GEMV rows -> d

Each GEMV phase streams its weight tiles (``rows x block_k``) through registers with the next
tile(s) in flight (``depth``), and its first tile(s) are loaded *before* the barrier that precedes
the phase: weights never depend on the previous phase, so the attention, the norms and the barrier
latency overlap the weight stream instead of adding to it. The first phase's tiles are loaded
before the PDL wait, like the decode GEMV of ``gemv.py``.

The layer returns ``(h2, d)``: the next layer (or the loop's final norm) starts with ``h2 +
norm(d)``, which is this kernel's phase-0 prologue for the next layer.

Arithmetic and rounding follow the eager model op for op (``sandwich_layer_reference``): norms in
fp32 rounded to the dtype then multiplied by the weight in the dtype, GEMVs accumulated in fp32
and rounded once, rotary on the rounded q/k with cos/sin rounded to the dtype, the online softmax
in fp32 (``triton_attention``), ``silu(gate) * up`` rounded like eager. Only summation orders differ.

``phased=True`` runs the five phases as five launches without barriers (PDL between them on CUDA):
the path of Triton's CPU interpreter (which runs programs one after another, so a grid barrier
would never open) and an A/B baseline on the GPU. The fused launch needs every program resident at
once: ``nprog`` is at most the SM count and the kernel never lets its dependents launch before its
last barrier (PDL), so no later kernel can take an SM one of its programs still needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rlt_compile.kernels.gemv import _silu_gate
from rlt_compile.kernels.reference import apply_rope_half, attention_reference
from rlt_compile.kernels.rmsnorm import rmsnorm_reference
from rlt_compile.kernels.triton_attention import (
    _interpret,
    _interpreter_scope,
    _kernel,
    _merge_head,
    _pdl_launch_options,
    _sm_count,
    _use_pdl,
)

__all__ = [
    "LAYER_CONFIG_KEYS",
    "layer_config",
    "sandwich_layer_reference",
    "sandwich_layer_triton",
    "supports_sandwich_layer",
]

_LOG2E = 1.4426950408889634
LAYER_CONFIG_KEYS = frozenset(
    {"nprog", "rows", "block_k", "rows_n", "block_k_n", "depth", "stages", "poll", "warps", "block_n", "phased"}
)


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _grid_barrier(count_ptr, NPROG: tl.constexpr, POLL: tl.constexpr):
    """Every program of the grid waits here until all ``NPROG`` arrived. ``count_ptr`` is an int64
    that only grows (by ``NPROG`` per barrier, so it is a multiple of ``NPROG`` between launches):
    a program's arrival number tells it which multiple to wait for. The release/acquire pair orders
    every program's earlier stores before every program's later loads. ``POLL == 0`` polls with
    atomics; ``POLL == 1`` with volatile loads (no atomic-unit traffic while waiting), then one
    acquiring atomic."""
    tl.debug_barrier()  # all threads' stores of this program before its arrival
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    target = arrived - arrived % NPROG + NPROG
    seen = arrived + 1
    if POLL == 0:
        while seen < target:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    else:
        while seen < target:
            seen = tl.load(count_ptr, volatile=True)
        tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _stamp(timing_ptr, pid, k, TIMING: tl.constexpr):
    """``TIMING``: record the GPU's global timer (ns) as event ``k`` of program ``pid`` (16 per program)."""
    if TIMING:
        tl.store(timing_ptr + pid * 16 + k, tl.extra.cuda.globaltimer())


@triton.jit
def _norm(v, w, n, eps):
    """``w * (v in fp32 * rsqrt(mean(v^2) + eps)).to(dtype)`` rounded to ``v``'s dtype (models.layers.RMSNorm)."""
    xf = v.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    return (w.to(tl.float32) * (xf * rstd).to(v.dtype).to(tl.float32)).to(v.dtype)


@triton.jit
def _add(a, b):
    """``a + b`` in ``a``'s dtype (one rounding)."""
    return (a.to(tl.float32) + b.to(tl.float32)).to(a.dtype)


@triton.jit
def _unit_rows(lo, hi, rt, HALF, ROWS: tl.constexpr, SWIGLU: tl.constexpr):
    """The weight rows of row tile ``rt`` of a program owning outputs ``[lo, hi)``, and which are
    real. SwiGLU tiles interleave gate row ``j`` and up row ``HALF + j`` (``ROWS // 2`` outputs)."""
    r = tl.arange(0, ROWS)
    if SWIGLU:
        out = lo + rt * (ROWS // 2) + r // 2
        rows = out + (r % 2) * HALF
    else:
        out = lo + rt * ROWS + r
        rows = out
    return rows, out < hi


@triton.jit
def _load_unit(w_ptr, stride_w, lo, hi, u, n_units, K, HALF, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
               SWIGLU: tl.constexpr):  # fmt: skip
    """Weight tile ``u`` (row tile ``u // k_chunks``, K chunk ``u % k_chunks``) of a GEMV phase;
    zeros past the program's last tile."""
    k_chunks = tl.cdiv(K, BLOCK_K)
    rows, valid = _unit_rows(lo, hi, u // k_chunks, HALF, ROWS, SWIGLU)
    kk = (u % k_chunks) * BLOCK_K + tl.arange(0, BLOCK_K)
    live = (tl.zeros([ROWS], dtype=tl.int32) + u) < n_units  # (a scalar & block mask misbehaves in the interpreter)
    mask = (valid & live)[:, None] & (kk < K)[None, :]
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + kk[None, :], mask=mask, other=0.0)


@triton.jit
def _units(lo, hi, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr):
    per_tile = ROWS // 2 if SWIGLU else ROWS
    return tl.cdiv(tl.maximum(hi - lo, 0), per_tile) * tl.cdiv(K, BLOCK_K)


@triton.jit
def _prefetch(w_ptr, stride_w, lo, hi, K, HALF, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr,
              DEPTH: tl.constexpr):  # fmt: skip
    """The first ``DEPTH`` (1 or 2) weight tiles of a GEMV phase (the second is zeros for depth 1)."""
    n_units = _units(lo, hi, K, ROWS, BLOCK_K, SWIGLU)
    w0 = _load_unit(w_ptr, stride_w, lo, hi, 0, n_units, K, HALF, ROWS, BLOCK_K, SWIGLU)
    if DEPTH == 2:
        w1 = _load_unit(w_ptr, stride_w, lo, hi, 1, n_units, K, HALF, ROWS, BLOCK_K, SWIGLU)
    else:
        w1 = tl.zeros([ROWS, BLOCK_K], dtype=w0.dtype)
    return w0, w1


@triton.jit
def _load_x(x_ptr, u, K, BLOCK_K: tl.constexpr):
    """The input chunk of unit ``u`` (written by other programs: read through L2), in fp32."""
    kk = (u % tl.cdiv(K, BLOCK_K)) * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(x_ptr + kk, mask=kk < K, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _unit_step(acc, w, x, u, y_ptr, lo, hi, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr):
    """Accumulate unit ``u`` elementwise (``acc [ROWS, BLOCK_K] += w * x``: no reduction across
    threads per unit); after a row tile's last K chunk reduce it, store its outputs (SwiGLU: gated
    pairs) and restart the accumulator."""
    k_chunks = tl.cdiv(K, BLOCK_K)
    acc += w.to(tl.float32) * x[None, :]
    if u % k_chunks == k_chunks - 1:
        out = tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty)
        rt = u // k_chunks
        if SWIGLU:
            gate, up = tl.split(tl.reshape(out, [ROWS // 2, 2]))
            offs = lo + rt * (ROWS // 2) + tl.arange(0, ROWS // 2)
            tl.store(y_ptr + offs, _silu_gate(gate, up), mask=offs < hi)
        else:
            offs = lo + rt * ROWS + tl.arange(0, ROWS)
            tl.store(y_ptr + offs, out, mask=offs < hi)
        acc = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    return acc


@triton.jit
def _gemv(w_ptr, stride_w, x_ptr, y_ptr, lo, hi, K, HALF, w0, w1, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
          SWIGLU: tl.constexpr, DEPTH: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """``y[lo:hi] = W[lo:hi] @ x`` (SwiGLU: ``y[j] = silu(W[j] @ x) * (W[HALF + j] @ x)``), fp32
    accumulation rounded once, over the program's units (``rows x block_k`` weight tiles); the first
    ones (``w0``, ``w1``) are already loaded. ``STAGES == 0``: the tiles and input chunks stream through
    registers ``DEPTH`` ahead. ``STAGES > 0``: unit 0 from ``w0``, the rest through Triton's software
    pipeline (``STAGES`` tiles in flight in shared memory)."""
    n_units = _units(lo, hi, K, ROWS, BLOCK_K, SWIGLU)
    acc = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    if STAGES > 0:
        acc = _unit_step(acc, w0, _load_x(x_ptr, 0, K, BLOCK_K), 0, y_ptr, lo, hi, K, ROWS, BLOCK_K, SWIGLU)
        for u in tl.range(1, n_units, num_stages=STAGES):
            w = _load_unit(w_ptr, stride_w, lo, hi, u, n_units, K, HALF, ROWS, BLOCK_K, SWIGLU)
            acc = _unit_step(acc, w, _load_x(x_ptr, u, K, BLOCK_K), u, y_ptr, lo, hi, K, ROWS, BLOCK_K, SWIGLU)
    else:
        w_next = w0
        w_after = w1
        x_next = _load_x(x_ptr, 0, K, BLOCK_K)
        for u in range(0, n_units):
            w = w_next
            x = x_next
            if DEPTH == 2:
                w_next = w_after
                w_after = _load_unit(w_ptr, stride_w, lo, hi, u + 2, n_units, K, HALF, ROWS, BLOCK_K, SWIGLU)
            else:
                w_next = _load_unit(w_ptr, stride_w, lo, hi, u + 1, n_units, K, HALF, ROWS, BLOCK_K, SWIGLU)
            x_next = _load_x(x_ptr, u + 1, K, BLOCK_K)
            acc = _unit_step(acc, w, x, u, y_ptr, lo, hi, K, ROWS, BLOCK_K, SWIGLU)


@triton.jit
def _rope(lo, hi, cos, sin):
    """Rotate-half rotary of one head given as its two halves (``gemv._rotate``'s rounding)."""
    cos = cos.to(lo.dtype).to(tl.float32)
    sin = sin.to(lo.dtype).to(tl.float32)
    a, b = lo.to(tl.float32), hi.to(tl.float32)
    return (a * cos - b * sin).to(lo.dtype), (b * cos + a * sin).to(lo.dtype)


@triton.jit
def _attention(
    qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, table_ptr, seq_lens_ptr,
    attn_ptr, part_out_ptr, part_lse_ptr, counter_ptr, pid, scale_log2, NUM_HEADS, NUM_KV_HEADS,
    stride_cb, stride_cs, stride_ch, stride_cd,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Phase 1 for program ``pid``: head ``pid // SPLITS``, context slice ``pid % SPLITS``."""
    HALF: tl.constexpr = HEAD_DIM // 2
    head = pid // SPLITS
    split = pid % SPLITS
    if head < NUM_HEADS:
        group = NUM_HEADS // NUM_KV_HEADS
        kv_head = head // group
        seq_len = tl.load(seq_lens_ptr)
        j = tl.arange(0, HALF)
        d = tl.arange(0, HEAD_DIM)
        cos = tl.load(cos_ptr + j)
        sin = tl.load(sin_ptr + j)
        q_base = qkv_ptr + head * HEAD_DIM
        q_lo, q_hi = _rope(tl.load(q_base + j, cache_modifier=".cg"), tl.load(q_base + HALF + j, cache_modifier=".cg"),
                           cos, sin)  # fmt: skip
        k_base = qkv_ptr + (NUM_HEADS + kv_head) * HEAD_DIM
        k_lo, k_hi = _rope(tl.load(k_base + j, cache_modifier=".cg"), tl.load(k_base + HALF + j, cache_modifier=".cg"),
                           cos, sin)  # fmt: skip
        k_lo = k_lo.to(k_cache_ptr.dtype.element_ty)
        k_hi = k_hi.to(k_cache_ptr.dtype.element_ty)
        v_new = tl.load(qkv_ptr + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + d, cache_modifier=".cg")
        v_new = v_new.to(v_cache_ptr.dtype.element_ty)
        head_off = kv_head.to(tl.int64) * stride_ch
        slot = tl.load(slot_ptr).to(tl.int64)
        if (head % group == 0) & (split == 0) & (slot >= 0):  # the new row into the cache, once per KV head
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head_off
            tl.store(k_cache_ptr + dst + j * stride_cd, k_lo)
            tl.store(k_cache_ptr + dst + (HALF + j) * stride_cd, k_hi)
            tl.store(v_cache_ptr + dst + d * stride_cd, v_new)
        qf_lo = q_lo.to(k_cache_ptr.dtype.element_ty).to(tl.float32) * scale_log2
        qf_hi = q_hi.to(k_cache_ptr.dtype.element_ty).to(tl.float32) * scale_log2
        # keys [0, seq_len): [0, seq_len - 1) from the cache, seq_len - 1 the new row (held above)
        n_tiles = tl.cdiv(seq_len, BLOCK_N)
        per_split = tl.cdiv(n_tiles, SPLITS)
        kv_lo = split * per_split * BLOCK_N
        kv_hi = tl.minimum(seq_len, kv_lo + per_split * BLOCK_N)
        m_i = tl.full([], -1.0e30, tl.float32)
        l_i = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        for start in range(kv_lo, kv_hi, BLOCK_N):
            pos = start + offs_n
            valid = pos < kv_hi
            new = pos == seq_len - 1
            cached = valid & (pos < seq_len - 1)
            block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=cached, other=0).to(tl.int64)
            off = block * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs + head_off
            kl = tl.load(k_cache_ptr + off[:, None] + j[None, :] * stride_cd, mask=cached[:, None], other=0.0)
            kh = tl.load(k_cache_ptr + off[:, None] + (HALF + j)[None, :] * stride_cd, mask=cached[:, None], other=0.0)
            vv = tl.load(v_cache_ptr + off[:, None] + d[None, :] * stride_cd, mask=cached[:, None], other=0.0)
            kl = tl.where(new[:, None], k_lo[None, :], kl)
            kh = tl.where(new[:, None], k_hi[None, :], kh)
            vv = tl.where(new[:, None], v_new[None, :], vv)
            s = tl.sum(qf_lo[None, :] * kl.to(tl.float32), axis=1) + tl.sum(qf_hi[None, :] * kh.to(tl.float32), axis=1)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * vv.to(tl.float32), axis=0)
            m_i = m_new
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        tl.store(part_out_ptr + (split * NUM_HEADS + head) * HEAD_DIM + d, acc / l_safe)
        tl.store(part_lse_ptr + split * NUM_HEADS + head, tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf")))
        tl.debug_barrier()  # every thread's partial stores before the release of the count
        done = tl.atomic_add(counter_ptr + head, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:  # the last split of this head merges all of them
            tl.atomic_xchg(counter_ptr + head, 0, sem="relaxed", scope="gpu")
            merged = _merge_head(
                part_out_ptr, part_lse_ptr, 0, head, SPLITS, d, d < HEAD_DIM,
                NUM_HEADS * HEAD_DIM, 0, HEAD_DIM, NUM_HEADS, 0, SPLITS,
            )  # fmt: skip
            tl.store(attn_ptr + head * HEAD_DIM + d, merged.to(attn_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------------------------
# The kernel (a plain function; wrapped with JITFunction / InterpretedFunction on first use)
# ----------------------------------------------------------------------------------------------


def _sandwich_layer_kernel(
    y_ptr, res_ptr, wa_ptr, win_ptr, wqkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, table_ptr,
    seq_lens_ptr, wo_ptr, win2_ptr, wpost_ptr, wgu_ptr, wdown_ptr,
    h_out_ptr, d_out_ptr, x_scratch_ptr, h_in_ptr, qkv_ptr, attn_ptr, o_ptr, g_ptr, part_out_ptr, part_lse_ptr,
    counter_ptr, barrier_ptr, timing_ptr,
    hidden, inter, n_qkv, n_q, num_heads, num_kv_heads, eps_a, eps_in, eps_in2, eps_post, scale_log2,
    stride_cb, stride_cs, stride_ch, stride_cd,
    per_qkv, per_o, per_gu, per_down,
    NORM_A: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, NPROG: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
    ROWS_N: tl.constexpr, BLOCK_K_N: tl.constexpr,
    DEPTH: tl.constexpr, STAGES: tl.constexpr, POLL: tl.constexpr, PHASE: tl.constexpr, FUSED: tl.constexpr, USE_PDL: tl.constexpr, TIMING: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    _stamp(timing_ptr, pid, 0, TIMING)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < hidden
    x_row = x_scratch_ptr + pid * BLOCK_H

    # -- phase 0: prologue norm(s), q/k/v GEMV --------------------------------------------------
    if FUSED or PHASE == 0:
        lo = pid * per_qkv
        hi = tl.minimum(lo + per_qkv, n_qkv)
        w0, w1 = _prefetch(wqkv_ptr, hidden, lo, hi, hidden, 0, ROWS, BLOCK_K, False, DEPTH)
        w_in = tl.load(win_ptr + offs_h, mask=mask_h, other=0.0)
        if NORM_A:
            w_a = tl.load(wa_ptr + offs_h, mask=mask_h, other=0.0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            if not FUSED:
                tl.extra.cuda.gdc_launch_dependents()
        _stamp(timing_ptr, pid, 1, TIMING)
        h = tl.load(res_ptr + offs_h, mask=mask_h, other=0.0)
        if NORM_A:
            h = _add(h, _norm(tl.load(y_ptr + offs_h, mask=mask_h, other=0.0), w_a, hidden, eps_a))
            if pid == 0:
                tl.store(h_in_ptr + offs_h, h, mask=mask_h)
        tl.store(x_row + offs_h, _norm(h, w_in, hidden, eps_in), mask=mask_h)
        tl.debug_barrier()
        _gemv(wqkv_ptr, hidden, x_row, qkv_ptr, lo, hi, hidden, 0, w0, w1, ROWS, BLOCK_K, False, DEPTH, STAGES)
        _stamp(timing_ptr, pid, 2, TIMING)

    # -- phase 1: attention ---------------------------------------------------------------------
    if FUSED:  # the o GEMV's first tiles in flight across the attention
        lo = pid * per_o
        hi = tl.minimum(lo + per_o, hidden)
        w0, w1 = _prefetch(wo_ptr, n_q, lo, hi, n_q, 0, ROWS_N, BLOCK_K_N, False, DEPTH)
        _grid_barrier(barrier_ptr, NPROG, POLL)
        _stamp(timing_ptr, pid, 3, TIMING)
    if PHASE == 1 and USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if FUSED or PHASE == 1:
        _attention(
            qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, table_ptr, seq_lens_ptr,
            attn_ptr, part_out_ptr, part_lse_ptr, counter_ptr, pid, scale_log2, num_heads, num_kv_heads,
            stride_cb, stride_cs, stride_ch, stride_cd, HEAD_DIM, BLOCK_SIZE, SPLITS, BLOCK_N,
        )  # fmt: skip
        _stamp(timing_ptr, pid, 4, TIMING)

    # -- phase 2: o GEMV --------------------------------------------------------------------------
    if FUSED:
        _grid_barrier(barrier_ptr, NPROG, POLL)
        _stamp(timing_ptr, pid, 5, TIMING)
    if PHASE == 2:
        lo = pid * per_o
        hi = tl.minimum(lo + per_o, hidden)
        w0, w1 = _prefetch(wo_ptr, n_q, lo, hi, n_q, 0, ROWS_N, BLOCK_K_N, False, DEPTH)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
    if FUSED or PHASE == 2:
        _gemv(wo_ptr, n_q, attn_ptr, o_ptr, lo, hi, n_q, 0, w0, w1, ROWS_N, BLOCK_K_N, False, DEPTH, STAGES)
        _stamp(timing_ptr, pid, 6, TIMING)

    # -- phase 3: prologue norms, gate/up GEMV + SwiGLU --------------------------------------------
    if FUSED or PHASE == 3:
        lo = pid * per_gu
        hi = tl.minimum(lo + per_gu, inter)
        w0, w1 = _prefetch(wgu_ptr, hidden, lo, hi, hidden, inter, ROWS, BLOCK_K, True, DEPTH)
        w_in2 = tl.load(win2_ptr + offs_h, mask=mask_h, other=0.0)
        w_post = tl.load(wpost_ptr + offs_h, mask=mask_h, other=0.0)
        if FUSED:
            _grid_barrier(barrier_ptr, NPROG, POLL)
            _stamp(timing_ptr, pid, 7, TIMING)
        elif USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        h_src = h_in_ptr if NORM_A else res_ptr
        h = tl.load(h_src + offs_h, mask=mask_h, other=0.0, cache_modifier=".cg")
        o = tl.load(o_ptr + offs_h, mask=mask_h, other=0.0, cache_modifier=".cg")
        h = _add(h, _norm(o, w_in2, hidden, eps_in2))
        if pid == 0:
            tl.store(h_out_ptr + offs_h, h, mask=mask_h)
        tl.store(x_row + offs_h, _norm(h, w_post, hidden, eps_post), mask=mask_h)
        tl.debug_barrier()
        _gemv(wgu_ptr, hidden, x_row, g_ptr, lo, hi, hidden, inter, w0, w1, ROWS, BLOCK_K, True, DEPTH, STAGES)
        _stamp(timing_ptr, pid, 8, TIMING)

    # -- phase 4: down GEMV -----------------------------------------------------------------------
    if FUSED or PHASE == 4:
        lo = pid * per_down
        hi = tl.minimum(lo + per_down, hidden)
        w0, w1 = _prefetch(wdown_ptr, inter, lo, hi, inter, 0, ROWS_N, BLOCK_K_N, False, DEPTH)
        if FUSED:
            _grid_barrier(barrier_ptr, NPROG, POLL)
            _stamp(timing_ptr, pid, 9, TIMING)
        if USE_PDL:  # fused: only now, when every program is past its last barrier
            if not FUSED:
                tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        _gemv(wdown_ptr, inter, g_ptr, d_out_ptr, lo, hi, inter, 0, w0, w1, ROWS_N, BLOCK_K_N, False, DEPTH, STAGES)
        _stamp(timing_ptr, pid, 10, TIMING)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

# Arrival counters: one int64 grid-barrier counter (only grows) and one int32 per head for the
# split merge (each launch leaves them at zero), per device; allocated outside CUDA-graph capture.
_MAX_HEADS = 1024
_SYNC: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _sync_buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    buffers = _SYNC.get(device)
    if buffers is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buffers = _SYNC[device] = (
            torch.zeros(1, dtype=torch.int64, device=device),
            torch.zeros(_MAX_HEADS, dtype=torch.int32, device=device),
        )
    return buffers


def layer_config(device: torch.device, dtype: torch.dtype, config: dict | None = None) -> dict:
    """Launch parameters from the device and dtype only (CUDA-graph safe); ``config`` overrides
    (keys ``LAYER_CONFIG_KEYS``). CPU (the interpreter): small tiles, phased."""
    if device.type == "cpu":
        cfg = {
            "nprog": 4,
            "rows": 4,
            "block_k": 32,
            "rows_n": 2,
            "block_k_n": 16,
            "depth": 1,
            "stages": 0,
            "poll": 1,
            "warps": 4,
            "block_n": 16,
            "phased": 1,
        }
    else:
        # wide phases (q/k/v, gate/up): 64 rows x 256, the warps along the rows (no reduction across
        # warps); narrow ones (o, down: 16 rows a program): 16 x 1024, reduced once at the end
        cfg = {"nprog": _sm_count(device), "rows": 64, "block_k": 256, "rows_n": 16,
               "block_k_n": 1024 if dtype != torch.float32 else 512,
               "depth": 1, "stages": 0, "poll": 1, "warps": 8, "block_n": 32, "phased": 0}  # fmt: skip
    for key, value in (config or {}).items():
        if key not in LAYER_CONFIG_KEYS:
            raise ValueError(f"unknown decode-layer config key {key!r}; known: {sorted(LAYER_CONFIG_KEYS)}")
        cfg[key] = int(value)
    if cfg["depth"] not in (1, 2):
        raise ValueError(f"decode-layer depth must be 1 or 2, got {cfg['depth']}")
    for key in ("rows", "block_k", "rows_n", "block_k_n", "block_n"):
        if cfg[key] < 2 or cfg[key] & (cfg[key] - 1):
            raise ValueError(f"decode-layer {key} must be a power of two >= 2, got {cfg[key]}")
    if device.type == "cuda" and not cfg["phased"] and cfg["nprog"] > _sm_count(device):
        raise ValueError(f"a fused decode-layer launch needs nprog <= the SM count ({_sm_count(device)})")
    return cfg


def _head_shape(w_qkv: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int]:
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    num_heads = (w_qkv.shape[0] - 2 * num_kv_heads * head_dim) // head_dim
    return num_heads, num_kv_heads, head_dim


def supports_sandwich_layer(x: torch.Tensor, w_qkv: torch.Tensor, kv_cache: torch.Tensor, w_gu: torch.Tensor) -> bool:
    """Whether ``sandwich_layer_triton`` serves these shapes: one row, one dtype, a power-of-two head
    dim, q/k/v rows ``(H + 2 Hkv) * D`` with ``H`` a multiple of ``Hkv``, an even gate/up."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or w_qkv.dim() != 2:
        return False
    num_heads, num_kv_heads, head_dim = _head_shape(w_qkv, kv_cache)
    return (
        x.numel() == x.shape[-1]
        and x.dtype == w_qkv.dtype == kv_cache.dtype == w_gu.dtype
        and head_dim >= 2
        and head_dim & (head_dim - 1) == 0
        and num_heads > 0
        and num_heads % num_kv_heads == 0
        and (num_heads + 2 * num_kv_heads) * head_dim == w_qkv.shape[0]
        and num_heads <= _MAX_HEADS
        and w_gu.shape[0] % 2 == 0
    )


def sandwich_layer_triton(
    y: torch.Tensor | None,
    residual: torch.Tensor,
    w_a: torch.Tensor | None,
    w_in: torch.Tensor,
    eps_a: float,
    eps_in: float,
    w_qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    w_o: torch.Tensor,
    w_in2: torch.Tensor,
    w_post: torch.Tensor,
    eps_in2: float,
    eps_post: float,
    w_gu: torch.Tensor,
    w_down: torch.Tensor,
    config: dict | None = None,
    timing: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One decode row of an Ouro layer (see the module docstring); ``(h2, d)``, each ``[1, hidden]``,
    and the new K/V row written into ``kv_cache``. ``w_a`` None: the layer input is ``residual``
    itself (a loop step's first layer), else ``residual + norm_a(y)``. Returns None when the launch
    cannot be made here (no sync buffers yet inside a CUDA-graph capture): the caller then runs
    the unfused ops. ``timing`` (int64 ``[nprog, 16]``, CUDA, fused launch): each program's global
    timer at its phase boundaries (``benchmarks/layer_chain_bench.py --timeline``)."""
    hidden = residual.shape[-1]
    inter = w_gu.shape[0] // 2
    num_heads, num_kv_heads, head_dim = _head_shape(w_qkv, kv_cache)
    n_q = num_heads * head_dim
    device = residual.device
    cfg = layer_config(device, residual.dtype, config)
    sync = _sync_buffers(device)
    if sync is None:
        return None
    barrier, counters = sync
    nprog, rows = cfg["nprog"], cfg["rows"]
    # a power of two <= nprog // H, at most 32 (a merge reads every split's partial)
    splits = min(32, max(1, triton.next_power_of_2(max(1, nprog // num_heads) + 1) // 2))
    if nprog < num_heads * splits:
        raise ValueError(f"decode layer: {nprog} programs cannot hold {num_heads} heads")
    block_h = triton.next_power_of_2(hidden)
    new = residual.new_empty
    h_out, d_out = new((1, hidden)), new((1, hidden))
    x_scratch = new((nprog, block_h))
    h_in, o = new(hidden), new(hidden)
    qkv, attn, g = new(w_qkv.shape[0]), new(n_q), new(inter)
    part_out = torch.empty((splits, num_heads, head_dim), dtype=torch.float32, device=device)
    part_lse = torch.empty((splits, num_heads), dtype=torch.float32, device=device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    y_arg = y if y is not None else residual
    args = (
        y_arg, residual, w_a if w_a is not None else w_in, w_in, w_qkv, cos, sin, k_cache, v_cache, slot_mapping,
        block_tables, seq_lens, w_o, w_in2, w_post, w_gu, w_down,
        h_out, d_out, x_scratch, h_in, qkv, attn, o, g, part_out, part_lse, counters, barrier,
        timing if timing is not None else barrier,
        hidden, inter, w_qkv.shape[0], n_q, num_heads, num_kv_heads,
        float(eps_a), float(eps_in), float(eps_in2), float(eps_post), float(scale) * _LOG2E,
        *k_cache.stride(),
        -(-w_qkv.shape[0] // nprog),
        -(-hidden // nprog),
        -(-inter // nprog),
        -(-hidden // nprog),
    )  # fmt: skip
    interpret = _interpret(residual)
    pdl = _use_pdl(residual)
    meta = {
        "NORM_A": w_a is not None,
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": kv_cache.shape[2],
        "BLOCK_H": block_h,
        "SPLITS": splits,
        "BLOCK_N": cfg["block_n"],
        "NPROG": nprog,
        "ROWS": rows,
        "BLOCK_K": cfg["block_k"],
        "ROWS_N": cfg["rows_n"],
        "BLOCK_K_N": cfg["block_k_n"],
        "DEPTH": cfg["depth"],
        "STAGES": cfg["stages"],
        "POLL": cfg["poll"],
        "USE_PDL": pdl,
        "TIMING": timing is not None,
    }
    with _interpreter_scope(interpret):
        kernel = _kernel(_sandwich_layer_kernel, interpret)
        phases = range(5) if cfg["phased"] else (-1,)
        for phase in phases:
            kernel[(nprog,)](
                *args, **meta, PHASE=phase, FUSED=phase < 0, num_warps=cfg["warps"], num_stages=1,
                **_pdl_launch_options(pdl),
            )  # fmt: skip
    return h_out, d_out


# ----------------------------------------------------------------------------------------------
# Torch reference: the eager model's layer, op for op
# ----------------------------------------------------------------------------------------------


def sandwich_layer_reference(
    y, residual, w_a, w_in, eps_a, eps_in, w_qkv, cos, sin, kv_cache, slot_mapping, block_tables, seq_lens,
    query_start_loc, scale, w_o, w_in2, w_post, eps_in2, eps_post, w_gu, w_down,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(h2, d)`` of an Ouro layer on ``T`` rows as the eager model computes it (and the K/V rows
    written into ``kv_cache``): ``h = residual [+ norm_a(y)]``, ``h2 = h + norm_in2(o(attn(norm_in(h))))``,
    ``d = down(swiglu(gate_up(norm_post(h2))))``."""
    h = residual if w_a is None else residual + rmsnorm_reference(y, w_a, eps_a)
    x = rmsnorm_reference(h, w_in, eps_in)
    T = x.shape[0]
    num_heads, num_kv_heads, head_dim = _head_shape(w_qkv, kv_cache)
    qkv = F.linear(x, w_qkv)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = apply_rope_half(q.view(T, num_heads, head_dim), cos, sin)
    k = apply_rope_half(k.view(T, num_kv_heads, head_dim), cos, sin)
    v = v.view(T, num_kv_heads, head_dim)
    query_start_loc = query_start_loc if query_start_loc is not None else torch.tensor([0, T], device=x.device)
    out = attention_reference(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale)
    h2 = h + rmsnorm_reference(F.linear(out.reshape(T, -1), w_o), w_in2, eps_in2)
    gate, up = F.linear(rmsnorm_reference(h2, w_post, eps_post), w_gu).chunk(2, dim=-1)
    return h2, F.linear(F.silu(gate) * up, w_down)
