"""Launch configuration of the paged-attention kernels, from shapes only: which kernel serves a
batch (``uses_decode_kernel``), how many context splits (``choose_decode_splits``,
``choose_num_splits``), the tiles, warps and stages per platform and dtype (``_tile_config``,
``_decode_tile_config``), and the ``config`` / ``RLT_ATTENTION_CONFIG`` overrides of tuning sweeps
(``CONFIG_KEYS``). Never a tensor value, so every choice holds inside CUDA/HIP graph capture; the
measurements behind each default are in docs/benchmarks.md."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
import triton

from rlt_compile import envs

_MAX_SPLITS = 64

# 16-bit decode on the GPU takes 16-key tiles where no context can be longer than this many positions
# and the unsplit grid (tokens x KV heads) is below one wave of the SMs. H200, batch 1 (session 20):
# Ouro-1.4B at context 128 (208-position table) 3.480 vs 3.578-3.582 ms/token with 64-key tiles,
# Nanbeige 3.654 vs 3.673; the decode call alone at 128 10.0 vs 11.0 us, but at 1k 14.2 vs 13.7 and
# at 8k 35.6 vs 28.3, and Ouro-1.4B at context 4096 5.000 vs 4.642 ms/token.
SHORT_DECODE_CONTEXT = 256

_decode_context_limit: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "rlt_decode_context_limit", default=None
)


@contextlib.contextmanager
def decode_context_limit(positions: int | None) -> Iterator[None]:
    """Launches inside promise that no sequence is longer than ``positions`` (None: no promise), so
    the decode kernel may pick the tiles of that context rather than the block table's width.

    ``graphs.CudaGraphRunner`` captures a short-context graph per small batch bucket under this and
    replays it only for batches whose block tables fit. A broken promise costs speed, never
    correctness: the kernel deals each sequence's real length to its splits at run time."""
    token = _decode_context_limit.set(None if positions is None else int(positions))
    try:
        yield
    finally:
        _decode_context_limit.reset(token)


def current_decode_context_limit() -> int | None:
    return _decode_context_limit.get()


def decode_table_blocks(table_width: int, block_size: int) -> int:
    """The block-table width the decode config plans for: the table's, or fewer under
    ``decode_context_limit``."""
    limit = _decode_context_limit.get()
    if limit is None:
        return table_width
    return max(1, min(table_width, triton.cdiv(limit, block_size)))


