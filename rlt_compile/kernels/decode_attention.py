"""The decode paged-attention kernel (``_paged_attention_decode_kernel``): all-decode batches
(``num_tokens == num_seqs``, a shape-only choice, ``attention_config.uses_decode_kernel``).

One program per (token, KV head, context split), no search prologue on the fast path (sequence t
owns exactly token t; other rows count their sequence), the GQA group's heads as the rows of a
``tl.dot`` tile or, for MHA, q.K as a multiply + sum (no padded rows), the next tile's block-table
entries prefetched. ``rlt::attention_triton`` fuses the KV write into it (``FUSE_WRITE``): split 0
of (token, KV head) stores the new row and every split reads this step's keys from k/v themselves,
so no program waits for another's store.

With ``NUM_SPLITS > 1`` it is split-K (``attention_common``). ``FUSE_REDUCE`` merges the splits in
the kernel (config ``fuse_reduce``): each split with keys counts its arrival on a per-(token, KV head)
atomic counter (``_split_counters``) and the last one merges all partials, so split-K costs no
second launch; otherwise ``_split_reduce_kernel`` merges them.

PDL (see ``triton_attention``): with the KV write fused, the kernel reads its metadata (query
starts, sequence lengths, slot, the first tile's block-table entries) before the wait
(``EARLY_READS``, config ``early_reads``), since no kernel of a step writes it and those dependent
loads then overlap the previous kernel's tail; it still stores and returns only after the wait, but
for ``EARLY_EXIT`` (config ``early_exit``, off): splits other than split 0 without keys return
before it. It can also ask L2 to prefetch the first cached K/V tiles then (``L2_TILES``, config
``l2_prefetch``): a hint, not a load, so no ordering applies (L2 is the point of coherence).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlt_compile.kernels.attention_common import _block_ids, _merge_head
from rlt_compile.kernels.launch import pdl_trigger_first, pdl_wait


@triton.jit
def _decode_tile(
    q, k, v, n_valid, m_i, l_i, acc, scale_log2, ROWS: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr
):
    """One key tile of the decode kernel's online softmax: scores of ``q`` against ``k`` (invalid
    keys masked), the running max / sum / output rescaled and ``P @ V`` added; returns
    ``(m_i, l_i, acc)``. Without ``tl.dot``, ``q`` is already fp32 and scaled."""
    if USE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    elif ROWS == 1:
        s = tl.sum(q * k.to(tl.float32), axis=1)[None, :]
    else:
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    s = tl.where(n_valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if USE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    elif ROWS == 1:
        pv = tl.sum(tl.trans(p) * v.to(tl.float32), axis=0)[None, :]
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _merge_group(
    part_out_ptr, part_lse_ptr, t64, heads, rows_valid, num_valid, offs_d, d_mask, stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """``_merge_head`` for the rows ``heads`` ``[ROWS]`` of a GQA group at once: ``[ROWS, BLOCK_D]``
    (rows not ``rows_valid`` give zeros), over the first ``num_valid`` splits."""
    offs_s = tl.arange(0, NUM_SPLITS).to(tl.int64)
    s_valid = offs_s < num_valid
    lse = tl.load(
        part_lse_ptr + offs_s[None, :] * stride_ls + t64 * stride_lt + heads[:, None],
        mask=rows_valid[:, None] & s_valid[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )
    m = tl.max(lse, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m[:, None])  # [ROWS, NUM_SPLITS]; 0 for empty splits
    denom = tl.sum(w, axis=1)
    part_ptrs = (
        part_out_ptr
        + offs_s[None, :, None] * stride_ps
        + t64 * stride_pt
        + heads[:, None, None] * stride_ph
        + offs_d[None, None, :]
    )
    parts = tl.load(
        part_ptrs,
        mask=rows_valid[:, None, None] & s_valid[None, :, None] & d_mask[None, None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    return tl.sum(parts * w[:, :, None], axis=1) / tl.where(denom > 0.0, denom, 1.0)[:, None]


@triton.jit
def _prefetch_l2(ptrs, mask):
    """A hint, not a read: ``prefetch.global.L2`` of the lines at ``ptrs`` (where ``mask``), so a
    program can pull its first K/V tile into L2 before its PDL wait without holding it in registers
    (L2 is the GPU's point of coherence: nothing stale can come of it). NVIDIA only."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs.to(tl.int64), mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _decode_start(
    query_start_ptr, seq_lens_ptr, slot_ptr, block_tables_ptr, t, split, num_seqs, offs_n, stride_bt,
    SPLIT_GRAIN: tl.constexpr, BLOCK_SIZE: tl.constexpr, SEQ_CHUNK: tl.constexpr, NUM_SPLITS: tl.constexpr,
    FUSE_WRITE: tl.constexpr,
):  # fmt: skip
    """What a decode program reads from the metadata: returns ``(is_real, q_start, ctx_len, kv_lo,
    kv_hi, cache_hi, table, slot, block, active)``; keys ``[kv_lo, kv_hi)`` are this split's,
    ``[kv_lo, cache_hi)`` of them come from the cache, ``block`` holds the block-table entries of its
    first tile, and the first ``active`` splits of the token have keys (runs of ``SPLIT_GRAIN`` key
    positions are dealt to the splits in order, as evenly as whole runs allow, so a short context
    leaves the later splits empty)."""
    # Token t's sequence. Fast path (a pure decode row): sequence t owns exactly token t. Otherwise
    # (padding rows, or a multi-token sequence in a batch that merely has num_tokens == num_seqs) count.
    q_start = tl.load(query_start_ptr + t)
    q_end = tl.load(query_start_ptr + t + 1)
    seq_len = tl.load(seq_lens_ptr + t)
    seq = t
    if (q_start != t) | (q_end != t + 1):
        seq = 0  # the number of sequences ending at or before t; == num_seqs: a padding row past the last one
        for base in range(0, num_seqs, SEQ_CHUNK):
            offs_s = base + tl.arange(0, SEQ_CHUNK)
            ends = tl.load(query_start_ptr + 1 + offs_s, mask=offs_s < num_seqs, other=1 << 30)
            seq += tl.sum((ends <= t).to(tl.int32), axis=0)
        safe = tl.minimum(seq, num_seqs - 1)
        q_start = tl.load(query_start_ptr + safe)
        q_end = tl.load(query_start_ptr + safe + 1)
        seq_len = tl.where(seq < num_seqs, tl.load(seq_lens_ptr + safe), 0)
    is_real = seq < num_seqs
    ctx_len = seq_len - (q_end - q_start)  # cached positions; [ctx_len, seq_len) are this step's tokens
    kv_end = tl.where(is_real, ctx_len + (t - q_start) + 1, 0)  # causal: keys up to this token's position
    if NUM_SPLITS == 1:
        kv_lo = 0
        kv_hi = kv_end
        active = 1
    else:
        grains_per_split = tl.cdiv(tl.cdiv(kv_end, SPLIT_GRAIN), NUM_SPLITS)
        kv_lo = split * grains_per_split * SPLIT_GRAIN
        kv_hi = tl.minimum(kv_end, kv_lo + grains_per_split * SPLIT_GRAIN)
        active = tl.cdiv(kv_end, tl.maximum(grains_per_split, 1) * SPLIT_GRAIN)
    if FUSE_WRITE:
        cache_hi = tl.minimum(kv_hi, ctx_len)
        slot = tl.load(slot_ptr + t.to(tl.int64)).to(tl.int64)
    else:
        cache_hi = kv_hi
        slot = tl.full([], -1, tl.int64)
    table = block_tables_ptr + tl.minimum(seq, num_seqs - 1).to(tl.int64) * stride_bt
    block = _block_ids(table, kv_lo + offs_n, cache_hi, BLOCK_SIZE)
    return is_real, q_start, ctx_len, kv_lo, kv_hi, cache_hi, table, slot, block, active


