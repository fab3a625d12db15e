"""Prefill attention that reads the step's own keys through TMA (NVIDIA Hopper and later).

In a prefill or prefill-chunk row most keys a query attends to are the step's own rows, which lie
contiguous in the ``k``/``v`` projections the op receives; only the cached prefix has to come from
the paged cache. The unified kernel (``triton_attention``) gathers every key from the cache, which
keeps it at about half of SDPA's speed on the H200 (docs/benchmarks.md). This kernel reads:

* the cached prefix ``[0, ctx_len)`` from the paged cache with pointer gathers (as the unified
  kernel does; every prefix tile carries the bounds mask, which only cuts the last one),
* the step's own rows through host-built TMA tensor descriptors over ``k``/``v`` ``[T, Hkv * D]``,
  which Triton pipelines with asynchronous bulk copies: the rows below the query tile's diagonal
  without a mask, the diagonal tiles with the causal mask.

One program per (query tile of a sequence, query head); the causally heaviest tile of each
sequence runs first. Programs map to sequences without host reads, like the unified kernel:
sequence ``s`` owns the programs from ``query_start_loc[s] // BLOCK_M + s`` on, and the virtual
sequence ``num_seqs`` covers the padding token rows past the last real one (written as zeros).
The softmax is online, in fp32 and in the log2 domain.

Served when ``uses_prefill_tma`` says so (a shape-only rule: NVIDIA with TMA, head dim a power of
two, not all decode rows, and for GQA an average query length of at least ``MIN_AVERAGE_QUERY``
tokens); ``attention_forward`` then
calls ``prefill_tma_attention`` with the slot mapping, and the kernel is the KV write too: the first
query head of each KV group stores its tile's own K/V rows as it reads them for the diagonal.
Measured on the H200 (docs/benchmarks.md, sessions 12-13; the op's whole call, KV write included):
1.41-1.72x the unified kernel on fresh prompts (Ouro and Nanbeige, 8 x 1k and 1 x 8k), 1.01-1.13x on
512-token chunks after a 2k cached prefix; the fused write is 1.05-1.17x for Ouro (MHA, more K/V per
token) and even for Nanbeige. On a decode-heavy mix GQA loses (0.44x: each query head re-reads the
context), which ``MIN_AVERAGE_QUERY`` keeps on the unified kernel; MHA does not (session 30, H100).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlt_compile import platform as _platform
from rlt_compile.kernels.attention_common import LOG2E, _block_ids, _program_sequence
from rlt_compile.kernels.attention_config import _check_config
from rlt_compile.kernels.launch import (
    interpreter_scope,
    is_interpreted,
    kernel_for,
    pdl_launch_options,
    pdl_mode,
    pdl_trigger_first,
    pdl_wait,
)

__all__ = ["MIN_AVERAGE_QUERY", "prefill_tma_attention", "prefill_tma_config", "uses_prefill_tma"]

REQUIRES = "supports_tma"  # the Platform capability this module's kernel is built for (kernels/aot.py)

# GQA batches whose queries average fewer tokens than this (decode-heavy mixed batches) stay on the
# unified kernel, whose programs cover a whole GQA group per K/V tile; here each query head of a decode
# row re-reads its context. H100, session 30, Nanbeige (48/8), one prompt and 31 decode rows: the unified
# kernel 1.15-1.5x faster at averages of 2-33 tokens, this op 1.03x at 65 and 1.16x at 129. MHA batches
# come here whenever a query has more than one token: the decode rows read what the unified kernel reads,
# faster (Ouro, the same mixes down to an average of 1.98: 1.36-1.41x the unified kernel).
MIN_AVERAGE_QUERY = 64
# the Gluon kernel's GLUON_TILE entries that the op's config overrides as gluon_<key> (gluon_block sets both
# block_m and block_n)
GLUON_TILE_KEYS = ("persistent", "snake", "dynamic", "stages")
# Softmax weights grow up to 2**rescale_slack between rescales: an fp16 p (max 65504) leaves room.
MAX_RESCALE_SLACK = 12


def _prefill_tma_kernel(
    q_ptr,
    k_desc,
    v_desc,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    scale_log2,
    num_seqs,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SEQ_P: tl.constexpr,
    PRECISION: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    RESCALE_SLACK: tl.constexpr,
    WRITE_KV: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_trigger_first(USE_PDL)
    pdl_wait(USE_PDL)
    if HEADS_FIRST:  # a tile's programs for every head launch together: the heaviest tiles of all heads first
        head = tl.program_id(0)
        pid = tl.program_id(1)
    else:
        pid = tl.program_id(0)
        head = tl.program_id(1)
    seq, is_real, q_start, q_len, tile = _program_sequence(pid, query_start_ptr, num_seqs, num_tokens, BLOCK_M, SEQ_P)
    num_tiles = tl.cdiv(q_len, BLOCK_M)
    if tile >= num_tiles:
        return
    tile = num_tiles - 1 - tile  # the causally heaviest tile first: less tail imbalance
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (q_start + offs_m).to(tl.int64)
    row_valid = offs_m < q_len
    o_ptrs = out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    if not is_real:  # padding token rows: zeros
        tl.store(o_ptrs, tl.zeros([BLOCK_M, HEAD_DIM], dtype=out_ptr.dtype.element_ty), mask=row_valid[:, None])
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len  # cached positions before the sequence's first query
    kv_head = head // GROUP
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=row_valid[:, None])
    q = q.to(k_cache_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: no NaN before the first key
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # The cached prefix, from the paged cache: every query sees all of it.
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_ch
    for start in range(0, ctx_len, BLOCK_N):
        pos = start + offs_n
        valid = pos < ctx_len
        block = _block_ids(table, pos, ctx_len, BLOCK_SIZE)
        kv_off = block * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs + head_off
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _key_tile(
            q, k, v, m_i, l_i, acc, scale_log2, valid[None, :], PRECISION, FOLD_SCALE, RESCALE_SLACK
        )

    # The step's own rows through TMA: below the tile's diagonal unmasked, then the diagonal tiles.
    col = kv_head * HEAD_DIM
    for start in range(0, m0, BLOCK_N):
        k = k_desc.load([q_start + start, col])
        v = v_desc.load([q_start + start, col])
        m_i, l_i, acc = _key_tile(q, k, v, m_i, l_i, acc, scale_log2, None, PRECISION, FOLD_SCALE, RESCALE_SLACK)
    for start in range(m0, tl.minimum(m0 + BLOCK_M, q_len), BLOCK_N):
        k = k_desc.load([q_start + start, col])
        v = v_desc.load([q_start + start, col])
        causal = offs_m[:, None] >= (start + offs_n)[None, :]
        m_i, l_i, acc = _key_tile(q, k, v, m_i, l_i, acc, scale_log2, causal, PRECISION, FOLD_SCALE, RESCALE_SLACK)
        if WRITE_KV:  # these are the tile's own rows: its group's first query head stores them
            pos = start + offs_n
            stored = tl.where(head % GROUP == 0, q_len, 0)  # rows this program stores
            slot = tl.load(slot_ptr + q_start + pos, mask=pos < stored, other=-1).to(tl.int64)
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head_off
            keep = (slot >= 0)[:, None]
            tl.store(k_cache_ptr + dst[:, None] + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=keep)
            tl.store(v_cache_ptr + dst[:, None] + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=keep)
    out = acc / l_i[:, None]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _key_tile(
    q, k, v, m_i, l_i, acc, scale_log2, keep, PRECISION: tl.constexpr, FOLD_SCALE: tl.constexpr,
    RESCALE_SLACK: tl.constexpr,
):  # fmt: skip
    """One key tile of the online softmax (``k``/``v`` ``[BLOCK_N, D]``; ``keep`` a mask broadcast
    over the scores, or None); returns ``(m_i, l_i, acc)``.

    ``FOLD_SCALE``: the row max is taken over the unscaled scores (the scale is positive) and the
    scale enters the exponent as one fused multiply-add, not a multiply of every score first.
    ``RESCALE_SLACK`` > 0: the running max only moves once some row's max has grown by more than
    that (log2 domain) since it last moved; until then ``acc`` and ``l_i`` are not rescaled, and the
    weights ``p`` stay below ``2**RESCALE_SLACK`` (exact in the fp32 sums, the same relative
    precision as a 16-bit ``p``). Any max gives the same softmax; only the work differs."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if not FOLD_SCALE:
        s = s * scale_log2
    if keep is not None:
        s = tl.where(keep, s, float("-inf"))
    m_tile = tl.max(s, axis=1)
    if FOLD_SCALE:
        m_tile = m_tile * scale_log2
    m_new = tl.maximum(m_i, m_tile)
    if RESCALE_SLACK == 0:
        alpha = tl.exp2(m_i - m_new)
    else:
        if tl.max(m_new - m_i, axis=0) > RESCALE_SLACK:  # one branch for the whole program
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
        m_new = m_i
    if FOLD_SCALE:
        p = tl.exp2(s * scale_log2 - m_new[:, None])
    else:
        p = tl.exp2(s - m_new[:, None])
    if RESCALE_SLACK == 0:
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    else:
        l_i = l_i + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return m_new, l_i, acc