def choose_num_splits(
    num_tokens: int,
    num_seqs: int,
    num_kv_heads: int,
    max_blocks_per_seq: int,
    block_size: int,
    block_n: int,
    num_sms: int,
) -> int:
    """Shape-only split-K heuristic: split the context only for all-decode batches too small to fill
    the GPU (``num_seqs * num_kv_heads`` programs below about two waves) with long enough contexts.

    Returns a power of two (1 = no split)."""
    if num_tokens != num_seqs or num_seqs == 0:
        return 1
    programs = num_seqs * num_kv_heads
    target = 2 * num_sms
    if programs >= target:
        return 1
    max_tiles = max(1, (max_blocks_per_seq * block_size) // block_n)
    splits = triton.next_power_of_2(triton.cdiv(target, programs))
    # Leave at least 4 key tiles per split at the longest context the block table can describe.
    while splits > 1 and max_tiles < 4 * splits:
        splits //= 2
    return max(1, min(splits, _MAX_SPLITS))


def _tile_config(
    interpret: bool,
    decode_like: bool,
    group: int,
    block_d: int,
    dtype: torch.dtype,
    compact: bool = False,
    config: dict | None = None,
    nvidia: bool = False,
) -> dict:
    """Unified-kernel tiles and options: defaults from shapes, dtypes and the platform kind only,
    then the ``config`` overrides (``block_m``, ``block_n``, ``warps``, ``stages``, ``mask_split``,
    ``pad_group``, ``reverse_tiles``).

    GQA rows pack (query token, head in group) pairs with ``GROUP_P = group`` rows per token
    (``pad_group``: the next power of two, the old layout), so ``BLOCK_Q = BLOCK_M // GROUP_P``
    tokens per tile and ``BLOCK_M % GROUP_P`` rows of padding. ``nvidia``: MHA prefill takes a
    128 x 128 key tile, decode-shaped batches a single stage (both the best of H200 sweeps)."""
    config = config or {}
    # Checked offline with ptxas -v (sm_90, no spills for head_dim <= 128) and for gfx942 (<= 64 KiB LDS).
    if interpret:  # small tiles keep the interpreter fast and exercise the tile loops in tests
        block_m, block_n, warps, stages = (16 if decode_like else 32), 16, 4, 1
    elif dtype == torch.float32:  # fp32 dots (ieee: FMA) need many registers: small tiles, 8 warps
        block_m, block_n, warps, stages = 16, (32 if block_d <= 128 else 16), 8, 2
    elif decode_like:  # H200 (MHA batch 32/128 at 128-8k): 1 stage 1.07-1.35x faster than 3
        block_m, block_n, warps, stages = 16, (64 if block_d <= 128 else 32), 4, (1 if nvidia else 3)
    elif compact:  # Platform.compact_attention_tiles: the 128x64 tile spills VGPRs on gfx90a/gfx942
        block_m, block_n, warps, stages = 64, (64 if block_d <= 128 else 32), 4, 2
    elif nvidia and block_d <= 128 and group == 1:  # MHA on NVIDIA: best of the H200 prefill sweep
        # (docs/benchmarks.md); its ~220 KiB of shared memory does not fit AMD's LDS (160 KiB on gfx950)
        block_m, block_n, warps, stages = 128, 128, 8, 3
    else:
        big = block_d <= 128
        block_m, block_n, warps, stages = (128 if big else 64), (64 if big else 32), (8 if big else 4), 2
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "warps": warps, "stages": stages}
    # Heaviest causal tile first: +6-10% at 1 x 8k on the H200, neutral at 8 x 1k.
    cfg |= {"MASK_SPLIT": True, "PAD_GROUP": False, "REVERSE_TILES": True}
    for key, name in (
        ("block_m", "BLOCK_M"),
        ("block_n", "BLOCK_N"),
        ("warps", "warps"),
        ("stages", "stages"),
        ("mask_split", "MASK_SPLIT"),
        ("pad_group", "PAD_GROUP"),
        ("reverse_tiles", "REVERSE_TILES"),
    ):
        if config.get(key) is not None:
            cfg[name] = config[key]
    for name in ("MASK_SPLIT", "PAD_GROUP", "REVERSE_TILES"):
        cfg[name] = bool(cfg[name])
    group_p = triton.next_power_of_2(group)
    cfg["BLOCK_M"] = max(cfg["BLOCK_M"], group_p, 16)  # at least one query token per tile
    cfg["GROUP_P"] = group_p if cfg.pop("PAD_GROUP") else group
    cfg["BLOCK_Q"] = cfg["BLOCK_M"] // cfg["GROUP_P"]
    return cfg


def choose_decode_splits(
    num_tokens: int,
    num_kv_heads: int,
    max_blocks_per_seq: int,
    block_size: int,
    block_n: int,
    num_sms: int,
    waves: int = 2,
    cap_to_table: bool = True,
) -> int:
    """Split-K count of the decode kernel (shapes only): enough (token, KV head, split) programs for
    about ``waves`` waves of the SMs, but (``cap_to_table``) no more splits than runs of ``block_n``
    positions (the key tile, or ``split_grain``) at the longest context the block table can describe
    (``max_blocks_per_seq * block_size``). Without the cap, a short table leaves splits empty: they
    cost nothing where the merge is fused in the kernel (they exit at once and are not read), and
    on the H200 the uncapped count was faster end to end at the bench's 208-position table (session
    16, batch-1 decode: Ouro-1.4B 3.856 vs 3.928-3.934 ms/token at 32 splits against 4, Ouro-2.6B
    7.596 vs 7.715; 8 splits 3.877, 16 3.917, 64 3.893; not for Nanbeige's reduce kernel: 64 splits
    4.047 vs 3.865).

    Returns a power of two (1 = no split, no reduce launch)."""
    if num_tokens == 0:
        return 1
    programs = num_tokens * num_kv_heads
    target = waves * num_sms
    if programs >= target:
        return 1
    splits = triton.next_power_of_2(triton.cdiv(target, programs))
    max_tiles = max(1, triton.cdiv(max_blocks_per_seq * block_size, block_n)) if cap_to_table else splits
    while splits > 1 and splits > max_tiles:
        splits //= 2
    return max(1, min(splits, _MAX_SPLITS))


