"""Triton paged-attention kernels and the ``rlt::attention_triton`` custom op.

These kernels serve the varlen batch layout of ``metadata.py``:

* ``_kv_write_kernel`` scatters this step's K/V rows into the paged cache plane
  ``kv_cache[2, num_blocks, block_size, Hkv, D]`` at ``slot_mapping[t]`` (negative = skip).
* ``_paged_attention_kernel`` is one "unified" kernel for a mixed batch: decode rows (one query),
  prefill and chunked-prefill rows (many queries, causal over the cached prefix plus themselves).
  A program owns one KV head and a tile of ``BLOCK_Q`` query tokens x all ``GROUP`` query heads
  sharing that KV head (GQA), so each K/V tile is read once per group. Tile rows are (token, head
  in group) pairs, ``GROUP_P`` rows per token: ``GROUP`` (no power-of-two padding; config
  ``pad_group``: its next power of two), so ``BLOCK_Q = BLOCK_M // GROUP_P`` and the last ``BLOCK_M
  % GROUP_P`` rows are idle. The softmax is online, in fp32 and in the log2 domain. Key tiles wholly
  at or below the query tile's first position run without any mask; only the diagonal and context-
  boundary tiles apply the causal / bounds mask (config ``mask_split``). Programs map to (sequence,
  query tile) without host reads: the grid's first axis has ``num_tokens // BLOCK_Q + num_seqs + 1``
  programs, an upper bound on the number of query tiles for any ``BLOCK_Q``, and sequence ``s`` owns
  the programs from ``query_start_loc[s] // BLOCK_Q + s`` on (a strictly increasing sequence, so each
  program finds its sequence by counting); config ``reverse_tiles`` runs a sequence's last (causally
  heaviest) query tile first.
* ``decode_attention._paged_attention_decode_kernel`` serves all-decode shapes, with the KV write
  fused into it (see that module).
* With ``NUM_SPLITS > 1`` either attention kernel is the first half of split-K ("flash-decoding"):
  every program handles one slice of the context and writes its normalised partial output plus
  its log2-sum-exp; ``attention_common._split_reduce_kernel`` then merges the slices, unless the
  decode kernel merges them itself (config ``fuse_reduce``, default on for MHA and for GQA up to
  16 splits).

PDL (Programmatic Dependent Launch, NVIDIA sm_90+, ``platform.pdl_enabled()`` / ``RLT_PDL``): on
CUDA tensors every kernel is launched with ``launch_pdl=True`` and ``USE_PDL`` 2 (1 with
``RLT_PDL_TRIGGER=wait``). Its first statement then is ``launch.pdl_trigger_first``
(``gdc_launch_dependents()``: let the next grid launch; with ``USE_PDL=1`` it comes right after the
wait), then ``launch.pdl_wait`` (``gdc_wait()``: block until the previous grid in the stream has
completed and its writes are visible). Triggering first is safe: a
grid completes only after all its programs passed their own wait, so the next kernel's wait still
orders it after every earlier kernel; it lets the next kernel's programs be resident and read their
weights while this one waits. The wait comes before every load, store and early return: a program
that exits without waiting would count as done, so the grid could complete before its predecessor
and the next kernel (which only waits for this one) could read stale data. One exception: the decode
kernel reads its metadata before the wait (``decode_attention``). With the trigger first, a kernel
can launch while several kernels before it still run: what it reads before its wait must be complete
before the nearest earlier kernel that triggers after its wait (Inductor's kernels) or not at all
(cuBLAS, copies, eager ops). The step's metadata is written by copies or eager ops before the
compiled step, so that holds. ``USE_PDL=0`` (CPU interpreter, ``meta`` tensors, ROCm, older GPUs)
compiles the prologue away.

Every grid size and tile choice depends on tensor shapes only (never on values), so the
launchers can run inside CUDA/HIP graph capture. Head dims that are not a power of two (Huginn
uses 96) are padded to the next power of two with masks. ``PRECISION`` is the ``tl.dot``
``input_precision`` ("ieee" or "tf32"); it only matters for fp32 caches.

On CPU tensors the kernels run in Triton's interpreter (bf16 is not exact there; use fp32/fp16);
``launch.py`` wraps them per mode and picks the PDL mode of each launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlt_compile import platform as _platform
from rlt_compile.kernels import prefill_tma
from rlt_compile.kernels.attention_common import LOG2E, _block_ids, _program_sequence, _split_reduce_kernel
from rlt_compile.kernels.attention_config import (
    CONFIG_KEYS,
    _check_config,
    _decode_tile_config,
    _mha_dot,
    _split_count,
    _tile_config,
    choose_decode_splits,
    choose_num_splits,
    decode_table_blocks,
    fits_two_waves,
    uses_decode_kernel,
)
from rlt_compile.kernels.decode_attention import _paged_attention_decode_kernel, _split_counters
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

__all__ = [
    "CONFIG_KEYS",
    "attention_forward",
    "attention_triton",
    "choose_decode_splits",
    "choose_num_splits",
    "fits_two_waves",
    "kv_write_triton",
    "paged_attention_triton",
    "uses_decode_kernel",
]

_PRECISIONS = ("ieee", "tf32")


# ----------------------------------------------------------------------------------------------
# Kernels (plain functions; wrapped with JITFunction / InterpretedFunction on first use)
# ----------------------------------------------------------------------------------------------


def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_kv_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_trigger_first(USE_PDL)
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    dst = block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    num_seqs,
    num_tokens,
    head_dim,
    stride_qt,
    stride_qh,
    stride_qd,
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
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SEQ_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MASK_SPLIT: tl.constexpr,
    REVERSE_TILES: tl.constexpr,
    EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_trigger_first(USE_PDL)
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The padding "sequence" (is_real False) has no context, so its rows come out as zeros through
    # the normal path.
    seq, is_real, q_start, q_len, tile = _program_sequence(pid, query_start_ptr, num_seqs, num_tokens, BLOCK_Q, SEQ_P)
    num_q_tiles = tl.cdiv(q_len, BLOCK_Q)
    if tile >= num_q_tiles:
        return
    if REVERSE_TILES:  # the last (causally heaviest) tiles first: less tail imbalance
        tile = num_q_tiles - 1 - tile
    q_off = tile * BLOCK_Q  # first query (within the sequence) of the tile
    seq_len = tl.where(is_real, tl.load(seq_lens_ptr + tl.minimum(seq, num_seqs - 1)), 0)
    ctx_len = seq_len - q_len  # position of the sequence's first query

    # Rows are (query token, head in group) pairs: row r -> token r // GROUP_P, head r % GROUP_P.
    # GROUP_P is GROUP (packed) or its next power of two (config pad_group); either way rows from
    # BLOCK_Q * GROUP_P on, and heads past GROUP, are padding.
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_off + offs_m // GROUP_P
    head_in_group = offs_m % GROUP_P
    head = kv_head * GROUP + head_in_group
    row_valid = (q_idx < q_len) & (head_in_group < GROUP) & (offs_m < BLOCK_Q * GROUP_P)
    q_pos = ctx_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim

    q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    # Keys this tile needs: positions [0, last query position + 1), and this split's slice of them.
    kv_end = tl.minimum(seq_len, ctx_len + tl.minimum(q_off + BLOCK_Q, q_len))
    if NUM_SPLITS == 1:
        kv_lo = 0
        kv_hi = kv_end
    else:
        num_tiles = tl.cdiv(kv_end, BLOCK_N)
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        kv_lo = split * tiles_per_split * BLOCK_N
        kv_hi = tl.minimum(kv_end, kv_lo + tiles_per_split * BLOCK_N)
    # MASK_SPLIT: the key tiles of [kv_lo, full_hi) lie wholly inside [kv_lo, kv_hi) and at or below
    # the tile's first query position, so every row sees all their keys and they need no mask; only
    # the diagonal / boundary tiles of [full_hi, kv_hi) do. (kv_lo is a multiple of BLOCK_N.)
    if MASK_SPLIT:
        full_hi = kv_lo + tl.maximum(tl.minimum(kv_hi, ctx_len + q_off + 1) - kv_lo, 0) // BLOCK_N * BLOCK_N
    else:
        full_hi = kv_lo

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_ch
    # Phase 0: the unmasked tiles [kv_lo, full_hi) (compiled only with MASK_SPLIT); phase 1: the
    # masked tiles [full_hi, kv_hi). The same loop body, specialised per phase at compile time.
    for phase in tl.static_range(0 if MASK_SPLIT else 1, 2):
        masked = phase == 1
        lo = full_hi if masked else kv_lo
        hi = kv_hi if masked else full_hi
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n
            n_valid = pos < kv_hi
            if masked:
                block = _block_ids(table, pos, kv_hi, BLOCK_SIZE)
            else:
                block = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
            kv_off = block * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs + head_off
            k_ptrs = k_cache_ptr + kv_off[None, :] + offs_d[:, None] * stride_cd  # [BLOCK_D, BLOCK_N]
            v_ptrs = v_cache_ptr + kv_off[:, None] + offs_d[None, :] * stride_cd  # [BLOCK_N, BLOCK_D]
            if masked:
                k = tl.load(k_ptrs, mask=n_valid[None, :] & d_mask[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=n_valid[:, None] & d_mask[None, :], other=0.0)
            elif EVEN_D:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            else:
                k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
            s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
            if masked:
                s = tl.where(n_valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    store_mask = row_valid[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        split64 = split.to(tl.int64)
        p_ptrs = part_out_ptr + split64 * stride_ps + token[:, None] * stride_pt + head[:, None] * stride_ph
        tl.store(p_ptrs + offs_d[None, :], out, mask=store_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + split64 * stride_ls + token * stride_lt + head, lse, mask=row_valid)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def kv_write_triton(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``k``/``v`` [T, Hkv, D] into ``kv_cache`` [2, blocks, block_size, Hkv, D] at ``slot_mapping``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    interpret = is_interpreted(k)
    pdl = pdl_mode(k)
    with interpreter_scope(interpret):
        kernel_for(_kv_write_kernel, interpret)[(num_tokens,)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            num_kv_heads,
            head_dim,
            *k.stride(),
            *v.stride(),
            *k_cache.stride(),
            BLOCK_SIZE=kv_cache.shape[2],
            BLOCK_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
            USE_PDL=pdl,
            num_warps=1 if num_kv_heads * head_dim <= 1024 else 4,
            **pdl_launch_options(pdl),
        )


def paged_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    precision: str = "ieee",
    split_k: bool | int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Paged causal attention of a varlen batch over ``kv_cache`` (same semantics as
    ``paged_attention_reference``). Returns a tensor like ``q`` (padding rows are zero).

    All-decode shapes (``num_tokens == num_seqs``) run ``_paged_attention_decode_kernel``, other
    batches the unified kernel. ``split_k``: None picks the split count from shapes
    (``choose_decode_splits`` / ``choose_num_splits``); False/0/1 disables split-K; True forces it
    (the heuristic's count, at least 2); an int >= 2 is the number of context splits (rounded up
    to a power of two). ``config`` overrides tiles and options for tuning (keys in ``CONFIG_KEYS``,
    each with its default in docs/kernels.md; defaults come from ``RLT_ATTENTION_CONFIG``). Nothing
    here reads tensor values on the host.
    """
    return _attention(
        q, None, None, kv_cache, None, block_tables, seq_lens, query_start_loc, scale, precision, split_k, config
    )


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    precision: str = "ieee",
    split_k: bool | int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """KV write + paged attention (the semantics of ``rlt::attention``). On the decode path the write
    is fused into the attention kernel (``config["fuse_write"]``; default: while the (sequence, KV
    head) programs fit in two waves): the program of (token, KV head, split 0) stores the new row, and
    every split reads this step's keys from ``k``/``v`` directly, so no program depends on another's
    store. Prefill-heavy batches on Hopper take the ``prefill_tma`` kernel (the step's own keys
    through TMA), which stores each query tile's own K/V rows as it reads them (``fuse_write=False``:
    ``kv_write_triton`` first). The rest run ``kv_write_triton``, then the unified kernel.
    Measured on the H200 (docs/benchmarks.md, session 7): the fused write wins at batch 1 (up to 1.17x at 8k context, within 5% either way at 128) and
    at Nanbeige batch 32 (1.07x at 128), but at batch 128 (GQA: 1024 programs) the separate write
    kernel is 1.07-1.18x faster."""
    config = _check_config(config)
    kv_heads = kv_cache.shape[3]
    sms = sm_count(q.device)
    fuse = config.get("fuse_write", fits_two_waves(seq_lens.shape[0], kv_heads, sms)) and uses_decode_kernel(
        q.shape[0], seq_lens.shape[0], config, q.shape[1] // kv_heads, kv_heads, sms
    )
    if not fuse or q.shape[0] == 0 or seq_lens.shape[0] == 0:
        shape = (q.shape[0], seq_lens.shape[0], q.shape[2], q.device, kv_cache.dtype)
        if prefill_tma.uses_prefill_tma(*shape, config, group=q.shape[1] // kv_heads):
            fuse_tma_write = config.get("fuse_write", True)
            if not fuse_tma_write:
                kv_write_triton(k, v, kv_cache, slot_mapping)
            return prefill_tma.prefill_tma_attention(
                q,
                k,
                v,
                kv_cache,
                block_tables,
                seq_lens,
                query_start_loc,
                scale,
                precision,
                config,
                slot_mapping=slot_mapping if fuse_tma_write else None,
            )
        kv_write_triton(k, v, kv_cache, slot_mapping)
        return _attention(
            q, None, None, kv_cache, None, block_tables, seq_lens, query_start_loc, scale, precision, split_k, config
        )
    if k.shape != (q.shape[0], *kv_cache.shape[3:]) or v.shape != k.shape:
        raise ValueError(f"k/v must be [T, Hkv, D] = {(q.shape[0], *kv_cache.shape[3:])}, got {tuple(k.shape)}")
    return _attention(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, precision, split_k, config
    )


def _attention(
    q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, precision, split_k, config
) -> torch.Tensor:
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
    config = _check_config(config)
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, kv_head_dim = kv_cache.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {kv_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return torch.zeros_like(q)
    out = torch.empty_like(q)  # every row is written, padding rows with zeros (no memset launch)
    if kv_cache.dtype != torch.float32:
        precision = "ieee"  # input_precision only matters for fp32 dots
    interpret = is_interpreted(q)
    pdl = pdl_mode(q)
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_sms = sm_count(q.device)
    plat = _platform.current_platform()
    nvidia = not interpret and plat.kind == "cuda"
    decode = uses_decode_kernel(num_tokens, num_seqs, config, group, num_kv_heads, num_sms)

    if decode:
        table_blocks = decode_table_blocks(block_tables.shape[1], block_size)
        cfg = _decode_tile_config(
            interpret,
            group_p,
            block_d,
            kv_cache.dtype,
            config,
            num_tokens * num_kv_heads,
            num_sms,
            max_context=table_blocks * block_size,
        )
        block_n = cfg["block_n"]
        grain = cfg["split_grain"] or block_n  # splits get runs of this many key positions
        num_splits = _split_count(
            split_k,
            config,
            lambda: choose_decode_splits(
                num_tokens,
                num_kv_heads,
                table_blocks,
                block_size,
                grain,
                num_sms,
                cfg["waves"],
                # the interpreter runs every program, empty or not
                cap_to_table=interpret or not cfg["fuse_reduce"],
            ),
        )
    else:
        compact = not interpret and plat.compact_attention_tiles
        cfg = _tile_config(interpret, num_tokens == num_seqs, group, block_d, kv_cache.dtype, compact, config, nvidia)
        num_splits = _split_count(
            split_k,
            config,
            lambda: choose_num_splits(
                num_tokens if split_k is None else num_seqs,
                num_seqs,
                num_kv_heads,
                block_tables.shape[1],
                block_size,
                cfg["BLOCK_N"],
                num_sms,
            ),
        )

    if num_splits > 1:
        part_out = torch.empty((num_splits, num_tokens, num_heads, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
        part_strides = (*part_out.stride()[:3], *part_lse.stride()[:2])
    else:  # unused placeholders
        part_out = part_lse = out
        part_strides = (0, 0, 0, 0, 0)
    counters = None  # the fused split reduce's arrival counters (None: the reduce kernel merges)
    if decode and num_splits > 1 and cfg["fuse_reduce"]:
        counters = _split_counters(q.device, num_tokens * num_kv_heads)
    fuse_reduce = counters is not None
    with interpreter_scope(interpret):
        if decode:
            fuse = k is not None
            use_dot = _mha_dot(num_splits) if cfg["use_dot"] is None else bool(cfg["use_dot"])
            early = fuse and bool(cfg["early_reads"])
            kernel_for(_paged_attention_decode_kernel, interpret)[(num_tokens, num_kv_heads, num_splits)](
                q,
                k if fuse else q,
                v if fuse else q,
                k_cache,
                v_cache,
                slot_mapping if fuse else seq_lens,
                block_tables,
                seq_lens,
                query_start_loc,
                out,
                part_out,
                part_lse,
                counters if fuse_reduce else out,  # out: an unused placeholder
                float(scale) * LOG2E,
                num_seqs,
                head_dim,
                *q.stride(),
                *(k.stride() if fuse else (0, 0, 0)),
                *(v.stride() if fuse else (0, 0, 0)),
                *out.stride(),
                *k_cache.stride(),
                block_tables.stride(0),
                *part_strides,
                GROUP=group,
                ROWS=max(16, group_p) if use_dot else group_p,
                BLOCK_N=block_n,
                BLOCK_D=block_d,
                BLOCK_SIZE=block_size,
                SEQ_CHUNK=64,  # fixed (not from num_seqs): one compile serves every batch size
                NUM_SPLITS=num_splits,
                SPLIT_GRAIN=grain,
                USE_DOT=use_dot,
                FUSE_WRITE=fuse,
                FUSE_REDUCE=fuse_reduce,
                EARLY_READS=early,
                EARLY_EXIT=early and fuse_reduce and bool(cfg["early_exit"]),
                EARLY_Q=bool(cfg["early_q"]),
                PREFETCH=bool(cfg["prefetch"]),
                L2_TILES=int(cfg["l2_prefetch"]) if early and nvidia else 0,  # a PTX hint: NVIDIA only
                L2_LINES=triton.cdiv(block_d * kv_cache.element_size(), 128),
                PRECISION=precision,
                USE_PDL=pdl,
                num_warps=cfg["warps"],
                num_stages=cfg["stages"],
                **pdl_launch_options(pdl),
            )
        else:
            # Upper bound on the query tiles of the sequences plus the padding rows (shapes only).
            grid = (num_tokens // cfg["BLOCK_Q"] + num_seqs + 1, num_kv_heads, num_splits)
            kernel_for(_paged_attention_kernel, interpret)[grid](
                q,
                k_cache,
                v_cache,
                block_tables,
                seq_lens,
                query_start_loc,
                out,
                part_out,
                part_lse,
                float(scale) * LOG2E,
                num_seqs,
                num_tokens,
                head_dim,
                *q.stride(),
                *out.stride(),
                *k_cache.stride(),
                block_tables.stride(0),
                *part_strides,
                GROUP=group,
                GROUP_P=cfg["GROUP_P"],
                BLOCK_Q=cfg["BLOCK_Q"],
                BLOCK_M=cfg["BLOCK_M"],
                BLOCK_N=cfg["BLOCK_N"],
                BLOCK_D=block_d,
                BLOCK_SIZE=block_size,
                SEQ_P=triton.next_power_of_2(num_seqs + 1),
                NUM_SPLITS=num_splits,
                MASK_SPLIT=cfg["MASK_SPLIT"],
                REVERSE_TILES=cfg["REVERSE_TILES"],
                EVEN_D=block_d == head_dim,
                PRECISION=precision,
                USE_PDL=pdl,
                num_warps=cfg["warps"],
                num_stages=cfg["stages"],
                **pdl_launch_options(pdl),
            )
        if num_splits > 1 and not fuse_reduce:
            kernel_for(_split_reduce_kernel, interpret)[(num_tokens, num_heads)](
                part_out,
                part_lse,
                query_start_loc,
                out,
                num_seqs,
                head_dim,
                *part_out.stride()[:3],
                *part_lse.stride()[:2],
                *out.stride(),
                NUM_SPLITS=num_splits,
                BLOCK_D=block_d,
                USE_PDL=pdl,
                num_warps=config.get("reduce_warps") or (4 if block_d >= 128 else 2),
                **pdl_launch_options(pdl),
            )
    return out


# ----------------------------------------------------------------------------------------------
# Custom op
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("rlt::attention_triton", mutates_args=("kv_cache",))
def attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    precision: str = "ieee",
) -> torch.Tensor:
    """The Triton backend of ``rlt::attention``: KV write, then paged attention (``attention_forward``:
    fused into one launch for all-decode batches).

    ``precision`` is the ``tl.dot`` input precision for fp32 caches ("ieee" or "tf32"; the
    dot-precision pass sets it from ``Platform.dot_precision``)."""
    return attention_forward(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, precision)


@attention_triton.register_fake
def _attention_triton_fake(
    q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, precision="ieee"
):
    return torch.empty_like(q)