def prefill_tma_config(interpret: bool, dtype: torch.dtype, config: dict) -> dict:
    """Tiles from dtypes only, then ``config`` (``block_m``, ``block_n``, ``warps``, ``stages``, and
    the key tile's ``fold_scale`` / ``rescale_slack``, see ``_key_tile``: on the H100 (session 25)
    ``fold_scale`` took Nanbeige's 1 x 8k prompt from 1746 to 1638 us and chunks 1-5% down, the rest
    within 1%, so it is on; ``rescale_slack`` was 3-14% slower on every case, so it is off;
    and ``heads_first``: the grid's first axis runs over the heads, so the launch order takes each
    sequence's heaviest tile for every head before its next tile, not all of a head's tiles before
    the next head, whose heaviest tiles then start late and run in the tail; a list-scheduling model
    of 264 resident programs puts the tail at 12-15% of Ouro's fresh prompts, under 1% heads first;
    on the H100, session 26, the op took 1.5-3.6% less on 1 x 8k prompts and prompts with decodes, the
    same on 8 x 1k within 2%, so it is on),
    and ``gluon_prefill``: the whole batch goes to the Gluon kernel of ``kernels/prefill_gluon.py``
    where the GPU has Hopper's ``wgmma`` (``Platform.supports_wgmma``) and the cache suits it
    (``prefill_gluon.supports``); unset means on, 0 keeps this kernel. On the H100 (session 29, the
    op with the KV write) the Gluon kernel took 0.88x / 0.97x this kernel's time on Nanbeige's (GQA
    48/8) 8 x 1k / 1 x 8k prompts and 0.61x on its chunks after a cached prefix; on Ouro's (MHA 16)
    1.01x / 0.99x on the prompts, 0.72x on the chunks and 0.94x on a prompt with decode rows;
    ``gluon_persistent``, ``gluon_snake``, ``gluon_dynamic``, ``gluon_block`` (its ``block_m`` =
    ``block_n``) and ``gluon_stages`` override its ``GLUON_TILE``.
    On the H200 (``benchmarks/prefill_tma_bench.py`` and session 12's probe, docs/benchmarks.md)
    64 x 64 tiles with 4 warps and 3 stages were the fastest on every fresh causal case of the op
    (Ouro and Nanbeige, 8 x 1k and 1 x 8k); 128 x 128 with 8 warps came second."""
    if interpret:
        cfg = {"block_m": 32, "block_n": 16, "warps": 4, "stages": 1}
    elif dtype == torch.float32:  # only when forced (uses_prefill_tma): a small tile
        cfg = {"block_m": 32, "block_n": 16, "warps": 4, "stages": 2}
    else:
        cfg = {"block_m": 64, "block_n": 64, "warps": 4, "stages": 3}
    cfg |= {"fold_scale": 1, "rescale_slack": 0, "heads_first": 1, "gluon_prefill": None}
    cfg |= {f"gluon_{key}": None for key in (*GLUON_TILE_KEYS, "block")}
    cfg.update({key: config[key] for key in cfg if config.get(key) is not None})
    if cfg["block_m"] % cfg["block_n"]:
        raise ValueError(f"prefill TMA tiles: block_m must be a multiple of block_n, got {cfg}")
    if not 0 <= cfg["rescale_slack"] <= MAX_RESCALE_SLACK:
        raise ValueError(f"rescale_slack must be in [0, {MAX_RESCALE_SLACK}], got {cfg['rescale_slack']}")
    return cfg