def _decode_tile_config(
    interpret: bool,
    group_p: int,
    block_d: int,
    dtype: torch.dtype,
    config: dict,
    programs: int,
    num_sms: int,
    max_context: int | None = None,
) -> dict:
    """Decode-kernel tiles: defaults from shapes, dtypes and the platform kind only, then ``config``.

    ``max_context``: the longest context the block table can describe (``decode_table_blocks`` x
    block size); 16-bit tiles are 16 keys wide where it is at most ``SHORT_DECODE_CONTEXT`` and
    ``programs`` (tokens x KV heads) is below one wave of the SMs, else 64 (32 for head dims above 128).

    MHA (one query row per KV head) in 16 bits takes a 16-row ``tl.dot`` tile (15 rows of padding)
    where the context is split and otherwise a broadcast multiply + sum over the head dim
    (``_mha_dot``; session 6 measured the tile slower end to end, before the early PDL trigger), in
    fp32 always the multiply + sum. GQA puts the group's query heads in the rows of a ``tl.dot``
    tile (at least 16 rows).
    Split-K is merged in the kernel (``fuse_reduce``) for MHA, and for GQA where the unsplit grid
    (``programs``: tokens x KV heads) fills at least an eighth of the ``num_sms`` SMs, so the split
    count is at most 16. There the last split merges the group's heads at once, faster than the
    reduce kernel on the H200 (Nanbeige at 1k, KV write + attention, us: batch 4 19.6 vs 20.9, batch 8
    21.5 vs 25.5, batch 16 28.1 vs 33.8, batch 32 43.2 vs 44.8; batch 16 at 8k 133.4 vs 139.1; session
    17). Smaller GQA grids keep the reduce kernel: at their 32-64 splits the fused merge was far slower
    (batch 1 at 128: 18.3 vs 10.9 us, at 1k 19.5 vs 13.2, session 17; at 8k 0.79x, session 11) and no
    faster end to end (Nanbeige batch-1 decode 4.028 vs 4.005 ms/token, session 11). ``l2_prefetch``: how many
    of a split's cached K/V tiles it pulls into L2 (a PTX prefetch hint, CUDA only) before its PDL
    wait, while the q/k/v GEMV still runs; 1 tile made batch-1 decode 1.01x faster end to end on the
    H200 (Ouro-1.4B 3.94 vs 3.98 ms/token in two calls, Nanbeige 3.900 vs 3.914-3.919; session 14),
    more tiles with fewer splits were slower. ``prefetch``: the next key tile's block-table entries
    are read while this tile's K/V are in flight (reading them two tiles ahead was no faster on the
    H200, session 16: Nanbeige batch 32 at 1k 52.2 vs 52.2 us, batch 1 14.5 vs 13.8; nor was a PDL
    trigger after the wait: Ouro-1.4B 3.945 vs 3.927 ms/token). ``early_exit`` (a probe, off): with
    the merge fused and the metadata read early, splits without keys (all but split 0) return before
    the PDL wait instead of after it. ``split_grain`` (default ``block_n``; H200, session 20,
    Ouro-1.4B at 128: 16 3.639, 32 3.598 ms/token against 3.578-3.582 with 64-key tiles and 3.480
    with 16-key tiles; H100, session 27, Nanbeige batch 16 / 32 at 1k and 32 at 8k: 16 within 1% of the
    default): the context is dealt to the splits in runs of this many positions, so with a smaller grain than the
    tile a short context spreads over more splits (at 128 positions and 64-key tiles: 8 splits of 16
    keys instead of 2 of 64, as 16-key tiles do) while long contexts keep the wide tile. ``early_q``
    (session 18, from the SASS; H200, session 19: Ouro-1.4B 3.764 vs 3.807 ms/token with 0): q and the fused write's K/V rows load together right
    after the PDL wait, then the row is stored (0: split 0 loaded k, stored it, loaded v, stored it,
    then q: three round trips instead of two on the critical path, split 0 always having keys). Checked with
    ptxas -v (sm_90): no spills for head_dim <= 128; fp32 dots (ieee: FMA) need 8 warps (4 spill)."""
    mha = group_p == 1
    cfg = {
        "use_dot": None if mha and dtype != torch.float32 and not interpret else not mha,  # None: _mha_dot
        "waves": 2,
        "prefetch": True,
        "fuse_reduce": mha or 8 * programs >= num_sms,
        "early_reads": True,
        "early_exit": False,
        "l2_prefetch": 1,
        "split_grain": None,  # None: block_n
        "early_q": True,
    }
    if interpret:
        cfg.update(block_n=16, warps=4, stages=1)
    elif dtype == torch.float32:
        cfg.update(block_n=32 if block_d <= 128 else 16, warps=None, stages=2)
    else:
        short = max_context is not None and max_context <= SHORT_DECODE_CONTEXT and programs < num_sms
        cfg.update(block_n=16 if short else 64 if block_d <= 128 else 32, warps=4, stages=2)
    cfg.update({key: config[key] for key in cfg if config.get(key) is not None})
    if cfg["warps"] is None:
        cfg["warps"] = 8 if cfg["use_dot"] else 4
    return cfg