def _paged_attention_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    scale_log2,
    num_seqs,
    head_dim,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SEQ_CHUNK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_GRAIN: tl.constexpr,
    USE_DOT: tl.constexpr,
    FUSE_WRITE: tl.constexpr,
    FUSE_REDUCE: tl.constexpr,
    EARLY_READS: tl.constexpr,
    EARLY_EXIT: tl.constexpr,
    EARLY_Q: tl.constexpr,
    PREFETCH: tl.constexpr,
    L2_TILES: tl.constexpr,
    L2_LINES: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_trigger_first(USE_PDL)
    # EARLY_READS: the metadata (sequence, context split, slot, the first tile's block-table entries)
    # is read before the PDL wait, while the previous kernel finishes: no kernel of a step writes it.
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    t64 = t.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    offs_n = tl.arange(0, BLOCK_N)
    head_off = kv_head.to(tl.int64) * stride_ch
    if EARLY_READS:
        is_real, q_start, ctx_len, kv_lo, kv_hi, cache_hi, table, slot, block, active = _decode_start(
            query_start_ptr, seq_lens_ptr, slot_ptr, block_tables_ptr, t, split, num_seqs, offs_n, stride_bt,
            SPLIT_GRAIN, BLOCK_SIZE, SEQ_CHUNK, NUM_SPLITS, FUSE_WRITE,
        )  # fmt: skip
        if L2_TILES > 0:  # the split's first L2_TILES cached tiles' K/V rows into L2, L2_LINES lines a row
            line = tl.arange(0, L2_LINES) * (BLOCK_D // L2_LINES)  # the first element of each line
            for i in tl.static_range(L2_TILES):
                pos_i = kv_lo + i * BLOCK_N + offs_n
                block_i = block
                if i > 0:
                    block_i = _block_ids(table, pos_i, cache_hi, BLOCK_SIZE)
                rows = block_i * stride_cb + (pos_i % BLOCK_SIZE).to(tl.int64) * stride_cs + head_off
                lines = rows[:, None] + line[None, :] * stride_cd
                lines_mask = (pos_i < cache_hi)[:, None] & (line[None, :] < head_dim)
                _prefetch_l2(k_cache_ptr + lines, lines_mask)
                _prefetch_l2(v_cache_ptr + lines, lines_mask)
        # EARLY_EXIT (fused merge only): a split without keys has nothing to wait for. Split 0 always
        # waits, so this grid still completes after the previous one (the PDL chain stays transitive).
        if EARLY_EXIT:  # noqa: SIM102 (constexpr, then runtime)
            if (split > 0) & (split >= active):
                return
    pdl_wait(USE_PDL)
    if not EARLY_READS:
        is_real, q_start, ctx_len, kv_lo, kv_hi, cache_hi, table, slot, block, active = _decode_start(
            query_start_ptr, seq_lens_ptr, slot_ptr, block_tables_ptr, t, split, num_seqs, offs_n, stride_bt,
            SPLIT_GRAIN, BLOCK_SIZE, SEQ_CHUNK, NUM_SPLITS, FUSE_WRITE,
        )  # fmt: skip

    offs_r = tl.arange(0, ROWS)
    head = kv_head * GROUP + offs_r
    row_valid = offs_r < GROUP
    q_ptrs = q_ptr + t64 * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    # Split 0 writes this token and head's K/V row (FUSE_WRITE; slot is -1 otherwise). EARLY_Q: q and
    # that row load in one memory round trip right after the wait, then the row is stored. Otherwise,
    # the order before session 18: split 0 loaded k, stored it, loaded v, stored it, then loaded q,
    # three round trips, and split 0 always has keys. (Storing the row only when the program leaves
    # kept it in registers through the key loop and spilled on sm_90.)
    write = offs_d < tl.where((split == 0) & (slot >= 0), head_dim, 0)  # (not scalar & block: interpreter)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head_off + offs_d * stride_cd
    k_src = k_ptr + t64 * stride_kt + kv_head * stride_kh + offs_d * stride_kd
    v_src = v_ptr + t64 * stride_vt + kv_head * stride_vh + offs_d * stride_vd
    if EARLY_Q:
        q = tl.load(q_ptrs, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
        if FUSE_WRITE:
            k_row = tl.load(k_src, mask=write)
            v_row = tl.load(v_src, mask=write)
            tl.store(k_cache_ptr + dst, k_row.to(k_cache_ptr.dtype.element_ty), mask=write)
            tl.store(v_cache_ptr + dst, v_row.to(v_cache_ptr.dtype.element_ty), mask=write)
    elif FUSE_WRITE:  # noqa: SIM102 (constexpr, then runtime)
        if (split == 0) & (slot >= 0):
            tl.store(k_cache_ptr + dst, tl.load(k_src, mask=d_mask).to(k_cache_ptr.dtype.element_ty), mask=d_mask)
            tl.store(v_cache_ptr + dst, tl.load(v_src, mask=d_mask).to(v_cache_ptr.dtype.element_ty), mask=d_mask)

    if not is_real:  # padding row: zeros
        if (NUM_SPLITS == 1) | FUSE_REDUCE:  # noqa: SIM102 (else the split reduce kernel writes them)
            if split == 0:
                o_ptrs = out_ptr + t64 * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
                zeros = tl.zeros([ROWS, BLOCK_D], dtype=out_ptr.dtype.element_ty)
                tl.store(o_ptrs, zeros, mask=row_valid[:, None] & d_mask[None, :])
        return
    if FUSE_REDUCE:  # noqa: SIM102 (constexpr, then runtime)
        if split >= active:  # no keys here: the merge weighs only the first `active` splits
            return

    if not EARLY_Q:
        q = tl.load(q_ptrs, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if USE_DOT:
        q = q.to(k_cache_ptr.dtype.element_ty)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty).to(tl.float32) * scale_log2

    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    # PREFETCH: the block-table entries of the next tile are loaded while this tile's K/V are in
    # flight, so each iteration waits for one memory round trip instead of two.
    for start in range(kv_lo, cache_hi, BLOCK_N):
        pos = start + offs_n
        n_valid = pos < cache_hi
        if not PREFETCH:
            block = _block_ids(table, pos, cache_hi, BLOCK_SIZE)
        kv_off = block * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs + head_off
        kv_mask = n_valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :] * stride_cd, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :] * stride_cd, mask=kv_mask, other=0.0)
        if PREFETCH:
            block = _block_ids(table, pos + BLOCK_N, cache_hi, BLOCK_SIZE)
        m_i, l_i, acc = _decode_tile(q, k, v, n_valid, m_i, l_i, acc, scale_log2, ROWS, USE_DOT, PRECISION)
    if FUSE_WRITE:  # this step's keys (the decode token itself) straight from k/v, in the cache dtype
        for start in range(tl.maximum(kv_lo, ctx_len), kv_hi, BLOCK_N):
            pos = start + offs_n
            n_valid = pos < kv_hi
            src = (q_start + pos - ctx_len).to(tl.int64)
            kv_mask = n_valid[:, None] & d_mask[None, :]
            k = tl.load(
                k_ptr + src[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :] * stride_kd,
                mask=kv_mask,
                other=0.0,
            ).to(k_cache_ptr.dtype.element_ty)
            v = tl.load(
                v_ptr + src[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                mask=kv_mask,
                other=0.0,
            ).to(v_cache_ptr.dtype.element_ty)
            m_i, l_i, acc = _decode_tile(q, k, v, n_valid, m_i, l_i, acc, scale_log2, ROWS, USE_DOT, PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    store_mask = row_valid[:, None] & d_mask[None, :]
    o_ptrs = out_ptr + t64 * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
    alone = NUM_SPLITS == 1
    if FUSE_REDUCE:
        alone = active == 1  # the only split with keys: no partials, no merge
    if alone:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        split64 = split.to(tl.int64)
        p_ptrs = part_out_ptr + split64 * stride_ps + t64 * stride_pt + head[:, None] * stride_ph
        tl.store(p_ptrs + offs_d[None, :], out, mask=store_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + split64 * stride_ls + t64 * stride_lt + head, lse, mask=row_valid)
        if FUSE_REDUCE:
            # The last split of (token, KV head) with keys to finish merges them all: count the finished
            # splits (the barrier orders every thread's partial stores before the release of the count).
            # Only `active` splits count: fewer atomics on one address and fewer partials to load.
            tl.debug_barrier()
            counter = counter_ptr + t64 * tl.num_programs(1) + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == active - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # every split has counted: reset
                if GROUP == 1:
                    merged = _merge_head(
                        part_out_ptr, part_lse_ptr, t64, kv_head, active, offs_d, d_mask,
                        stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, NUM_SPLITS,
                    )  # fmt: skip
                    o_row = out_ptr + t64 * stride_ot + kv_head * stride_oh + offs_d * stride_od
                    tl.store(o_row, merged.to(out_ptr.dtype.element_ty), mask=d_mask)
                else:  # the group's heads at once: one memory round trip, not one per head
                    merged = _merge_group(
                        part_out_ptr, part_lse_ptr, t64, head, row_valid, active, offs_d, d_mask,
                        stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, NUM_SPLITS,
                    )  # fmt: skip
                    tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=store_mask)


# Arrival counters of the decode kernel's fused split reduce, one per (token, KV head), per device.
# Every launch leaves them at zero (the last split resets its counter), so one zeroed buffer serves
# every launch on the device, in or out of CUDA graphs; launches on one device run in stream order.
_COUNTER_CAPACITY = 1 << 14
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """The zeroed counters of ``device``, or None (the launch then runs the separate reduce kernel)
    for more than ``_COUNTER_CAPACITY`` (token, KV head) pairs, or when they do not exist yet during
    CUDA-graph capture (a buffer allocated there would belong to the graph's memory pool)."""
    if needed > _COUNTER_CAPACITY:
        return None
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[device] = torch.zeros(_COUNTER_CAPACITY, dtype=torch.int32, device=device)
    return counters