def uses_gluon_prefill(q: torch.Tensor, kv_cache: torch.Tensor, interpret: bool) -> bool:
    """Whether the Gluon kernel can take a prefill batch: a GPU with Hopper's ``wgmma``, a 16-bit ``q``
    and cache, a head dim it compiles for (``prefill_gluon.HEAD_DIMS``; the interpreter cannot run Gluon)
    and a cache it can read (``prefill_gluon.supports``)."""
    if interpret or q.dtype not in (torch.bfloat16, torch.float16) or kv_cache.dtype != q.dtype:
        return False
    if not _platform.current_platform().supports_wgmma:
        return False
    from rlt_compile.kernels.prefill_gluon import HEAD_DIMS, supports

    return q.shape[2] in HEAD_DIMS and supports(kv_cache)


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether ``t`` ``[T, Hkv, D]`` can back a TMA descriptor over ``[T, Hkv * D]`` as it is."""
    item = t.element_size()
    return t.stride(2) == 1 and t.stride(1) == t.shape[2] and (t.stride(0) * item) % 16 == 0 and t.data_ptr() % 16 == 0


def uses_prefill_tma(
    num_tokens: int,
    num_seqs: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype,
    config: dict | None = None,
    group: int = 1,
) -> bool:
    """Whether ``attention_forward`` sends a batch of this shape here (shapes only, no host reads):
    ``config["prefill_tma"]`` when given (the interpreter runs it only then), else an NVIDIA GPU with
    TMA (``Platform.supports_tma``), a 16-bit cache (fp32 dots in "ieee" precision spill this
    kernel's tiles on sm_90), a power-of-two head dim of at least 16 and, with GQA (``group`` query
    heads per KV head), queries of ``MIN_AVERAGE_QUERY`` tokens or more on average."""
    if num_tokens == 0 or num_seqs == 0 or num_tokens == num_seqs:
        return False
    if head_dim < 16 or head_dim & (head_dim - 1):
        return False
    forced = (config or {}).get("prefill_tma")
    if forced is not None:
        return bool(forced)
    if device.type != "cuda" or dtype == torch.float32 or not _platform.current_platform().supports_tma:
        return False
    return group == 1 or num_tokens >= MIN_AVERAGE_QUERY * num_seqs


def prefill_tma_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    precision: str = "ieee",
    config: dict | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [T, H, D]`` over each sequence's cached prefix (paged ``kv_cache``) and
    its own rows ``k``/``v [T, Hkv, D]``; returns ``out [T, H, D]``. With ``slot_mapping`` the kernel
    also stores those rows in the cache (the KV write); without it they must be there already. The
    prefix reads never touch the step's slots, so no program waits on another's store. CPU tensors
    run Triton's interpreter."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k/v must be [T, Hkv, D] = {(num_tokens, num_kv_heads, head_dim)}, got {tuple(k.shape)}")
    num_seqs = seq_lens.shape[0]
    interpret = is_interpreted(q)
    cfg = prefill_tma_config(interpret, kv_cache.dtype, _check_config(config))
    if q.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError(f"q and kv_cache need a unit stride over the head dim, got {q.stride()} / {kv_cache.stride()}")
    k = k if _tma_ready(k) else k.contiguous()
    v = v if _tma_ready(v) else v.contiguous()
    out = torch.empty_like(q)
    if (cfg["gluon_prefill"] is None or cfg["gluon_prefill"]) and uses_gluon_prefill(q, kv_cache, interpret):
        from rlt_compile.kernels.prefill_gluon import launch_gluon_prefill

        q_tma = q if _tma_ready(q) else q.contiguous()
        tile = {key: int(cfg[f"gluon_{key}"]) for key in GLUON_TILE_KEYS if cfg[f"gluon_{key}"] is not None}
        if cfg["gluon_block"] is not None:
            tile["block_m"] = tile["block_n"] = int(cfg["gluon_block"])
        launch_gluon_prefill(
            q_tma, k, v, kv_cache, block_tables, seq_lens, query_start_loc, out, scale, slot_mapping, tile
        )
        return out
    width = num_kv_heads * head_dim
    block = [cfg["block_n"], head_dim]
    k_desc = TensorDescriptor(k, [num_tokens, width], [k.stride(0), 1], block)
    v_desc = TensorDescriptor(v, [num_tokens, width], [v.stride(0), 1], block)
    if kv_cache.dtype != torch.float32:
        precision = "ieee"
    pdl = pdl_mode(q)
    k_cache = kv_cache[0]
    grid = (num_tokens // cfg["block_m"] + num_seqs + 1, num_heads)
    if cfg["heads_first"]:
        grid = grid[::-1]
    with interpreter_scope(interpret):
        kernel_for(_prefill_tma_kernel, interpret)[grid](
            q,
            k_desc,
            v_desc,
            k_cache,
            kv_cache[1],
            slot_mapping if slot_mapping is not None else query_start_loc,  # unused without the write
            block_tables,
            seq_lens,
            query_start_loc,
            out,
            float(scale) * LOG2E,
            num_seqs,
            num_tokens,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            block_tables.stride(0),
            GROUP=num_heads // num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_M=cfg["block_m"],
            BLOCK_N=cfg["block_n"],
            BLOCK_SIZE=block_size,
            SEQ_P=triton.next_power_of_2(num_seqs + 1),
            PRECISION=precision,
            FOLD_SCALE=bool(cfg["fold_scale"]),
            RESCALE_SLACK=int(cfg["rescale_slack"]),
            WRITE_KV=slot_mapping is not None,
            HEADS_FIRST=bool(cfg["heads_first"]),
            USE_PDL=pdl,
            num_warps=cfg["warps"],
            num_stages=cfg["stages"],
            **pdl_launch_options(pdl),
        )
    return out
