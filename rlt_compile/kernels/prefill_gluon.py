"""Causal prefill attention in Gluon (NVIDIA Hopper): FlashAttention-3's order in a warp group.

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

That is the PTX's order; ptxas, though, moves the wait for PV(j-1) above the softmax (session 31:
the SASS has no exponential between the PV issue and its wait), so the softmax runs only beside the
other warp group's tensor-core work. A loop rotated so that the wait came before the PV issue kept 34
exponentials beside it in the SASS, but in the op it was 3-16% slower on six of eight cases and within 1%
on the other two (H100, session 32), so it was removed.

It serves a whole prefill batch, as ``prefill_tma_attention`` does: ``q`` ``[T, H, D]``, each
sequence's cached prefix from the paged cache and its own keys ``k``/``v`` ``[T, Hkv, D]``, and it
stores those own K/V rows in the cache (the first query head of each KV group). Work items are
(query tile, head) pairs, heads first, mapped to sequences as in the other kernels (sequence ``s``
owns tiles ``query_start_loc[s] // BLOCK_M + s`` on, its causally heaviest tile first; the virtual
sequence ``num_seqs`` is the padding token rows, written as zeros; no host reads). By default two
programs per SM take the items in that order from a counter in global memory (``dynamic``: greedy,
as the hardware schedules one program per item), so each program's copy warp fetches the next item's
tiles while its warp group finishes the current one; the last program to finish zeroes the counter
(a first launch inside CUDA-graph capture, before the counters exist, takes one program per item).
Partitions
(``gl.warp_specialize``): a copy warp issues every TMA copy -- the query tile, the prefix's key /
value tiles as one box per cache block (or per ``BLOCK_N`` rows of a larger block) and the own
rows' tiles -- into a ring of ``STAGES`` shared-memory stages; one consumer warp group per 64 query
rows (one or two) waits for the tiles, computes and frees the stages. The output rows leave through
the last key stage as 16-byte stores.

Measured (H100, sessions 29-30; ``benchmarks/prefill_tma_bench.py``, the op with the KV write,
docs/benchmarks.md): with one program per item 0.88x / 0.97x the TMA kernel's time on Nanbeige's
(GQA 48/8) 8 x 1k / 1 x 8k prompts and 0.61x on its chunks after a cached prefix, 0.99-1.01x on
Ouro's (MHA 16) prompts and 0.72x on its chunks; the dynamic order then took 0.82x / 0.95x / 0.97x
of that time on Nanbeige's prompts and chunks, 0.86x / 0.95x / 0.88x on Ouro's. Against gather +
SDPA (cuDNN) that is 1.26x / 0.99x on Ouro's prompts, 1.01x / 0.93x on Nanbeige's. Long prompts (queries
averaging ``LONG_PROMPT_TOKENS``) take 128-row tiles (``LONG_PROMPT_TILE``, session 32): 1 x 8k then
1.17x / 1.07x gather + SDPA's speed on Ouro / Nanbeige.
Gluon runs on the GPU only (Triton's interpreter cannot run it); it is tested on the device and
compiled offline for sm_90 in the CPU suite. 16-bit only, head dims of 64 and 128 (``HEAD_DIMS``), a
contiguous cache with blocks of at least 8 slots (``supports``).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from rlt_compile.kernels.attention_common import LOG2E
from rlt_compile.kernels.launch import sm_count

__all__ = [
    "GLUON_TILE",
    "HEAD_DIMS",
    "LONG_PROMPT_TILE",
    "LONG_PROMPT_TOKENS",
    "launch_tile",
    "gluon_prefill_launch",
    "launch_gluon_prefill",
    "supports",
]
REQUIRES = "supports_wgmma"  # the Platform capability this module's kernel is built for (kernels/aot.py)

# triton 3.6 (the device image) names the TMA load async_copy_global_to_shared; later versions async_load
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# and the CTA (in a warp_specialize partition: the partition's) barrier thread_barrier; later versions barrier
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

# block_m, block_n, stages and warps: 64-row tiles take one consumer warp group per program (plus the copy warp),
# two programs per SM (112 KiB of shared memory each at head dim 128); every tile that left one such program per
# SM was 20-40% slower (session 25). 128-row tiles take two consumer warp groups of 64 query rows, which share
# each key tile (FlashAttention-3's split; one program per SM, 160 KiB with 2 stages, 224 KiB with 3): 1.0-1.3x
# the 64-row tiles' time in the op (session 30; 2.4x on a prompt with 31 decode rows), so not the default.
# block_m must equal block_n: the last key tile is then the query tile's own rows,
# which the KV write and the output's staging use in place. warps: 4 (a warp group).
# persistent: 0 launches one program per (query tile, head); N > 0 launches N programs per SM that take the
# work items in turn, so the copy warp fetches the next item's queries and first key tiles while the warp
# group finishes the current one. In stride order (program p takes items p, p + programs, ...) that was 5-21%
# slower in the op (session 29): with the items heaviest first within a sequence, a program kept drawing items
# of one weight (benchmarks/schedule_model.py: up to 1.6x the ideal load). snake: 1 reverses every other round
# (balances single prompts only; not timed). dynamic: 1 takes the items from a counter in global memory in
# their order (greedy: the next free program takes the next item), the default: 0.82-0.97x the time of one
# program per item on the prompts and chunks of both models, 1.02x / 0.96x on Ouro's / Nanbeige's prompt with
# 31 decode rows (H100, session 30)
GLUON_TILE = {"block_m": 64, "block_n": 64, "stages": 3, "warps": 4, "persistent": 2, "snake": 0, "dynamic": 1}

# Batches whose queries average LONG_PROMPT_TOKENS or more (head dim 128) take LONG_PROMPT_TILE over GLUON_TILE:
# 128-row tiles (two consumer warp groups), three stages (229752 B of shared memory) and one program per SM. H100,
# session 32, the kernel alone on fresh prompts of Ouro (16 heads) and Nanbeige (48/8): 0.82-0.96x the default's time
# at 2 x 4096 to 1 x 16384; at 2048-token prompts 0.96-1.08x (no clear winner), at 1k and 512 1.06-1.21x. In the op,
# 1 x 8k: 0.85x (Ouro) and 0.84x (Nanbeige); a prompt with 31 decode rows beside it 1.09-1.71x (its average query
# is far below the threshold).
LONG_PROMPT_TOKENS = 4096
LONG_PROMPT_TILE = {"block_m": 128, "block_n": 128, "stages": 3, "persistent": 1}

# head dims the kernel compiles for on sm_90: at 256 ptxas runs out of registers (it asks for 158 at launch, where
# two programs per SM allow 128)
HEAD_DIMS = (64, 128)

# per device: the dynamic order's two counters (next item, programs done), zero between launches
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor | None:
    """The dynamic order's counters on ``device``, made (zeroed) at the first launch there; None when they
    do not exist yet during CUDA-graph capture (a buffer made there would belong to the graph's memory pool
    and stay unzeroed until its first replay), where the launch then takes one program per item. Launches
    that use them run one after another (one stream, as the engine's steps and their graphs do)."""
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _COUNTERS[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return _COUNTERS[device]


@gluon.jit
def _find_item(query_start_ptr, seq_lens_ptr, item, num_heads, num_seqs, num_tokens, BLOCK_M: gl.constexpr,
               CHUNK: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """Work item ``item`` -> ``(kind, head, seq, q_start, q_len, ctx_len, m0)``: items run heads first over
    the query tiles of the other kernels' mapping (sequence ``s`` owns tiles ``query_start_loc[s] //
    BLOCK_M + s`` on, its causally heaviest first; the virtual sequence ``num_seqs`` is the padding
    token rows). ``kind``: 1 attend (rows ``m0 ..`` of the sequence, ``ctx_len`` cached positions
    before its first query), 2 padding rows to zero, 0 nothing (past a sequence's tiles)."""
    head = item % num_heads
    pid = item // num_heads
    # the owning sequence: the last s with query_start_loc[s] // BLOCK_M + s <= pid (s = 0 always is)
    count = gl.to_tensor(0)
    for c in range(0, num_seqs + 1, CHUNK):
        offs_s = c + gl.arange(0, CHUNK, layout=layout)
        starts = gl.load(query_start_ptr + offs_s, mask=offs_s <= num_seqs, other=1 << 28)
        count += gl.sum((starts // BLOCK_M + offs_s <= pid).to(gl.int32), axis=0)
    seq = count - 1
    real = seq < num_seqs
    q_start = gl.load(query_start_ptr + seq)
    q_end = gl.where(real, gl.load(query_start_ptr + gl.minimum(seq + 1, num_seqs)), num_tokens)
    q_len = q_end - q_start
    ctx_len = gl.where(real, gl.load(seq_lens_ptr + gl.minimum(seq, num_seqs - 1)) - q_len, 0)
    num_tiles = (q_len + BLOCK_M - 1) // BLOCK_M
    rank = pid - (q_start // BLOCK_M + seq)
    kind = gl.where(rank < num_tiles, gl.where(real, 1, 2), 0)
    return kind, head, seq, q_start, q_len, ctx_len, (num_tiles - 1 - rank) * BLOCK_M


@gluon.jit
def _snake(i, SNAKE: gl.constexpr):
    """The work item of a program's loop index ``i`` (``pid``, ``pid + programs``, ...): ``i`` itself, or
    with ``SNAKE`` (persistent programs) every other round reversed, so that the program taking a round's
    heaviest item takes the next round's lightest (the items come heaviest first within each sequence)."""
    if SNAKE:
        programs = gl.num_programs(0)
        turn = i // programs
        i = gl.where(turn % 2 == 1, turn * programs + programs - 1 - gl.program_id(0), i)
    return i


@gluon.jit
def _softmax(s, m_i, l_i, offs_m, j, num_pre, ctx_len, m0, scale_log2, BLOCK_N: gl.constexpr,
             col_layout: gl.constexpr):  # fmt: skip
    """Online softmax of key tile ``j``'s raw scores (log2 domain, the scale inside the exponent). Tiles
    below ``num_pre`` are the cached prefix: the last one masked past ``ctx_len``; then the own rows'
    tiles, causally masked where they reach the query tile's diagonal."""
    if j < num_pre:
        if j * BLOCK_N + BLOCK_N > ctx_len:
            offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
            s = gl.where(offs_n[None, :] < ctx_len, s, float("-inf"))
    else:
        own = j - num_pre
        if own * BLOCK_N + BLOCK_N > m0:
            offs_n = own * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
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
def _store_rows(rows, out_ptr, q_start, m0, q_len, head, stride_ot, stride_oh, HEAD_DIM: gl.constexpr,
                BLOCK_M: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """Store ``rows`` as the output rows ``m0 ..`` (at most ``BLOCK_M``, within ``q_len``) of ``head``."""
    offs_r = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = head * stride_oh + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    ptrs = out_ptr + (q_start + offs_r).to(gl.int64)[:, None] * stride_ot + cols[None, :]
    gl.store(ptrs, rows, mask=(offs_r < q_len)[:, None])


# the barriers' slots: a query tile landed / its buffer free again, then STAGES each of key tile landed,
# value tile landed, stage free again, then (two warp groups) both groups' last reads of a key tile done,
# before either stages its output rows in it
Q_BAR = gl.constexpr(0)
Q_FREE = gl.constexpr(1)
K_BARS = gl.constexpr(2)
# registers a thread of each of two consumer warp groups after setmaxnreg (launched at 168: three warp groups
# of registers in the SM's 64K, the copy warp's group then lowered to 24)
CONSUMER_REGS = gl.constexpr(240)


@gluon.jit
def _gluon_prefill_kernel(
    q_desc,
    k_desc,
    v_desc,
    k_cache_desc,
    v_cache_desc,
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
    num_heads,
    num_items,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    BOX_ROWS: gl.constexpr,
    STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr,
    WARPS: gl.constexpr,
    WRITE_KV: gl.constexpr,
    ROW_LAYOUT: gl.constexpr,
    SNAKE: gl.constexpr = False,
    DYNAMIC: gl.constexpr = False,
    counter_ptr=None,
):
    dtype: gl.constexpr = q_desc.block_type.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    NUM_BARS: gl.constexpr = K_BARS + 3 * STAGES + CONSUMERS - 1  # OUT_BAR with two warp groups
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BARS):
        if i == Q_FREE or i >= K_BARS + 2 * STAGES:  # the ones every warp group arrives on
            mbarrier.init(bars.index(i), count=CONSUMERS)
        else:
            mbarrier.init(bars.index(i), count=1)
    descs = (q_desc, k_desc, v_desc, k_cache_desc, v_cache_desc)
    if DYNAMIC:  # the copy warp's hand-over of each item's fields
        info = gl.allocate_shared_memory(gl.int32, [8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        info = bars  # unused
    smem = (q_smem, k_smem, v_smem, bars, info)
    ptrs = (k_cache_ptr, v_cache_ptr, slot_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr)
    sizes = (num_seqs, num_tokens, num_heads, num_items, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
             stride_bt)  # fmt: skip
    # argument tuples inline: a tuple bound to a name turns its items into tensors, which a layout cannot be
    if CONSUMERS == 1:
        gl.warp_specialize(
            [(_attend, (descs, smem, ptrs, sizes, scale_log2, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE, BOX_ROWS,
                        0, 1, WARPS, WRITE_KV, ROW_LAYOUT, SNAKE, DYNAMIC)),
             (_copy_warp, (descs, smem, ptrs, sizes, counter_ptr, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE,
                           BOX_ROWS, SNAKE, DYNAMIC))],
            [1],
            [24],
        )  # fmt: skip
    else:  # two warp groups share each key tile, the query tile's upper and lower rows
        gl.warp_specialize(
            [(_attend, (descs, smem, ptrs, sizes, scale_log2, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE, BOX_ROWS,
                        0, 2, WARPS, WRITE_KV, ROW_LAYOUT, SNAKE, DYNAMIC)),
             (_attend, (descs, smem, ptrs, sizes, scale_log2, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE, BOX_ROWS,
                        1, 2, WARPS, WRITE_KV, ROW_LAYOUT, SNAKE, DYNAMIC)),
             (_copy_warp, (descs, smem, ptrs, sizes, counter_ptr, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE,
                           BOX_ROWS, SNAKE, DYNAMIC))],
            [WARPS, 1],
            [CONSUMER_REGS, 24],
        )  # fmt: skip


@gluon.jit
def _load_own(k_desc, v_desc, k_smem, v_smem, bars, stage, row, col, BLOCK_N: gl.constexpr):
    """Start the TMA copies of the own rows' key/value tile at ``row`` into ring stage ``stage``."""
    STAGES: gl.constexpr = k_smem.shape[0]
    nbytes: gl.constexpr = BLOCK_N * k_desc.block_type.shape[1] * 2
    mbarrier.expect(bars.index(K_BARS + stage), nbytes)
    _tma_load(k_desc, [row, col], bars.index(K_BARS + stage), k_smem.index(stage))
    mbarrier.expect(bars.index(K_BARS + STAGES + stage), nbytes)
    _tma_load(v_desc, [row, col], bars.index(K_BARS + STAGES + stage), v_smem.index(stage))


@gluon.jit
def _load_prefix(k_desc, v_desc, k_smem, v_smem, bars, stage, table, start, ctx_len, col, BLOCK_N: gl.constexpr,
                 BLOCK_SIZE: gl.constexpr, BOX_ROWS: gl.constexpr):  # fmt: skip
    """Start the TMA copies of the cached prefix's key/value tile at position ``start`` into ring stage
    ``stage``: one box of ``BOX_ROWS`` rows per cache block (its rows are contiguous in the cache viewed
    as ``[blocks * block_size, Hkv * D]``). Boxes wholly past ``ctx_len`` copy the cache's first rows
    (every box is copied: the tile's byte count stays fixed), which the warp group's mask and zeroing
    discard."""
    STAGES: gl.constexpr = k_smem.shape[0]
    nbytes: gl.constexpr = BLOCK_N * k_desc.block_type.shape[1] * 2
    mbarrier.expect(bars.index(K_BARS + stage), nbytes)
    mbarrier.expect(bars.index(K_BARS + STAGES + stage), nbytes)
    for b in gl.static_range(BLOCK_N // BOX_ROWS):
        pos = start + b * BOX_ROWS
        valid = pos < ctx_len
        block = gl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
        row = gl.where(valid, block * BLOCK_SIZE + pos % BLOCK_SIZE, 0)
        _tma_load(k_desc, [row, col], bars.index(K_BARS + stage), k_smem.index(stage).slice(b * BOX_ROWS, BOX_ROWS))
        _tma_load(v_desc, [row, col], bars.index(K_BARS + STAGES + stage),
                  v_smem.index(stage).slice(b * BOX_ROWS, BOX_ROWS))  # fmt: skip


@gluon.jit
def _copy_item(descs, smem, ptrs, sizes, ring, head, seq, q_start, q_len, ctx_len, m0, GROUP: gl.constexpr,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr,
               BOX_ROWS: gl.constexpr):  # fmt: skip
    """The copies of one work item (its query buffer free): the query tile, then the prefix's and the own
    rows' key/value tiles into the ring as the warp group frees stages. Returns the ring's count after it."""
    q_desc, k_desc, v_desc, k_cache_desc, v_cache_desc = descs
    q_smem, k_smem, v_smem, bars = smem[0], smem[1], smem[2], smem[3]
    block_tables_ptr, stride_bt = ptrs[3], sizes[9]
    STAGES: gl.constexpr = k_smem.shape[0]
    FREE: gl.constexpr = K_BARS + 2 * STAGES
    mbarrier.expect(bars.index(Q_BAR), BLOCK_M * HEAD_DIM * 2)
    _tma_load(q_desc, [q_start + m0, head * HEAD_DIM], bars.index(Q_BAR), q_smem)
    col = (head // GROUP) * HEAD_DIM
    num_pre = (ctx_len + BLOCK_N - 1) // BLOCK_N
    table = block_tables_ptr + seq.to(gl.int64) * stride_bt
    for j in range(num_pre):
        stage = (ring + j) % STAGES
        mbarrier.wait(bars.index(FREE + stage), (((ring + j) // STAGES) & 1) ^ 1)
        _load_prefix(k_cache_desc, v_cache_desc, k_smem, v_smem, bars, stage, table, j * BLOCK_N, ctx_len, col,
                     BLOCK_N, BLOCK_SIZE, BOX_ROWS)  # fmt: skip
    ring += num_pre
    num_own = (gl.minimum(m0 + BLOCK_M, q_len) + BLOCK_N - 1) // BLOCK_N
    for j in range(num_own):
        stage = (ring + j) % STAGES
        mbarrier.wait(bars.index(FREE + stage), (((ring + j) // STAGES) & 1) ^ 1)
        _load_own(k_desc, v_desc, k_smem, v_smem, bars, stage, q_start + j * BLOCK_N, col, BLOCK_N)
    return ring + num_own


@gluon.jit
def _post_item(info, kind, head, q_start, q_len, ctx_len, m0):
    """The copy warp hands an item's fields to the warp groups through shared memory ``info`` (read
    once the query barrier's turn completes: the arrive after these stores releases them)."""
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [1], [0])
    offs = gl.arange(0, 8, layout=layout)
    fields = gl.where(offs == 0, kind, gl.where(offs == 1, head, gl.where(offs == 2, q_start, 0)))
    fields = gl.where(offs == 3, q_len, gl.where(offs == 4, ctx_len, gl.where(offs == 5, m0, fields)))
    info.store(fields)
    _barrier()  # every lane's stores before the one thread's arrive


@gluon.jit
def _field(fields, offs, k: gl.constexpr):
    return gl.sum(gl.where(offs == k, fields, 0), axis=0)


@gluon.jit
def _read_item(info, WARPS: gl.constexpr):
    """The fields ``_post_item`` stored: ``(kind, head, q_start, q_len, ctx_len, m0)``."""
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [WARPS], [0])
    fields = info.load(layout)
    offs = gl.arange(0, 8, layout=layout)
    return (_field(fields, offs, 0), _field(fields, offs, 1), _field(fields, offs, 2), _field(fields, offs, 3),
            _field(fields, offs, 4), _field(fields, offs, 5))  # fmt: skip


@gluon.jit
def _copy_warp(descs, smem, ptrs, sizes, counter_ptr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, BOX_ROWS: gl.constexpr,
               SNAKE: gl.constexpr, DYNAMIC: gl.constexpr):  # fmt: skip
    """The copy warp: each item's copies (``_copy_item``) once the warp group holds the previous query
    tile in registers. Items come from the program's loop index or, ``DYNAMIC``, from the shared counter
    ``counter_ptr[0]`` (the next item of the launch), heaviest first within a sequence: greedy list
    scheduling, as the hardware does for one program per item. The last program to finish (counted in
    ``counter_ptr[1]``) sets both back to zero for the next launch."""
    bars = smem[3]
    seq_lens_ptr, query_start_ptr = ptrs[4], ptrs[5]
    num_seqs, num_tokens, num_heads, num_items = sizes[0], sizes[1], sizes[2], sizes[3]
    seq_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    ring = 0  # key tiles copied so far: the ring's stage and phase
    served = 0  # items handed over so far: the query barriers' phase
    if DYNAMIC:
        item = gl.atomic_add(counter_ptr, 1)
        while item < num_items:
            kind, head, seq, q_start, q_len, ctx_len, m0 = _find_item(
                query_start_ptr, seq_lens_ptr, item, num_heads, num_seqs, num_tokens, BLOCK_M, 32, seq_layout
            )
            if kind != 0:
                mbarrier.wait(bars.index(Q_FREE), (served & 1) ^ 1)
                _post_item(smem[4], kind, head, q_start, q_len, ctx_len, m0)
                if kind == 1:
                    ring = _copy_item(descs, smem, ptrs, sizes, ring, head, seq, q_start, q_len, ctx_len, m0, GROUP,
                                      HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE, BOX_ROWS)  # fmt: skip
                else:  # padding rows: the warp groups write zeros
                    mbarrier.arrive(bars.index(Q_BAR), count=1)
                served += 1
            item = gl.atomic_add(counter_ptr, 1)
        mbarrier.wait(bars.index(Q_FREE), (served & 1) ^ 1)
        _post_item(smem[4], -1, 0, 0, 0, 0, 0)
        mbarrier.arrive(bars.index(Q_BAR), count=1)
        if gl.atomic_add(counter_ptr + 1, 1) == gl.num_programs(0) - 1:  # every program past its last item
            gl.atomic_xchg(counter_ptr, 0)
            gl.atomic_xchg(counter_ptr + 1, 0)
    else:
        for i in range(gl.program_id(0), num_items, gl.num_programs(0)):
            kind, head, seq, q_start, q_len, ctx_len, m0 = _find_item(
                query_start_ptr, seq_lens_ptr, _snake(i, SNAKE), num_heads, num_seqs, num_tokens, BLOCK_M, 32,
                seq_layout,
            )  # fmt: skip
            if kind == 1:
                # a fresh barrier counts as phase 1 complete: the first wait on each passes at once
                mbarrier.wait(bars.index(Q_FREE), (served & 1) ^ 1)
                ring = _copy_item(descs, smem, ptrs, sizes, ring, head, seq, q_start, q_len, ctx_len, m0, GROUP,
                                  HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE, BOX_ROWS)  # fmt: skip
                served += 1


@gluon.jit
def _zero_rows_past(tile, first, limit, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Zero the rows of shared-memory ``tile`` (positions ``first ..``) at ``limit`` or past it, 16 rows
    at a time (few registers: the key loop's are taken), then order the stores before the tensor
    cores' reads."""
    for r in gl.static_range(0, BLOCK_N, 16):
        rows = tile.slice(r, 16)
        offs = first + r + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
        values = rows.load(layout)
        rows.store(gl.where((offs < limit)[:, None], values, gl.zeros_like(values)))
    fence_async_shared()
    _barrier()


@gluon.jit
def _next_stage(bars, v_smem, stage, ring, j, cut, ctx_len, BLOCK_N: gl.constexpr, ROW_LAYOUT: gl.constexpr):
    """Key tile ``j``'s stage of the ring (and ``j - 1``'s, returned first); where tile ``j - 1`` is the prefix's
    partial last tile, its value rows past the prefix zeroed first, before S(j) is issued (its accumulators
    would leave the zeroing no registers)."""
    STAGES: gl.constexpr = v_smem.shape[0]
    V_BARS: gl.constexpr = K_BARS + STAGES
    prev = stage
    stage = (ring + j) % STAGES
    if j - 1 == cut:
        mbarrier.wait(bars.index(V_BARS + prev), ((ring + j - 1) // STAGES) & 1)
        _zero_rows_past(v_smem.index(prev), cut * BLOCK_N, ctx_len, BLOCK_N, ROW_LAYOUT)
    return prev, stage


@gluon.jit
def _attend_item(smem, ptrs, sizes, scale_log2, ring, served, kind, head, q_start, q_len, ctx_len, m0,
                 GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_SIZE: gl.constexpr, WG: gl.constexpr, CONSUMERS: gl.constexpr, WARPS: gl.constexpr,
                 WRITE_KV: gl.constexpr, ROW_LAYOUT: gl.constexpr):  # fmt: skip
    """Warp group ``WG``'s part of one work item (``_find_item``'s fields): the key loop of its rows of the
    query tile (prefix tiles, then own rows'), then its output rows and (the first query head of a KV
    group) its K/V rows in the cache; a padding item's rows get zeros. Returns the ring's and the query
    barrier's counts after it."""
    q_smem, k_smem, v_smem, bars = smem[0], smem[1], smem[2], smem[3]
    k_cache_ptr, v_cache_ptr, slot_ptr, out_ptr = ptrs[0], ptrs[1], ptrs[2], ptrs[6]
    stride_ot, stride_oh, stride_cb, stride_cs, stride_ch = sizes[4], sizes[5], sizes[6], sizes[7], sizes[8]
    STAGES: gl.constexpr = k_smem.shape[0]
    V_BARS: gl.constexpr = K_BARS + STAGES
    FREE: gl.constexpr = K_BARS + 2 * STAGES
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS  # this warp group's rows of a query tile, from ROWS * WG on
    OUT_BAR: gl.constexpr = K_BARS + 3 * STAGES
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

    r0 = m0 + WG * ROWS  # the sequence's row of this warp group's first row
    if kind == 2:
        zeros = gl.zeros([ROWS, HEAD_DIM], dtype, ROW_LAYOUT)
        _store_rows(zeros, out_ptr, q_start, r0, q_len, head, stride_ot, stride_oh, HEAD_DIM, ROWS, ROW_LAYOUT)
    if kind == 1:
        num_pre = (ctx_len + BLOCK_N - 1) // BLOCK_N
        num_kv = num_pre + (gl.minimum(m0 + BLOCK_M, q_len) + BLOCK_N - 1) // BLOCK_N
        # the prefix's last tile, where it is partial: its value rows past the prefix are zeroed before its
        # PV product (the copies brought whatever the cache holds there, and 0 * NaN is NaN)
        cut = gl.where(ctx_len % BLOCK_N != 0, num_pre - 1, -1)
        offs_m = r0 + gl.arange(0, ROWS, layout=row_s)
        m_i = gl.full([ROWS], -1.0e30, gl.float32, layout=row_s)  # finite: no NaN before the first key
        l_i = gl.zeros([ROWS], gl.float32, layout=row_s)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)

        # one warp group: the queries as the score product's register operand (half its shared-memory
        # reads), their buffer then free for the next item's; two: read from shared memory (the registers
        # go to the 64 x 128 score tile), the buffer free once the item's last score product is done
        mbarrier.wait(bars.index(Q_BAR), served & 1)
        if CONSUMERS == 1:
            q_op = q_smem.load(q_layout)
            _barrier()  # every warp's reads done before the one thread's arrive
            mbarrier.arrive(bars.index(Q_FREE), count=1)
        else:
            q_op = q_smem.slice(WG * ROWS, ROWS)

        stage = ring % STAGES
        mbarrier.wait(bars.index(K_BARS + stage), (ring // STAGES) & 1)
        s = warpgroup_mma(q_op, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, offs_m, 0, num_pre, ctx_len, r0, scale_log2, BLOCK_N, col_s)
        if CONSUMERS > 1:  # the weights cross iterations as the 16-bit PV operand: half fp32's registers
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, num_kv):
            prev, stage = _next_stage(bars, v_smem, stage, ring, j, cut, ctx_len, BLOCK_N, ROW_LAYOUT)
            mbarrier.wait(bars.index(K_BARS + stage), ((ring + j) // STAGES) & 1)
            s = warpgroup_mma(q_op, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(bars.index(V_BARS + prev), ((ring + j - 1) // STAGES) & 1)
            if CONSUMERS == 1:
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc_next = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s,))  # S(j) done; PV(j-1) still runs during the softmax
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, offs_m, j, num_pre, ctx_len, r0, scale_log2, BLOCK_N,
                                          col_s)  # fmt: skip
            # P(j-1) sits in registers the PV product reads until it completes: kept alive to here
            acc, p_op = warpgroup_mma_wait(0, deps=(acc_next, p_op))
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            mbarrier.arrive(bars.index(FREE + prev), count=1)  # tile j-1 consumed: its stage to the copy warp
            if CONSUMERS > 1:
                p_op = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.wait(bars.index(V_BARS + stage), ((ring + num_kv - 1) // STAGES) & 1)
        if CONSUMERS == 1:
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))

        if CONSUMERS > 1:  # the other warp group's score product may still read the rows staged below
            mbarrier.arrive(bars.index(Q_FREE), count=1)
            mbarrier.arrive(bars.index(OUT_BAR), count=1)
            mbarrier.wait(bars.index(OUT_BAR), served & 1)

        # the last key tile is the query tile's own rows (block_m == block_n), still in its stage: the
        # KV write reads this warp group's rows there, then its output rows go through them to 16-byte stores
        k_rows = k_smem.index(stage).slice(WG * ROWS, ROWS)
        if WRITE_KV:  # noqa: SIM102 (constexpr, then runtime)
            if head % GROUP == 0:
                kv_head = head // GROUP
                _store_kv(k_rows.load(ROW_LAYOUT), k_cache_ptr, slot_ptr, q_start, r0, q_len, kv_head, stride_cb,
                          stride_cs, stride_ch, HEAD_DIM, ROWS, BLOCK_SIZE, ROW_LAYOUT)  # fmt: skip
                _store_kv(v_smem.index(stage).slice(WG * ROWS, ROWS).load(ROW_LAYOUT), v_cache_ptr, slot_ptr,
                          q_start, r0, q_len, kv_head, stride_cb, stride_cs, stride_ch, HEAD_DIM, ROWS, BLOCK_SIZE,
                          ROW_LAYOUT)  # fmt: skip
        k_rows.store((acc / gl.convert_layout(l_i, row_o)[:, None]).to(dtype))
        _store_rows(k_rows.load(ROW_LAYOUT), out_ptr, q_start, r0, q_len, head, stride_ot, stride_oh, HEAD_DIM,
                    ROWS, ROW_LAYOUT)  # fmt: skip
        # the stage's last generic reads and writes ordered before the copy warp's next TMA copy into it
        fence_async_shared()
        _barrier()
        mbarrier.arrive(bars.index(FREE + stage), count=1)
        ring += num_kv
        served += 1
    return ring, served


@gluon.jit
def _attend(descs, smem, ptrs, sizes, scale_log2, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, BOX_ROWS: gl.constexpr, WG: gl.constexpr,
            CONSUMERS: gl.constexpr, WARPS: gl.constexpr, WRITE_KV: gl.constexpr, ROW_LAYOUT: gl.constexpr,
            SNAKE: gl.constexpr, DYNAMIC: gl.constexpr):  # fmt: skip
    """Consumer warp group ``WG`` of ``CONSUMERS``: its part of each work item (``_attend_item``), the
    items found from the program's loop index or, ``DYNAMIC``, handed over by the copy warp."""
    bars = smem[3]
    seq_lens_ptr, query_start_ptr = ptrs[4], ptrs[5]
    num_seqs, num_tokens, num_heads, num_items = sizes[0], sizes[1], sizes[2], sizes[3]
    STAGES: gl.constexpr = smem[1].shape[0]
    OUT_BAR: gl.constexpr = K_BARS + 3 * STAGES
    seq_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])

    ring = 0  # key tiles consumed so far: the ring's stage and phase
    served = 0  # items attended so far: the query barrier's phase
    if DYNAMIC:  # the copy warp hands each item over in shared memory, then a negative kind: no more
        mbarrier.wait(bars.index(Q_BAR), 0)
        kind, head, q_start, q_len, ctx_len, m0 = _read_item(smem[4], WARPS)
        while kind >= 0:
            ring, served = _attend_item(smem, ptrs, sizes, scale_log2, ring, served, kind, head, q_start, q_len,
                                        ctx_len, m0, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE, WG, CONSUMERS,
                                        WARPS, WRITE_KV, ROW_LAYOUT)  # fmt: skip
            if kind == 2:  # padding rows: the query barrier's turn came without a copy
                if CONSUMERS > 1:  # and the output barrier's turn, whose phase follows the items handed over
                    mbarrier.arrive(bars.index(OUT_BAR), count=1)
                    mbarrier.wait(bars.index(OUT_BAR), served & 1)
                _barrier()
                mbarrier.arrive(bars.index(Q_FREE), count=1)
                served += 1
            mbarrier.wait(bars.index(Q_BAR), served & 1)
            kind, head, q_start, q_len, ctx_len, m0 = _read_item(smem[4], WARPS)
    else:
        for i in range(gl.program_id(0), num_items, gl.num_programs(0)):
            kind, head, seq, q_start, q_len, ctx_len, m0 = _find_item(
                query_start_ptr,
                seq_lens_ptr,
                _snake(i, SNAKE),
                num_heads,
                num_seqs,
                num_tokens,
                BLOCK_M,
                32 * WARPS,
                seq_layout,
            )
            ring, served = _attend_item(smem, ptrs, sizes, scale_log2, ring, served, kind, head, q_start, q_len,
                                        ctx_len, m0, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE, WG, CONSUMERS,
                                        WARPS, WRITE_KV, ROW_LAYOUT)  # fmt: skip
    # every copy the copy warp issued has been waited for; with two warp groups the other may still arrive on a
    # stage's barrier after this one's last item, so the barriers stay as they are (the kernel ends with them)
    if CONSUMERS == 1:
        for i in gl.static_range(K_BARS + 3 * STAGES + CONSUMERS - 1):
            mbarrier.invalidate(bars.index(i))


def _row_layout(head_dim: int, warps: int):
    """A blocked layout for ``[BLOCK_M, head_dim]`` row copies: 16-byte vectors along the head dim."""
    lanes = min(32, head_dim // 8)
    return gl.BlockedLayout([1, 8], [32 // lanes, lanes], [warps, 1], [1, 0])


def supports(kv_cache: torch.Tensor) -> bool:
    """Whether the kernel can read the prefix of ``kv_cache`` ``[2, blocks, block_size, Hkv, D]``: each
    half contiguous (one TMA descriptor over ``[blocks * block_size, Hkv * D]``) and blocks of at least
    8 slots, a power of two (a box of a block's rows starts on the shared-memory swizzle's 8-row period)."""
    block_size = kv_cache.shape[2]
    return (
        kv_cache[0].is_contiguous()
        and kv_cache[1].is_contiguous()
        and block_size >= 8
        and not (block_size & (block_size - 1))
    )


def launch_tile(overrides: dict | None, num_tokens: int, num_seqs: int, head_dim: int) -> dict:
    """The tile of a launch: ``GLUON_TILE``, with ``LONG_PROMPT_TILE`` over it for long prompts (unless
    ``overrides`` names a tile size), then ``overrides``."""
    overrides = overrides or {}
    tile = dict(GLUON_TILE)
    long_prompts = head_dim == 128 and num_tokens >= LONG_PROMPT_TOKENS * max(num_seqs, 1)
    if long_prompts and "block_m" not in overrides and "block_n" not in overrides:
        tile |= LONG_PROMPT_TILE
    return tile | overrides


def gluon_prefill_launch(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, out, scale: float,
                         slot_mapping=None, tile=None):  # fmt: skip
    """``(kernel, grid, args, kwargs)`` of the Gluon launch for ``q [T, H, D]``, ``k``/``v [T, Hkv, D]``
    (TMA-ready: unit stride over the head dim, heads packed), the paged ``kv_cache`` ``[2, blocks,
    block_size, Hkv, D]`` (``supports``) and ``out [T, H, D]``; also what offline compiles bind."""
    num_tokens, num_heads, head_dim = q.shape
    tile = launch_tile(tile, num_tokens, seq_lens.shape[0], head_dim)
    num_kv_heads = k.shape[1]
    block_m, block_n, warps = tile["block_m"], tile["block_n"], tile["warps"]
    if block_m != block_n:
        raise ValueError(f"Gluon prefill tiles: block_m must equal block_n, got {tile}")
    if block_m not in (64, 128) or warps != 4:
        raise ValueError(
            f"Gluon prefill tiles: block_m 64 or 128 (one or two warp groups of 64 rows), 4 warps, got {tile}"
        )
    if not supports(kv_cache):
        raise ValueError(f"Gluon prefill needs contiguous cache halves and blocks of 8+ slots, got {kv_cache.shape}")
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    layout = gl.NVMMASharedLayout.get_default_for([block_m, head_dim], dtype)
    q_desc = TensorDescriptor(q, [num_tokens, num_heads * head_dim], [q.stride(0), 1], [block_m, head_dim], layout)
    width = num_kv_heads * head_dim
    k_desc = TensorDescriptor(k, [num_tokens, width], [k.stride(0), 1], [block_n, head_dim], layout)
    v_desc = TensorDescriptor(v, [num_tokens, width], [v.stride(0), 1], [block_n, head_dim], layout)
    block_size = kv_cache.shape[2]
    box_rows = min(block_size, block_n)
    cache_rows = kv_cache.shape[1] * block_size
    k_cache_desc, v_cache_desc = (
        TensorDescriptor(half.view(cache_rows, width), [cache_rows, width], [width, 1], [box_rows, head_dim], layout)
        for half in (kv_cache[0], kv_cache[1])
    )
    k_cache = kv_cache[0]
    num_seqs = seq_lens.shape[0]
    num_items = num_heads * (num_tokens // block_m + num_seqs + 1)
    programs = num_items
    if tile["persistent"]:
        programs = min(num_items, tile["persistent"] * sm_count(q.device))
    dynamic = bool(tile["dynamic"]) and programs < num_items
    counters = _counters(q.device) if dynamic else None
    if dynamic and counters is None:  # first launch inside a capture: one program per item instead
        dynamic, programs = False, num_items
    snake = bool(tile["snake"]) and programs < num_items and not dynamic
    # the loop's bound: with snake order, whole rounds (a program's reversed item can lie past its own loop's
    # last index; indices past the items find nothing to do)
    loop_items = -(-num_items // programs) * programs if snake else num_items
    args = (
        q_desc, k_desc, v_desc, k_cache_desc, v_cache_desc, k_cache, kv_cache[1],
        slot_mapping if slot_mapping is not None else query_start_loc,  # unused without the write
        block_tables, seq_lens, query_start_loc, out, float(scale) * LOG2E, num_seqs, num_tokens, num_heads,
        loop_items, out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
    )  # fmt: skip
    kwargs = dict(
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        BOX_ROWS=box_rows,
        STAGES=tile["stages"],
        CONSUMERS=block_m // 64,
        WARPS=warps,
        WRITE_KV=slot_mapping is not None,
        ROW_LAYOUT=_row_layout(head_dim, warps),
        num_warps=warps,
        # one warp group and the copy warp take two warp groups of registers: 128 a thread at launch keeps two
        # programs per SM; setmaxnreg then moves them to the warp group (232) from the copy warp's (24); two warp
        # groups and the copy warp take three at 168, then 240 each and 24
        maxnreg=128 if block_m == 64 else 168,
    )
    if snake:
        kwargs["SNAKE"] = True
    if dynamic:
        kwargs["DYNAMIC"] = True
        kwargs["counter_ptr"] = counters
    return _gluon_prefill_kernel, (programs,), args, kwargs


def launch_gluon_prefill(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, out, scale: float,
                         slot_mapping=None, tile=None) -> None:  # fmt: skip
    """Write every ``out`` row of the prefill batch (and with ``slot_mapping`` the cache's K/V rows of
    the step's tokens)."""
    kernel, grid, args, kwargs = gluon_prefill_launch(
        q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, out, scale, slot_mapping, tile
    )
    kernel[grid](*args, **kwargs)