def _mha_dot(num_splits: int) -> bool:
    """16-bit MHA decode: the 16-row ``tl.dot`` tile where the context is split (small batches), the
    multiply + sum otherwise. H200, session 14 (KV write + attention, us): batch 1 at 128 / 1k / 8k
    10.6 / 14.0 / 32.8 with the tile against 11.9 / 15.0 / 39.6; batch 32 (no split) even, batch
    128 at 8k 2048 against 2004; Ouro-1.4B batch-1 decode 3.928 against 3.936 ms/token."""
    return num_splits > 1


# Keys of the ``config`` override of the launchers (for tuning sweeps; every value is a shape-like
# constant, so overridden launches stay CUDA-graph safe).
CONFIG_KEYS = frozenset(
    {
        "decode",
        "prefill_tma",
        "fuse_write",
        "splits",
        "block_n",
        "block_m",
        "warps",
        "stages",
        "use_dot",
        "waves",
        "prefetch",
        "fuse_reduce",
        "early_reads",
        "early_exit",
        "l2_prefetch",
        "reduce_warps",
        "mask_split",
        "pad_group",
        "reverse_tiles",
        "fold_scale",
        "rescale_slack",
        "heads_first",
        "gluon_prefill",
        "gluon_persistent",
        "gluon_snake",
        "gluon_dynamic",
        "gluon_block",
        "gluon_stages",
        "split_grain",
        "early_q",
    }
)


def _check_config(config: dict | None) -> dict:
    """``config`` over the ``RLT_ATTENTION_CONFIG`` defaults, validated."""
    config = {**envs.rlt_attention_config(), **(config or {})}
    unknown = set(config) - CONFIG_KEYS
    if unknown:
        raise ValueError(
            f"unknown attention config keys {sorted(unknown)} (config or RLT_ATTENTION_CONFIG); "
            f"valid: {sorted(CONFIG_KEYS)}"
        )
    for key in ("block_n", "block_m", "split_grain"):
        value = config.get(key)
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"{key} must be a power of two >= 16, got {value}")
    return config


def _split_count(split_k, config: dict, auto: Callable[[], int]) -> int:
    if config.get("splits") is not None:
        return triton.next_power_of_2(max(1, int(config["splits"])))
    if split_k is None:
        num_splits = auto()
    elif split_k is True:
        num_splits = max(2, auto())
    else:
        num_splits = max(1, int(split_k))
    return min(triton.next_power_of_2(num_splits), _MAX_SPLITS)


def fits_two_waves(num_seqs: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether a decode batch's (sequence, KV head) programs fit in two waves of the SMs: the
    measured boundary for MHA's kernel choice (``uses_decode_kernel``) and the fused KV write
    (``attention_forward``)."""
    return num_seqs * num_kv_heads <= 2 * num_sms


def uses_decode_kernel(
    num_tokens: int,
    num_seqs: int,
    config: dict | None = None,
    group: int | None = None,
    num_kv_heads: int | None = None,
    num_sms: int | None = None,
) -> bool:
    """Whether a batch of this shape runs the decode kernel: all-decode shapes (``num_tokens ==
    num_seqs``) unless ``config["decode"]`` says otherwise (a shape-only decision).

    Given ``group``, ``num_kv_heads`` and ``num_sms``, MHA batches (group 1) with more than two
    waves of (sequence, KV head) programs take the unified kernel: measured on the H200, its tensor-
    core tile beats the decode kernel's multiply-and-sum there (Ouro 16 heads, batch 32 at 1k: 81 vs
    90 us; batch 128 at 8k: 1993 vs 2454 us), while GQA and small MHA batches gain from the decode
    kernel (docs/benchmarks.md)."""
    decode = (config or {}).get("decode")
    if decode is not None:
        return bool(decode) and num_tokens == num_seqs
    if num_tokens != num_seqs:
        return False
    if group == 1 and num_kv_heads is not None and num_sms is not None:
        return fits_two_waves(num_seqs, num_kv_heads, num_sms)
    return True
