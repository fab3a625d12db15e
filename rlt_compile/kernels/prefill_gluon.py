"""Causal attention of fresh prompts in Gluon (NVIDIA Hopper): FlashAttention-3's order in a warp group.

Triton's source cannot keep a ``wgmma`` in flight across other instructions: it waits for a score
product right after issuing it, so the TMA prefill kernel's softmax never runs while the tensor
cores do (docs/benchmarks.md, session 24). Gluon issues ``wgmma`` asynchronously with explicit
waits. For each key tile this kernel issues the tile's scores and the previous tile's PV product
back to back, waits for the scores only, runs the softmax while the PV product is in flight, then
waits for it and rescales the accumulator:

    issue S(j) = Q K(j)^T, then acc += P(j-1) V(j-1)     tensor cores
    wait S(j)                                           (PV(j-1) may still run)
    softmax of S(j)                                     CUDA cores, while PV(j-1) runs
    wait PV(j-1); rescale acc

It serves the fresh sequences of a prefill batch (no cached prefix: ``seq_len == query_len``),
reading ``q`` ``[T, H, D]`` and the step's own ``k``/``v`` ``[T, Hkv, D]`` through TMA, K/V in a ring
of ``STAGES`` shared-memory buffers, and stores their K/V rows in the paged cache (the first query
head of each KV group). The grid is (heads, query tiles) with the heads on the first axis, so every
head's heaviest tile of a sequence launches before its next tile. Programs map to sequences as in
the other kernels (``query_start_loc[s] // BLOCK_M + s``, no host reads); programs of sequences with
a cached prefix, and of the padding rows, return at once: ``prefill_tma_attention`` runs them in the
TMA kernel, launched after this one with ``SKIP_FRESH``. The output tile leaves through the queries'
shared memory as 16-byte stores (``out_smem``). With ``producer`` one more warp (``gl.warp_specialize``)
issues the K/V copies and the warp group only waits for tiles and frees stages.

The benchmark probe this kernel grew from (``benchmarks/gluon_prefill_probe.py``, session 25, H100):
1.07-1.25x the TMA prefill op on fresh 8 x 1k and 1 x 8k prompts, 0.81-0.89x cuDNN's SDPA. Gluon
runs on the GPU only (Triton's interpreter cannot run it); it is tested on the device and compiled
offline for sm_90 in the CPU suite. 16-bit only, head dims of 64-256 that are powers of two.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from rlt_compile.kernels.attention_common import LOG2E

__all__ = ["GLUON_TILE", "launch_fresh_prefill", "fresh_prefill_launch"]
REQUIRES = "supports_wgmma"  # the Platform capability this module's kernel is built for (kernels/aot.py)

# triton 3.6 (the device image) names the TMA load async_copy_global_to_shared; later versions async_load
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

# block_m, block_n, stages, warps and q_regs (the queries as the score product's register operand: 1-2% less
# time on all four fresh cases, H100, session 26): one warp group per program, two programs per SM (112 KiB
# of shared memory each at head dim 128); every tile that left one program per SM was 20-40% slower (session 25)
# and out_smem (the output tile through the queries' shared memory, free once they sit in registers, to
# 16-byte stores instead of the wgmma layout's 4-byte ones: 1.4-16% less time on the four fresh cases, H100,
# session 27, most on 8 x 1k prompts, where Nsight Compute had found the stores throttling the LSU)
# producer: one extra warp issues the K/V copies (gl.warp_specialize), the warp group only waits and
# frees stages; off until measured
GLUON_TILE = {"block_m": 64, "block_n": 64, "stages": 3, "warps": 4, "q_regs": 1, "out_smem": 1, "producer": 0}


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile, row0, col, pred, BLOCK_N: gl.constexpr):
    """Start the TMA copies of key/value tile ``tile`` (rows from ``row0``) into stage ``tile % STAGES``."""
    stage = tile % k_smem.shape[0]
    nbytes: gl.constexpr = BLOCK_N * k_desc.block_type.shape[1] * 2
    mbarrier.expect(k_bars.index(stage), nbytes, pred=pred)
    _tma_load(k_desc, [row0 + tile * BLOCK_N, col], k_bars.index(stage), k_smem.index(stage), pred)
    mbarrier.expect(v_bars.index(stage), nbytes, pred=pred)
    _tma_load(v_desc, [row0 + tile * BLOCK_N, col], v_bars.index(stage), v_smem.index(stage), pred)


@gluon.jit
def _softmax(s, m_i, l_i, offs_m, tile, m0, scale_log2, BLOCK_N: gl.constexpr, col_layout: gl.constexpr):
    """Online softmax of one tile's raw scores (log2 domain, the scale inside the exponent); the
    causal mask on the tiles that reach the query tile's diagonal."""
    if tile * BLOCK_N + BLOCK_N > m0:
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        s = gl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _store_kv(rows, cache_ptr, slot_ptr, q_start, m0, q_len, kv_head, stride_cb, stride_cs, stride_ch,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_SIZE: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """Store ``rows`` (the sequence's rows ``m0 ..``, at most ``BLOCK_M``) of ``kv_head`` in the paged cache."""
    offs_r = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    slot = gl.load(slot_ptr + (q_start + offs_r).to(gl.int64), mask=offs_r < q_len, other=-1)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    gl.store(cache_ptr + dst[:, None] + offs_d[None, :], rows, mask=(slot >= 0)[:, None])


@gluon.jit
def _write_kv(src_ptr, cache_ptr, slot_ptr, q_start, m0, q_len, kv_head, stride_t, stride_cb, stride_cs, stride_ch,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_SIZE: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """Store rows ``m0 ..`` of ``kv_head`` read from the step's ``src_ptr`` (``[T, Hkv * HEAD_DIM]`` rows)."""
    offs_r = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    tok = (q_start + offs_r).to(gl.int64)
    rows = gl.load(
        src_ptr + tok[:, None] * stride_t + kv_head * HEAD_DIM + offs_d[None, :], mask=(offs_r < q_len)[:, None]
    )
    _store_kv(rows, cache_ptr, slot_ptr, q_start, m0, q_len, kv_head, stride_cb, stride_cs, stride_ch, HEAD_DIM,
              BLOCK_M, BLOCK_SIZE, layout)  # fmt: skip


@gluon.jit
def _fresh_prefill_kernel(
    q_desc,
    k_desc,
    v_desc,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    scale_log2,
    num_seqs,
    stride_kt,
    stride_vt,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    SEQ_P: gl.constexpr,
    WRITE_KV: gl.constexpr,
    ROW_LAYOUT: gl.constexpr,
    Q_REGS: gl.constexpr,
    OUT_SMEM: gl.constexpr,
    PRODUCER: gl.constexpr,
):
    head = gl.program_id(0)
    pid = gl.program_id(1)
    # the sequence owning this program: the last s with query_start_loc[s] // BLOCK_M + s <= pid
    # (attention_common._program_sequence's search; a @triton.jit helper cannot be called from Gluon)
    seq_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    offs_s = gl.arange(0, SEQ_P, layout=seq_layout)
    starts = gl.load(query_start_ptr + offs_s, mask=offs_s <= num_seqs, other=1 << 28)
    seq = gl.sum((starts // BLOCK_M + offs_s <= pid).to(gl.int32), axis=0) - 1
    if seq >= num_seqs:  # padding rows: the TMA kernel's
        return
    # three more dependent loads; picking the bounds out of ``starts`` instead was 0.3-2.3% slower (session 26)
    q_start = gl.load(query_start_ptr + seq)
    q_len = gl.load(query_start_ptr + seq + 1) - q_start
    if gl.load(seq_lens_ptr + seq) != q_len:  # a cached prefix: the TMA kernel's
        return
    num_tiles = (q_len + BLOCK_M - 1) // BLOCK_M
    rank = pid - (q_start // BLOCK_M + seq)
    if rank >= num_tiles:
        return
    m0 = (num_tiles - 1 - rank) * BLOCK_M  # the causally heaviest tile first
    kv_head = head // GROUP
    kv_col = kv_head * HEAD_DIM
    num_kv = (gl.minimum(m0 + BLOCK_M, q_len) + BLOCK_N - 1) // BLOCK_N

    dtype: gl.constexpr = q_desc.block_type.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if PRODUCER:  # the warp group frees stages to the copy warp
        free_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(free_bars.index(i), count=1)
    else:  # unused: the warp group issues the copies itself
        free_bars = k_bars
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    # rows past the sequence (the next one's, or past T: zeros) are computed and never stored
    mbarrier.expect(q_bar, BLOCK_M * HEAD_DIM * 2)
    _tma_load(q_desc, [q_start + m0, head * HEAD_DIM], q_bar, q_smem)
    smem = (q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, free_bars)
    ptrs = (k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, out_ptr)
    strides = (stride_kt, stride_vt, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch)
    where = (q_start, q_len, m0, num_kv, head, kv_head, kv_col)
    if PRODUCER:  # one warp issues the K/V copies; the warp group computes (argument tuples inline: a
        # tuple bound to a name turns its items into tensors, which a layout cannot be)
        gl.warp_specialize(
            [(_attend, (k_desc, v_desc, smem, ptrs, strides, where, scale_log2, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N,
                        BLOCK_SIZE, WARPS, WRITE_KV, ROW_LAYOUT, Q_REGS, OUT_SMEM, PRODUCER)),
             (_kv_producer, (k_desc, v_desc, smem, q_start, kv_col, num_kv, BLOCK_N))],
            [1],
            [24],
        )  # fmt: skip
    else:
        for i in gl.static_range(STAGES):
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, i, q_start, kv_col, i < num_kv, BLOCK_N)
        _attend(k_desc, v_desc, smem, ptrs, strides, where, scale_log2, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE,
                WARPS, WRITE_KV, ROW_LAYOUT, Q_REGS, OUT_SMEM, PRODUCER)  # fmt: skip


@gluon.jit
def _kv_producer(k_desc, v_desc, smem, q_start, kv_col, num_kv, BLOCK_N: gl.constexpr):
    """``PRODUCER``'s copy warp: each key/value tile into its stage once the warp group freed it."""
    q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, free_bars = smem
    STAGES: gl.constexpr = k_smem.shape[0]
    for j in range(num_kv):
        # a fresh barrier counts as phase 1 complete: the first round of stages passes at once
        mbarrier.wait(free_bars.index(j % STAGES), ((j // STAGES) & 1) ^ 1)
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, j, q_start, kv_col, True, BLOCK_N)


@gluon.jit
def _attend(k_desc, v_desc, smem, ptrs, strides, where, scale_log2, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, WARPS: gl.constexpr,
            WRITE_KV: gl.constexpr, ROW_LAYOUT: gl.constexpr, Q_REGS: gl.constexpr, OUT_SMEM: gl.constexpr,
            PRODUCER: gl.constexpr):  # fmt: skip
    """The warp group's part: the key loop of one query tile (the K/V copies issued here, or freed to
    the copy warp with ``PRODUCER``), its output rows and its K/V rows in the cache."""
    q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, free_bars = smem
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, out_ptr = ptrs
    stride_kt, stride_vt, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch = strides
    q_start, q_len, m0, num_kv, head, kv_head, kv_col = where
    STAGES: gl.constexpr = k_smem.shape[0]
    dtype: gl.constexpr = k_desc.block_type.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    offs_m = m0 + gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, layout=row_s)  # finite: no NaN before the first key
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)

    mbarrier.wait(q_bar, 0)
    if Q_REGS:  # the score product's A operand from registers: half its shared-memory reads
        q_op = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    else:
        q_op = q_smem
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, offs_m, 0, m0, scale_log2, BLOCK_N, col_s)

    for j in range(1, num_kv):
        prev = j - 1
        mbarrier.wait(k_bars.index(j % STAGES), (j // STAGES) & 1)
        s = warpgroup_mma(q_op, k_smem.index(j % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bars.index(prev % STAGES), (prev // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc_next = warpgroup_mma(p_op, v_smem.index(prev % STAGES), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))  # S(j) done; PV(j-1) still runs during the softmax
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, offs_m, j, m0, scale_log2, BLOCK_N, col_s)
        # P(j-1) sits in registers the PV product reads until it completes: kept alive to here
        acc, p_op = warpgroup_mma_wait(0, deps=(acc_next, p_op))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        # tile j-1 is consumed (its scores and its PV): its stage takes tile j-1+STAGES
        if PRODUCER:
            mbarrier.arrive(free_bars.index(prev % STAGES), count=1)
        else:
            _load_kv(
                k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, prev + STAGES, q_start, kv_col,
                prev + STAGES < num_kv, BLOCK_N,
            )  # fmt: skip

    last = num_kv - 1
    mbarrier.wait(v_bars.index(last % STAGES), (last // STAGES) & 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    acc = warpgroup_mma(p_op, v_smem.index(last % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    # copies issued for tiles past num_kv were predicated off; every issued one has been waited for
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))
        if PRODUCER:
            mbarrier.invalidate(free_bars.index(i))

    out = (acc / gl.convert_layout(l_i, row_o)[:, None]).to(dtype)
    if OUT_SMEM:  # through the queries' shared memory (free: they sit in registers) to 16-byte stores
        q_smem.store(out)
        out = q_smem.load(ROW_LAYOUT)
        offs_r = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ROW_LAYOUT))
        cols = head * stride_oh + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ROW_LAYOUT))
    else:
        offs_r = m0 + gl.arange(0, BLOCK_M, layout=row_o)
        cols = head * stride_oh + gl.arange(0, HEAD_DIM, layout=col_o)
    rows = (q_start + offs_r).to(gl.int64)
    gl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :], out, mask=(offs_r < q_len)[:, None])

    if WRITE_KV:  # noqa: SIM102 (constexpr, then runtime)
        if head % GROUP == 0:
            if BLOCK_M == BLOCK_N:  # the last key tile is the query tile's own rows, still in shared memory
                stage = last % STAGES
                _store_kv(k_smem.index(stage).load(ROW_LAYOUT), k_cache_ptr, slot_ptr, q_start, m0, q_len, kv_head,
                          stride_cb, stride_cs, stride_ch, HEAD_DIM, BLOCK_M, BLOCK_SIZE, ROW_LAYOUT)  # fmt: skip
                _store_kv(v_smem.index(stage).load(ROW_LAYOUT), v_cache_ptr, slot_ptr, q_start, m0, q_len, kv_head,
                          stride_cb, stride_cs, stride_ch, HEAD_DIM, BLOCK_M, BLOCK_SIZE, ROW_LAYOUT)  # fmt: skip
            else:
                _write_kv(k_ptr, k_cache_ptr, slot_ptr, q_start, m0, q_len, kv_head, stride_kt, stride_cb, stride_cs,
                          stride_ch, HEAD_DIM, BLOCK_M, BLOCK_SIZE, ROW_LAYOUT)  # fmt: skip
                _write_kv(v_ptr, v_cache_ptr, slot_ptr, q_start, m0, q_len, kv_head, stride_vt, stride_cb, stride_cs,
                          stride_ch, HEAD_DIM, BLOCK_M, BLOCK_SIZE, ROW_LAYOUT)  # fmt: skip


def _row_layout(head_dim: int, warps: int):
    """A blocked layout for ``[BLOCK_M, head_dim]`` row copies: 16-byte vectors along the head dim."""
    lanes = min(32, head_dim // 8)
    return gl.BlockedLayout([1, 8], [32 // lanes, lanes], [warps, 1], [1, 0])


def fresh_prefill_launch(q, k, v, kv_cache, seq_lens, query_start_loc, out, scale: float, slot_mapping=None, tile=None):
    """``(kernel, grid, args, kwargs)`` of the Gluon launch for ``q [T, H, D]``, ``k``/``v [T, Hkv, D]``
    (TMA-ready: unit stride over the head dim, heads packed), the paged ``kv_cache`` ``[2, blocks,
    block_size, Hkv, D]`` and ``out [T, H, D]``; also what ``kernels/aot.py``-style offline compiles bind."""
    tile = {**GLUON_TILE, **(tile or {})}
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    block_m, block_n, warps = tile["block_m"], tile["block_n"], tile["warps"]
    if block_m % block_n:
        raise ValueError(f"Gluon prefill tiles: block_m must be a multiple of block_n, got {tile}")
    if tile["out_smem"] and not tile["q_regs"]:
        raise ValueError(f"Gluon prefill tiles: out_smem needs q_regs (the queries' shared memory free), got {tile}")
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, head_dim], dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], dtype)
    q_desc = TensorDescriptor(q, [num_tokens, num_heads * head_dim], [q.stride(0), 1], [block_m, head_dim], q_layout)
    width = num_kv_heads * head_dim
    k_desc = TensorDescriptor(k, [num_tokens, width], [k.stride(0), 1], [block_n, head_dim], kv_layout)
    v_desc = TensorDescriptor(v, [num_tokens, width], [v.stride(0), 1], [block_n, head_dim], kv_layout)
    k_cache = kv_cache[0]
    num_seqs = seq_lens.shape[0]
    args = (
        q_desc, k_desc, v_desc, k, v, k_cache, kv_cache[1],
        slot_mapping if slot_mapping is not None else query_start_loc,  # unused without the write
        seq_lens, query_start_loc, out, float(scale) * LOG2E, num_seqs,
        k.stride(0), v.stride(0), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
    )  # fmt: skip
    kwargs = dict(
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_SIZE=kv_cache.shape[2],
        STAGES=tile["stages"],
        WARPS=warps,
        SEQ_P=max(32 * warps, triton.next_power_of_2(num_seqs + 1)),
        WRITE_KV=slot_mapping is not None,
        ROW_LAYOUT=_row_layout(head_dim, warps),
        Q_REGS=tile["q_regs"],
        OUT_SMEM=tile["out_smem"],
        PRODUCER=tile["producer"],
        num_warps=warps,
    )
    if tile["producer"]:  # 4 + 1 warps take two warp groups: 128 registers each at launch keeps two programs per SM
        kwargs["maxnreg"] = 128
    grid = (num_heads, num_tokens // block_m + num_seqs)
    return _fresh_prefill_kernel, grid, args, kwargs


def launch_fresh_prefill(q, k, v, kv_cache, seq_lens, query_start_loc, out, scale: float, slot_mapping=None,
                         tile=None) -> None:  # fmt: skip
    """Write ``out`` rows (and with ``slot_mapping`` the cache's K/V rows) of the batch's fresh sequences."""
    kernel, grid, args, kwargs = fresh_prefill_launch(
        q, k, v, kv_cache, seq_lens, query_start_loc, out, scale, slot_mapping, tile
    )
    kernel[grid](*args, **kwargs)
