"""Triton pieces every paged-attention kernel shares: the block-table lookup (``_block_ids``), the
program -> (sequence, query tile) search of varlen grids (``_program_sequence``), and split-K's merge
(``_merge_head``) with the kernel that runs it as a separate launch (``_split_reduce_kernel``).

Split-K ("flash-decoding") writes, per context split, each row's normalised partial output
``[splits, T, H, D]`` (fp32) and its log2-sum-exp ``[splits, T, H]``; a split without keys has
lse = -inf and weighs nothing in the merge. Kernels are plain functions, jitted on first use
(``launch.kernel_for``); ``@triton.jit`` helpers are called from them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlt_compile.kernels.launch import pdl_trigger_first, pdl_wait

LOG2E = 1.4426950408889634  # softmax in the log2 domain: exp(x) = exp2(x * LOG2E)


@triton.jit
def _block_ids(table, pos, hi, BLOCK_SIZE: tl.constexpr):
    """The block-table entries (int64) of the KV blocks holding key positions ``pos`` of the row at
    ``table``; 0 for positions at or past ``hi``."""
    return tl.load(table + pos // BLOCK_SIZE, mask=pos < hi, other=0).to(tl.int64)


@triton.jit
def _program_sequence(pid, query_start_ptr, num_seqs, num_tokens, BLOCK_Q: tl.constexpr, SEQ_P: tl.constexpr):
    """Which sequence owns program ``pid`` of a grid of query tiles of ``BLOCK_Q`` tokens: the last
    ``s`` with ``query_start_loc[s] // BLOCK_Q + s <= pid`` (a strictly increasing sequence, so no
    host reads). ``s == num_seqs`` is the virtual sequence of the padding token rows past the last
    real one. Returns ``(seq, is_real, q_start, q_len, tile)``: ``tile`` is the program's query tile
    within the sequence (``>= cdiv(q_len, BLOCK_Q)``: nothing to do)."""
    offs_s = tl.arange(0, SEQ_P)
    starts = tl.load(query_start_ptr + offs_s, mask=offs_s <= num_seqs, other=1 << 28)
    seq = tl.sum((starts // BLOCK_Q + offs_s <= pid).to(tl.int32), axis=0) - 1  # >= 0: starts[0] is 0
    is_real = seq < num_seqs
    q_start = tl.load(query_start_ptr + seq)
    q_end = tl.where(is_real, tl.load(query_start_ptr + tl.minimum(seq + 1, num_seqs)), num_tokens)
    return seq, is_real, q_start, q_end - q_start, pid - (q_start // BLOCK_Q + seq)


@triton.jit
def _merge_head(
    part_out_ptr, part_lse_ptr, t64, h, num_valid, offs_d, d_mask, stride_ps, stride_pt, stride_ph, stride_ls,
    stride_lt, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Head ``h`` of token ``t64`` from the first ``num_valid`` of its split-K partial outputs and
    log2-sum-exps (0 for a padding row, which gives zeros; empty splits have lse = -inf and a zero
    output, and weigh nothing). Both loads are issued at once, one memory round trip: every split
    below ``num_valid`` has written both. Through L2 (``.cg``): other programs wrote them."""
    offs_s = tl.arange(0, NUM_SPLITS).to(tl.int64)
    s_valid = offs_s < num_valid  # (a scalar & block mask misbehaves in the interpreter)
    lse = tl.load(
        part_lse_ptr + offs_s * stride_ls + t64 * stride_lt + h, mask=s_valid, other=float("-inf"), cache_modifier=".cg"
    )
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for empty splits
    denom = tl.sum(w, axis=0)
    parts = tl.load(
        part_out_ptr + offs_s[:, None] * stride_ps + t64 * stride_pt + h * stride_ph + offs_d[None, :],
        mask=s_valid[:, None] & d_mask[None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    return tl.sum(parts * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)


def _split_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    query_start_ptr,
    out_ptr,
    num_seqs,
    head_dim,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    stride_od,
    NUM_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_trigger_first(USE_PDL)
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    valid = t < tl.load(query_start_ptr + num_seqs)  # padding token rows past the last sequence -> 0
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    out = _merge_head(
        part_out_ptr, part_lse_ptr, t, h, tl.where(valid, NUM_SPLITS, 0), offs_d, d_mask,
        stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, NUM_SPLITS,
    )  # fmt: skip
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + offs_d * stride_od, out.to(out_ptr.dtype.element_ty), mask=d_mask
    )
