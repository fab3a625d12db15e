"""Triton paged-attention kernels against the torch reference.

CPU: the kernels run in Triton's interpreter (fp32/fp16 only; bf16 is wrong there). The launchers
pick the interpreter for CPU tensors by themselves, so this works whether or not triton was imported
before ``TRITON_INTERPRET=1`` was set; an autouse fixture sets it per test (CPU only) rather than for
the whole process, so other test modules keep the plain CPU backend order.
GPU (``-m gpu``): the same parity in bf16/fp32 with model-sized shapes, plus CUDA-graph capture
with metadata changed between replays.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from rlt_compile.kernels import backends, decode_attention, triton_attention
from rlt_compile.kernels.attention_config import (
    SHORT_DECODE_CONTEXT,
    _decode_tile_config,
    decode_context_limit,
    decode_table_blocks,
)
from rlt_compile.kernels.metadata import build_metadata
from rlt_compile.kernels.reference import (
    attention_reference,
    kv_write_reference,
    paged_attention_reference,
)
from rlt_compile.kernels.triton_attention import (
    CONFIG_KEYS,
    attention_forward,
    choose_decode_splits,
    choose_num_splits,
    kv_write_triton,
    paged_attention_triton,
    uses_decode_kernel,
)

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA/ROCm GPU (run with -m gpu on the device)")


@pytest.fixture(autouse=True)
def _triton_interpret(monkeypatch):
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def make_case(
    query_lens,
    context_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    *,
    pad_tokens=0,
    pad_seqs=0,
    extra_blocks=0,
    device="cpu",
    seed=0,
):
    """Random q/k/v and a random cache whose blocks are scattered over a shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    needed = [(q + c + block_size - 1) // block_size for q, c in zip(query_lens, context_lens)]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in needed:
        tables.append(perm[i : i + n])
        i += n
    md = build_metadata(
        query_lens,
        context_lens,
        tables,
        block_size,
        device=device,
        pad_tokens_to=sum(query_lens) + pad_tokens,
        pad_seqs_to=len(query_lens) + pad_seqs,
        pad_blocks_to=max(needed + [1]) + extra_blocks,
    )
    t = md.slot_mapping.shape[0]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q = rnd(t, num_heads, head_dim)
    k = rnd(t, num_kv_heads, head_dim)
    v = rnd(t, num_kv_heads, head_dim)
    cache = rnd(2, num_blocks, block_size, num_kv_heads, head_dim)
    return q, k, v, cache, md


def check_attention(case, split_k, precision="ieee", tol=None, config=None, fused=False):
    """Reference vs Triton: KV write then attention. ``fused``: through ``attention_forward`` (the
    op's path: on decode shapes the write happens inside the decode kernel), else the separate write
    kernel + ``paged_attention_triton``. The cache is compared after the write either way."""
    q, k, v, cache, md = case
    scale = q.shape[-1] ** -0.5
    ref_cache = cache.clone()
    kv_write_reference(k, v, ref_cache, md.slot_mapping)
    ref = paged_attention_reference(q, ref_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale)
    meta = (md.block_tables, md.seq_lens, md.query_start_loc, scale)
    if fused:
        out = attention_forward(
            q, k, v, cache, md.slot_mapping, *meta, precision=precision, split_k=split_k, config=config
        )
    else:
        kv_write_triton(k, v, cache, md.slot_mapping)
        out = paged_attention_triton(q, cache, *meta, precision=precision, split_k=split_k, config=config)
    assert torch.equal(cache, ref_cache)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), ref.float(), **(tol or TOL[q.dtype]))
    n_real = int(md.query_start_loc[-1])
    assert torch.count_nonzero(out[n_real:]) == 0  # padding token rows
    return out


# (query_lens, context_lens): context lengths cross block (16/32) and key-tile (16) boundaries.
MIXES = {
    "decode": ([1, 1, 1, 1], [0, 15, 16, 47]),
    "prefill": ([5, 17, 33], [0, 0, 0]),
    "mixed": ([1, 9, 1, 20], [31, 0, 64, 7]),
    "chunked": ([16, 7], [32, 17]),
}
HEADS = {"gqa8/2": (8, 2), "mha4": (4, 4)}


# ------------------------------------------------------------------------------------------ CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kv_write(dtype, block_size):
    q, k, v, cache, md = make_case([3, 1, 9], [4, 20, 0], 4, 2, 16, block_size, dtype, pad_tokens=2, pad_seqs=1)
    ref = cache.clone()
    kv_write_reference(k, v, ref, md.slot_mapping)
    kv_write_triton(k, v, cache, md.slot_mapping)
    assert torch.equal(cache, ref)


def test_kv_write_casts_and_strided_input():
    _, k, v, cache, md = make_case([4, 2], [3, 30], 4, 2, 16, 16, torch.float32)
    kv = torch.randn(k.shape[0], 2, 2, 16)  # k and v interleaved: non-contiguous views
    k, v = kv[:, 0], kv[:, 1]
    cache16 = cache.half()
    ref = cache16.clone()
    kv_write_reference(k, v, ref, md.slot_mapping)
    kv_write_triton(k, v, cache16, md.slot_mapping)
    assert torch.equal(cache16, ref)


@pytest.mark.parametrize("split_k", [False, 4], ids=["nosplit", "split4"])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("mix", list(MIXES))
def test_attention_fp32(mix, heads, split_k):
    query_lens, context_lens = MIXES[mix]
    block_size = 16 if heads == "gqa8/2" else 32
    pad = 2 if mix == "decode" else 3  # decode: equal padding keeps the batch all-decode (num_tokens == num_seqs)
    case = make_case(query_lens, context_lens, *HEADS[heads], 32, block_size, torch.float32, pad_tokens=pad, pad_seqs=2)
    check_attention(case, split_k)


@pytest.mark.parametrize("split_k", [False, 2], ids=["nosplit", "split2"])
@pytest.mark.parametrize("mix", ["decode", "mixed", "chunked"])
def test_attention_fp16(mix, split_k):
    query_lens, context_lens = MIXES[mix]
    case = make_case(query_lens, context_lens, 6, 2, 32, 32, torch.float16, pad_tokens=1, pad_seqs=1, seed=1)
    check_attention(case, split_k)


@pytest.mark.parametrize("head_dim", [24, 96])
def test_attention_non_power_of_two_head_dim(head_dim):
    case = make_case([1, 6], [20, 11], 4, 2, head_dim, 16, torch.float32, pad_tokens=1, seed=2)
    check_attention(case, False)
    check_attention(case, 2)


def test_attention_decode_auto_split_matches():
    # All-decode, few programs and a wide block table: the heuristic picks split-K by itself.
    case = make_case([1, 1], [70, 3], 4, 2, 16, 16, torch.float32, extra_blocks=60, seed=3)
    _, _, _, cache, md = case
    n_tokens = case[0].shape[0]
    splits = choose_num_splits(n_tokens, md.num_seqs, 2, md.block_tables.shape[1], 16, 16, 64)
    assert splits > 1
    check_attention(case, None)
    check_attention(case, True)


def test_attention_single_token_and_padding_only_seqs():
    case = make_case([1], [0], 2, 1, 16, 16, torch.float32, pad_tokens=2, pad_seqs=3, seed=4)
    check_attention(case, None)
    check_attention(case, 8)


@pytest.mark.parametrize("split_k", [False, 4])
def test_attention_writes_every_output_row(monkeypatch, split_k):
    """The output is allocated uninitialised: padding token rows must be written (zeros) by the
    kernels themselves, with no memset launch."""
    case = make_case([1, 3], [9, 20], 4, 2, 16, 16, torch.float32, pad_tokens=5, pad_seqs=2, seed=10)
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan")))
    check_attention(case, split_k)


def test_attention_tf32_precision_is_accepted():
    case = make_case([3, 1], [5, 9], 4, 2, 16, 16, torch.float32, seed=5)
    check_attention(case, False, precision="tf32", tol={"atol": 1e-5, "rtol": 1e-5})  # ignored by the interpreter
    with pytest.raises(ValueError, match="precision"):
        paged_attention_triton(
            case[0], case[3], case[4].block_tables, case[4].seq_lens, case[4].query_start_loc, 1.0, "x"
        )


def test_choose_num_splits_shape_only():
    # Only all-decode batches split; big batches fill the GPU without it; short tables limit splits.
    assert choose_num_splits(8, 4, 8, 512, 16, 64, 132) == 1  # not all-decode
    assert choose_num_splits(128, 128, 8, 512, 16, 64, 132) == 1  # enough programs
    s = choose_num_splits(1, 1, 8, 512, 16, 64, 132)
    assert s > 1 and s & (s - 1) == 0
    assert choose_num_splits(1, 1, 8, 2, 16, 64, 132) == 1  # context too short to split
    assert choose_num_splits(1, 1, 8, 512, 16, 64, 132) >= choose_num_splits(32, 32, 8, 512, 16, 64, 132)


def test_launcher_reads_no_tensor_values(monkeypatch):
    """Grid sizes and tiles come from shapes: no .item()/.tolist()/bool() from the launcher
    (it must be capturable in a CUDA graph)."""
    case = make_case([1, 5], [9, 30], 4, 2, 16, 16, torch.float32, pad_tokens=1, seed=6)
    q, k, v, cache, md = case
    launcher_file = triton_attention.__file__

    def guard(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename == launcher_file:
                raise AssertionError(f"launcher called Tensor.{name}")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__"):
        guard(name)
    kv_write_triton(k, v, cache, md.slot_mapping)
    for split in (False, 2, None):
        paged_attention_triton(q, cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.25, split_k=split)
    q, k, v, cache, md = make_case([1, 1, 1], [9, 30, 2], 4, 2, 16, 16, torch.float32, pad_tokens=1, pad_seqs=1)
    for split in (False, 2, None):  # the decode kernel, KV write fused
        attention_forward(q, k, v, cache, *md, 0.25, split_k=split)
        paged_attention_triton(q, cache, *md[1:], 0.25, split_k=split)


# ------------------------------------------------------------- CPU: unified-kernel prefill tiles
# Query tiles and context lengths chosen to cross the unmasked / masked key-tile boundary: tiles
# wholly below a query tile's first position skip the masks, the diagonal and context-boundary
# tiles apply them. Also a decode row and padding rows / sequences in the same batch.
PREFILL_TILE_MIX = ([40, 7, 25, 1, 19], [0, 33, 16, 50, 13])
PREFILL_TILE_HEADS = {"gqa12/2": (12, 2), "gqa6/2": (6, 2), "mha4": (4, 4)}  # group 6, 3 and 1
PREFILL_TILE_CONFIGS = [
    {},  # packed GQA rows (GROUP rows per token), unmasked + masked phases
    {"mask_split": False},  # every key tile masked (the old loop)
    {"pad_group": True},  # GQA rows padded to a power of two per token (the old layout)
    {"reverse_tiles": True},  # a sequence's last query tile first
    {"block_m": 64, "block_n": 32},  # key tiles of two KV blocks
    {"block_m": 16, "block_n": 64, "mask_split": True, "reverse_tiles": True},
]


@pytest.mark.parametrize(
    "config", PREFILL_TILE_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default"
)
@pytest.mark.parametrize("split_k", [False, 4], ids=["nosplit", "split4"])
@pytest.mark.parametrize("heads", list(PREFILL_TILE_HEADS))
def test_unified_prefill_tiles_fp32(monkeypatch, heads, split_k, config):
    case = make_case(*PREFILL_TILE_MIX, *PREFILL_TILE_HEADS[heads], 32, 16, torch.float32, pad_tokens=4, pad_seqs=2)
    real_empty_like = torch.empty_like  # every output row (padding rows too) must be written
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan")))
    check_attention(case, split_k, config=config)


@pytest.mark.parametrize("heads", ["gqa12/2", "mha4"])
def test_unified_prefill_long_chunk_many_query_tiles(heads):
    """A chunk of many query tiles over a cached prefix, KV blocks larger than the key tile."""
    case = make_case([70, 3], [45, 100], *PREFILL_TILE_HEADS[heads], 16, 32, torch.float32, pad_tokens=2, seed=40)
    for config in ({"block_m": 16}, {"block_m": 32, "reverse_tiles": True}, {"block_m": 16, "pad_group": True}):
        check_attention(case, False, config=config)
    check_attention(case, 2, config={"block_m": 32, "block_n": 32})


def test_unified_mask_split_and_tile_order_are_exact():
    """Skipping the masks on fully visible key tiles, or reversing the tile order, changes no bit."""
    q, _, _, cache, md = make_case(*PREFILL_TILE_MIX, 12, 2, 32, 16, torch.float32, pad_tokens=3, seed=41)
    args = (q, cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.2)
    for split in (False, 2):
        base = paged_attention_triton(*args, split_k=split, config={"mask_split": False})
        for config in ({"mask_split": True}, {"reverse_tiles": True}):
            assert torch.equal(paged_attention_triton(*args, split_k=split, config=config), base)


def test_unified_tile_config_row_layout():
    """GQA rows are packed GROUP per token (group 6: 21 tokens x 6 heads in a 128-row tile) unless
    pad_group; the grid bound num_tokens // BLOCK_Q + num_seqs + 1 covers any BLOCK_Q."""
    tile_config = triton_attention._tile_config
    cfg = tile_config(False, False, 6, 128, torch.bfloat16)
    assert (cfg["BLOCK_M"], cfg["GROUP_P"], cfg["BLOCK_Q"]) == (128, 6, 21)
    assert cfg["MASK_SPLIT"] and cfg["REVERSE_TILES"]
    assert not tile_config(False, False, 6, 128, torch.bfloat16, config={"reverse_tiles": False})["REVERSE_TILES"]
    mha = [tile_config(False, False, 1, 128, torch.bfloat16, nvidia=nvidia) for nvidia in (True, False)]
    assert [(c["BLOCK_M"], c["BLOCK_N"]) for c in mha] == [(128, 128), (128, 64)]  # NVIDIA only: LDS
    cfg = tile_config(False, False, 6, 128, torch.bfloat16, config={"pad_group": True, "mask_split": False})
    assert (cfg["BLOCK_M"], cfg["GROUP_P"], cfg["BLOCK_Q"], cfg["MASK_SPLIT"]) == (128, 8, 16, False)
    cfg = tile_config(False, False, 1, 128, torch.bfloat16, config={"block_m": 64, "block_n": 128, "stages": 3})
    assert (cfg["BLOCK_M"], cfg["BLOCK_Q"], cfg["BLOCK_N"], cfg["stages"]) == (64, 64, 128, 3)
    cfg = tile_config(False, False, 48, 128, torch.bfloat16, config={"block_m": 16})
    assert (cfg["BLOCK_M"], cfg["GROUP_P"], cfg["BLOCK_Q"]) == (64, 48, 1)  # at least one token per tile
    assert {"mask_split", "pad_group", "reverse_tiles"} <= triton_attention.CONFIG_KEYS


# ------------------------------------------------------------------------- CPU: the decode kernel
# Context lengths cross block (16/32) and key-tile boundaries; seq_len = context + 1.
DECODE_MIXES = {
    "b1": [47],
    "b5": [0, 15, 16, 31, 64],
    "b3-long": [95, 3, 130],
}
DECODE_HEADS = {"mha4": (4, 4), "gqa8/2": (8, 2), "gqa6/2": (6, 2)}  # group 1, 4 and 3 (padded to 4)


@pytest.mark.parametrize("fused", [False, True], ids=["write-kernel", "fused-write"])
@pytest.mark.parametrize("split_k", [False, 4, None], ids=["nosplit", "split4", "auto"])
@pytest.mark.parametrize("heads", list(DECODE_HEADS))
@pytest.mark.parametrize("mix", list(DECODE_MIXES))
def test_decode_kernel_fp32(mix, heads, split_k, fused):
    ctx = DECODE_MIXES[mix]
    block_size = 32 if mix == "b3-long" else 16
    case = make_case(
        [1] * len(ctx), ctx, *DECODE_HEADS[heads], 32, block_size, torch.float32, pad_tokens=2, pad_seqs=2, seed=20
    )
    assert uses_decode_kernel(case[0].shape[0], case[4].num_seqs)
    check_attention(case, split_k, fused=fused)


@pytest.mark.parametrize("fused", [False, True], ids=["write-kernel", "fused-write"])
@pytest.mark.parametrize("split_k", [False, 2], ids=["nosplit", "split2"])
@pytest.mark.parametrize("heads", ["mha4", "gqa6/2"])
def test_decode_kernel_fp16(heads, split_k, fused):
    case = make_case([1] * 4, [5, 16, 33, 70], *DECODE_HEADS[heads], 32, 16, torch.float16, pad_tokens=1, pad_seqs=1)
    check_attention(case, split_k, fused=fused)


@pytest.mark.parametrize(
    "config",
    [
        {"use_dot": True},  # MHA through a 16-row tl.dot tile
        {"use_dot": False, "block_n": 32},  # broadcast-multiply path, a tile of two blocks
        {"block_n": 64, "splits": 2},
        {"block_n": 16, "splits": 8, "waves": 4},  # more splits than the short sequences have tiles
        {"warps": 2, "stages": 2, "reduce_warps": 1, "splits": 2},
        {"prefetch": False, "splits": 2},
        {"early_reads": False},
        {"l2_prefetch": 2, "splits": 2},  # (a hint the interpreter skips: the same results)
        {"fuse_write": False, "splits": 4},
        {"decode": False},  # decode shapes through the unified kernel
        {"decode": False, "block_m": 32, "block_n": 32, "splits": 2},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
@pytest.mark.parametrize("heads", ["mha4", "gqa8/2"])
def test_decode_config_overrides(heads, config):
    case = make_case([1] * 3, [40, 7, 90], *DECODE_HEADS[heads], 32, 16, torch.float32, pad_tokens=1, pad_seqs=1)
    check_attention(case, None, config=config)
    check_attention(case, None, config=config, fused=True)


def _launched_kernels(monkeypatch) -> list[str]:
    """Names of the kernels the launchers run from now on (``triton_attention.kernel_for`` spied)."""
    names: list[str] = []
    real = triton_attention.kernel_for
    monkeypatch.setattr(
        triton_attention, "kernel_for", lambda fn, interpret: names.append(fn.__name__) or real(fn, interpret)
    )
    return names


@pytest.mark.parametrize("split_k", [2, 4, 16])
@pytest.mark.parametrize("heads", ["mha4", "gqa6/2"])
def test_decode_fused_split_reduce(monkeypatch, heads, split_k):
    """Split-K decode merges its splits in the decode kernel itself (the last split of each (token, KV
    head) to finish, counted with an atomic): no reduce launch, the reference's output (padding rows
    zero), the arrival counters back at zero; ``fuse_reduce=0`` runs the reduce kernel instead, with
    the same result up to rounding. By default MHA merges in the kernel, and GQA only where its
    unsplit grid fills an eighth of the GPU (here 12 programs on the interpreter's 64 "SMs": fused)."""
    case = make_case([1] * 4, [3, 40, 90, 0], *DECODE_HEADS[heads], 32, 16, torch.float32, pad_tokens=2, pad_seqs=2)
    launched = _launched_kernels(monkeypatch)
    check_attention(tuple(x.clone() if torch.is_tensor(x) else x for x in case), split_k, fused=True)
    assert "_split_reduce_kernel" not in launched  # the default for both here
    launched.clear()
    real_empty_like = torch.empty_like  # padding rows must be written by the kernel
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan")))
    case_f = tuple(x.clone() if torch.is_tensor(x) else x for x in case)
    fused = check_attention(case_f, split_k, fused=True, config={"fuse_reduce": True})
    assert launched == ["_paged_attention_decode_kernel"]
    assert not decode_attention._COUNTERS[torch.device("cpu")].any()
    launched.clear()
    plain = check_attention(case, split_k, fused=True, config={"fuse_reduce": False})
    assert launched == ["_paged_attention_decode_kernel", "_split_reduce_kernel"]
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("sms", "fused"), [(96, True), (97, False)])
def test_gqa_decode_merges_in_the_kernel_once_its_unsplit_grid_fills_an_eighth_of_the_gpu(monkeypatch, sms, fused):
    """6 token rows (two padding) x 2 KV heads = 12 (token, KV head) programs: with 96 SMs the unsplit
    grid fills an eighth of them, the launcher splits the context in 16 (for two waves) and the last
    split with keys merges the group in the kernel; with 97 SMs (32 splits wanted) the reduce kernel
    merges. The reference's output either way."""
    case = make_case([1] * 4, [3, 40, 90, 0], *DECODE_HEADS["gqa6/2"], 32, 16, torch.float32, pad_tokens=2, pad_seqs=2)
    monkeypatch.setattr(triton_attention, "sm_count", lambda device: sms)
    launched = _launched_kernels(monkeypatch)
    check_attention(case, None, fused=True)
    expected = ["_paged_attention_decode_kernel"] + ([] if fused else ["_split_reduce_kernel"])
    assert launched == expected


@pytest.mark.parametrize("heads", ["mha4", "gqa6/2"])
def test_decode_fused_merge_reads_only_the_splits_with_keys(monkeypatch, heads):
    """Short contexts leave most of 16 splits without keys: those exit without writing partials or
    counting, and the merge loads only the ones that wrote (split buffers start as NaN, so reading an
    unwritten partial would show); a one-tile context is written by its lone split directly."""
    case = make_case([1] * 4, [3, 15, 40, 0], *DECODE_HEADS[heads], 32, 16, torch.float32, pad_tokens=1, pad_seqs=1)
    real_empty = torch.empty
    monkeypatch.setattr(
        torch, "empty", lambda *a, **kw: t.fill_(float("nan")) if (t := real_empty(*a, **kw)).is_floating_point() else t
    )
    check_attention(case, 16, fused=True, config={"fuse_reduce": True})
    assert not decode_attention._COUNTERS[torch.device("cpu")].any()


@pytest.mark.parametrize(("sms", "fused_write"), [(64, True), (4, True), (3, False)])
def test_decode_write_is_fused_while_the_programs_fit_two_waves(monkeypatch, sms, fused_write):
    """4 sequence rows (one padding) x 2 KV heads = 8 (sequence, KV head) programs: the write is fused
    into the decode kernel up to two waves (8 <= 2 x 4 SMs), else the write kernel runs first."""
    case = make_case([1] * 3, [20, 33, 7], 8, 2, 16, 16, torch.float32, pad_tokens=1, pad_seqs=1, seed=26)
    monkeypatch.setattr(triton_attention, "sm_count", lambda device: sms)
    launched = _launched_kernels(monkeypatch)
    check_attention(case, None, fused=True)
    assert ("_kv_write_kernel" in launched) != fused_write
    assert "_paged_attention_decode_kernel" in launched


def test_decode_fused_reduce_falls_back_to_the_reduce_kernel(monkeypatch):
    """Without counters (more (token, KV head) pairs than their capacity, or none allocated yet while
    a CUDA graph is captured) the launch runs the separate reduce kernel, with the same result."""
    case = make_case([1] * 3, [20, 33, 7], 4, 2, 16, 16, torch.float32, pad_tokens=1, pad_seqs=1, seed=25)
    launched = _launched_kernels(monkeypatch)
    monkeypatch.setattr(decode_attention, "_COUNTER_CAPACITY", 4)  # 4 tokens x 2 KV heads = 8 > 4
    check_attention(case, 4, fused=True, config={"fuse_reduce": True})
    assert launched == ["_paged_attention_decode_kernel", "_split_reduce_kernel"]
    assert decode_attention._split_counters(torch.device("cpu"), 4) is not None
    monkeypatch.setattr(decode_attention, "_COUNTERS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert decode_attention._split_counters(torch.device("cuda", 0), 4) is None
    assert decode_attention._COUNTERS == {}  # nothing allocated during the (pretended) capture


@pytest.mark.parametrize("heads", ["mha4", "gqa6/2"])
@pytest.mark.parametrize("fuse_reduce", [True, False])
@pytest.mark.parametrize("splits", [4, 8, 32])
def test_decode_split_grain_matches_reference(heads, fuse_reduce, splits):
    """``split_grain`` below the 64-key tile: contexts crossing grain, tile and block boundaries."""
    case = make_case([1] * 5, [0, 15, 40, 63, 130], *DECODE_HEADS[heads], 16, 16, torch.float32, pad_tokens=1, seed=8)
    config = {"block_n": 64, "split_grain": 16, "fuse_reduce": fuse_reduce}
    check_attention(case, splits, fused=True, config=config)


@pytest.mark.parametrize("heads", ["mha4", "gqa6/2"])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_fused_write_in_either_load_order_matches_reference(heads, splits):
    """``early_q`` (default: q and the written K/V row in one round trip, then the row's stores) and
    ``early_q=0`` (the order before session 18) write the same cache and outputs; padding token rows
    (one writing a scratch slot) and padding sequences included."""
    case = make_case([1] * 4, [3, 15, 40, 0], *DECODE_HEADS[heads], 16, 16, torch.float32, pad_tokens=1, pad_seqs=1)
    assert uses_decode_kernel(case[0].shape[0], case[4].num_seqs)
    used = set(case[4].block_tables.flatten().tolist())
    spare = next(b for b in range(case[3].shape[1]) if b not in used)
    case[4].slot_mapping[4] = spare * 16 + 3  # a padding row that writes (a scratch slot) is written too
    outs = []
    for early_q in (True, False):
        q, k, v, cache, md = (x.clone() if torch.is_tensor(x) else x for x in case)
        outs.append(check_attention((q, k, v, cache, md), splits, fused=True, config={"early_q": early_q}))
    assert torch.equal(outs[0], outs[1])


@pytest.fixture
def partial_lse(monkeypatch):
    """The split partials' log-sum-exp buffers ``[splits, T, H]`` the launcher allocates, NaN-filled
    (a split that writes none leaves NaN)."""
    buffers = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        if out.dtype == torch.float32 and out.dim() == 3:
            buffers.append(out.fill_(float("nan")))
        return out

    monkeypatch.setattr(triton_attention.torch, "empty", empty)
    return buffers


@pytest.mark.parametrize(("grain", "active"), [(None, [0, 2]), (16, [3, 7]), (32, [2, 4])])
def test_decode_split_grain_spreads_a_short_context_over_more_splits(partial_lse, grain, active):
    """Which splits write a partial (fused merge, 8 splits, 64-key tiles): a lone split with keys
    writes the output directly. 41 and 101 keys make 1 and 2 tiles of 64, but 3 and 7 runs of 16."""
    case = make_case([1, 1], [40, 100], 4, 4, 16, 16, torch.float32, seed=9)
    config = {"block_n": 64, "split_grain": grain, "fuse_reduce": True}
    check_attention(case, 8, fused=True, config=config)
    (lse,) = partial_lse
    assert torch.isfinite(lse).sum(dim=0)[:, 0].tolist() == active  # splits with keys, per token


@pytest.mark.parametrize(("grain", "splits"), [(None, 4), (16, 8)])
def test_decode_split_count_is_capped_at_the_tables_runs_of_the_grain(partial_lse, grain, splits):
    """Where the split count is capped by the block table (here the interpreter; on a GPU the reduce
    kernel's path), it counts runs of ``split_grain`` positions: 208 positions are 4 tiles of 64 but
    13 runs of 16 (64 SMs off the GPU: the heuristic asks for 64 splits)."""
    case = make_case([1], [200], 6, 2, 16, 16, torch.float32, seed=10)
    assert case[4].block_tables.shape[1] == 13
    check_attention(case, None, fused=True, config={"block_n": 64, "split_grain": grain, "fuse_reduce": False})
    assert [tuple(lse.shape) for lse in partial_lse] == [(splits, 1, 6)]


@pytest.mark.parametrize("heads", ["mha4", "gqa6/2"])
def test_decode_empty_splits_leaving_before_the_pdl_wait_change_no_bit(heads):
    """``early_exit``: with 16 splits most have no keys and return before the (here inert) PDL wait;
    outputs and caches are identical to the default, and the arrival counters end at zero."""
    case = make_case([1] * 4, [3, 15, 40, 0], *DECODE_HEADS[heads], 32, 16, torch.float32, pad_tokens=1, pad_seqs=1)
    outs = []
    for early_exit in (False, True):
        q, k, v, cache, md = (x.clone() if torch.is_tensor(x) else x for x in case)
        config = {"fuse_reduce": True, "early_exit": early_exit}
        outs.append((attention_forward(q, k, v, cache, *md, 0.25, split_k=16, config=config), cache))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not decode_attention._COUNTERS[torch.device("cpu")].any()
    check_attention(case, 16, fused=True, config={"fuse_reduce": True, "early_exit": True})


@pytest.mark.parametrize("split_k", [False, 4])
def test_decode_early_metadata_reads_change_no_bit(split_k):
    """Reading the metadata before the PDL wait (``early_reads``, the default) or after it computes
    the same thing: identical outputs and caches."""
    case = make_case([1, 3, 1, 1], [30, 17, 0, 64], 6, 2, 32, 16, torch.float32, pad_seqs=2, seed=26)
    outs = []
    for early in (True, False):
        q, k, v, cache, md = (x.clone() if torch.is_tensor(x) else x for x in case)
        outs.append(
            (attention_forward(q, k, v, cache, *md, 0.2, split_k=split_k, config={"early_reads": early}), cache)
        )
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_rlt_attention_config_sets_launcher_defaults(monkeypatch):
    """``RLT_ATTENTION_CONFIG`` gives defaults under the caller's config; bad text or keys are errors."""
    case = make_case([1] * 3, [40, 7, 90], 4, 2, 16, 16, torch.float32, pad_tokens=1, pad_seqs=1, seed=27)
    launched = _launched_kernels(monkeypatch)
    monkeypatch.setenv("RLT_ATTENTION_CONFIG", "fuse_reduce=0, splits=4")
    check_attention(case, None, fused=True)
    assert launched == ["_paged_attention_decode_kernel", "_split_reduce_kernel"]
    launched.clear()
    check_attention(case, None, fused=True, config={"fuse_reduce": True})  # the caller's config wins
    assert launched == ["_paged_attention_decode_kernel"]
    for bad in ("fuse_reduce", "fuse_reduce=yes", "=1"):
        monkeypatch.setenv("RLT_ATTENTION_CONFIG", bad)
        with pytest.raises(ValueError, match="RLT_ATTENTION_CONFIG"):
            check_attention(case, None, fused=True)
    monkeypatch.setenv("RLT_ATTENTION_CONFIG", "fuse_reduse=0")
    with pytest.raises(ValueError, match="fuse_reduse.*RLT_ATTENTION_CONFIG"):
        check_attention(case, None, fused=True)


def test_decode_kernel_gqa_without_dot_and_block_smaller_than_block_size():
    # group 2 through the 3-D broadcast path; 16-position tiles inside 64-position KV blocks
    case = make_case([1] * 3, [100, 64, 1], 4, 2, 16, 64, torch.float32, pad_tokens=1, pad_seqs=1, seed=21)
    for split in (False, 4):
        check_attention(case, split, config={"use_dot": False}, fused=True)
        check_attention(case, split, config={"use_dot": False})


@pytest.mark.parametrize("head_dim", [24, 96])
def test_decode_kernel_non_power_of_two_head_dim(head_dim):
    case = make_case([1, 1], [20, 33], 4, 2, head_dim, 16, torch.float32, seed=22)
    for split in (False, 2):
        check_attention(case, split, fused=True)
        check_attention(case, split, config={"use_dot": False})


@pytest.mark.parametrize("fused", [False, True], ids=["write-kernel", "fused-write"])
@pytest.mark.parametrize("split_k", [False, 4])
def test_decode_shape_with_a_multi_token_sequence(split_k, fused):
    """num_tokens == num_seqs is a shape, not a promise: a 3-token sequence plus padding sequences
    has that shape too. Rows then find their sequence by counting, and (fused) read this step's
    other keys from k/v."""
    case = make_case([1, 3, 1], [30, 17, 0], 4, 2, 16, 16, torch.float32, pad_seqs=2, seed=23)
    assert uses_decode_kernel(case[0].shape[0], case[4].num_seqs)
    check_attention(case, split_k, fused=fused)
    case = make_case([4], [0], 2, 2, 16, 16, torch.float32, pad_seqs=3, seed=24)  # a pure prefill
    check_attention(case, split_k, fused=fused)
    # more sequences than one 64-wide counting chunk; the multi-token sequence sits in the second chunk
    case = make_case([1] * 66 + [3, 1], [5] * 66 + [20, 9], 2, 1, 16, 16, torch.float32, pad_seqs=2, seed=27)
    assert uses_decode_kernel(case[0].shape[0], case[4].num_seqs)
    check_attention(case, split_k, fused=fused)


@pytest.mark.parametrize("split_k", [False, 4])
def test_decode_kernel_writes_every_output_row(monkeypatch, split_k):
    case = make_case([1, 1], [9, 20], 4, 2, 16, 16, torch.float32, pad_tokens=4, pad_seqs=4, seed=25)
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan")))
    check_attention(case, split_k, fused=True)
    check_attention(case, split_k)


def test_decode_kernel_single_padding_only_batch():
    case = make_case([1], [0], 2, 1, 16, 16, torch.float32, pad_tokens=3, pad_seqs=3, seed=26)
    check_attention(case, None, fused=True)
    check_attention(case, 8, fused=True)


def test_fused_write_fp16_cache_from_fp32_inputs():
    q, k, v, cache, md = make_case([1, 1, 1], [3, 16, 40], 4, 2, 16, 16, torch.float32, pad_tokens=1, pad_seqs=1)
    case = (q.half(), k, v, cache.half(), md)  # k/v are cast to the cache dtype, also where read directly
    check_attention(case, 2, fused=True)


def test_choose_decode_splits_shape_only():
    assert choose_decode_splits(64, 8, 512, 16, 64, 132) == 1  # 512 programs >= 2 waves
    s = choose_decode_splits(1, 16, 64, 16, 64, 132)
    assert s == 16  # 16 programs -> 32 wanted; 16 tiles of 64 positions in the table
    assert choose_decode_splits(1, 16, 13, 16, 64, 132) == 4  # 208 positions: 4 tiles of 64
    assert choose_decode_splits(1, 16, 13, 16, 16, 132) == 8  # one-block tiles: 13 tiles
    assert choose_decode_splits(1, 8, 4096, 16, 64, 132) == 64  # capped at _MAX_SPLITS
    assert choose_decode_splits(32, 8, 512, 16, 64, 132) == 2
    assert choose_decode_splits(32, 8, 512, 16, 64, 132, waves=1) == 1
    assert choose_decode_splits(0, 8, 512, 16, 64, 132) == 1
    # uncapped: the waves target whatever the table (a short table then leaves splits empty)
    assert choose_decode_splits(1, 16, 13, 16, 64, 132, cap_to_table=False) == 32
    assert choose_decode_splits(1, 8, 13, 16, 64, 132, cap_to_table=False) == 64
    assert choose_decode_splits(64, 8, 13, 16, 64, 132, cap_to_table=False) == 1
    for batch in (1, 3, 17):
        n = choose_decode_splits(batch, 2, 100, 16, 32, 64)
        assert n & (n - 1) == 0 and 1 <= n <= 64


def test_decode_kernel_selection_and_config_validation():
    assert uses_decode_kernel(4, 4) and not uses_decode_kernel(5, 4)
    assert not uses_decode_kernel(4, 4, {"decode": False})
    assert not uses_decode_kernel(5, 4, {"decode": True})  # never for a non-decode shape
    case = make_case([1, 1], [3, 4], 2, 2, 16, 16, torch.float32)
    q, _, _, cache, md = case
    with pytest.raises(ValueError, match="unknown attention config"):
        paged_attention_triton(q, cache, *md[1:], 0.25, config={"blok_n": 32})
    with pytest.raises(ValueError, match="power of two"):
        paged_attention_triton(q, cache, *md[1:], 0.25, config={"block_n": 24})


def test_every_launcher_option_is_documented():
    """docs/kernels.md's table has a row for each key the launchers accept, and no other."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "kernels.md").read_text()
    rows = set()
    for line in doc.splitlines():
        if line.startswith("| `"):
            rows.update(re.findall(r"`(\w+)`", line.split("|")[1]))
    assert rows == set(CONFIG_KEYS)


def test_custom_op_fused_decode_matches_generic_op():
    q, k, v, cache, md = make_case([1] * 4, [17, 0, 40, 5], 8, 2, 32, 16, torch.float32, pad_tokens=1, pad_seqs=1)
    cache_ref = cache.clone()
    args = (md.slot_mapping, md.block_tables, md.seq_lens, md.query_start_loc, 0.2)
    ref = torch.ops.rlt.attention(q, k, v, cache_ref, *args)
    out = torch.ops.rlt.attention_triton(q, k, v, cache, *args, "ieee")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, cache_ref)


def test_custom_op_matches_generic_op():
    q, k, v, cache, md = make_case([1, 6, 3], [17, 0, 40], 8, 2, 32, 16, torch.float32, pad_tokens=2, seed=7)
    cache_ref = cache.clone()
    args = (md.slot_mapping, md.block_tables, md.seq_lens, md.query_start_loc, 0.2)
    ref = torch.ops.rlt.attention(q, k, v, cache_ref, *args)
    out = torch.ops.rlt.attention_triton(q, k, v, cache, *args, "ieee")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, cache_ref)


def test_custom_op_opcheck():
    q, k, v, cache, md = make_case([1, 4], [5, 2], 4, 2, 16, 16, torch.float32, seed=8)
    args = (q, k, v, cache, md.slot_mapping, md.block_tables, md.seq_lens, md.query_start_loc, 0.25, "ieee")
    torch.library.opcheck(
        torch.ops.rlt.attention_triton.default,
        args,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


def test_custom_op_under_torch_compile():
    q, k, v, cache, md = make_case([1, 6], [20, 9], 4, 2, 16, 16, torch.float32, pad_tokens=2, seed=9)

    def step(q, k, v, cache, slot_mapping, block_tables, seq_lens, query_start_loc):
        out = torch.ops.rlt.attention_triton(
            q * 1.0, k, v, cache, slot_mapping, block_tables, seq_lens, query_start_loc, 0.25
        )
        return out + 1.0

    cache_ref = cache.clone()
    ref = attention_reference(q, k, v, cache_ref, *md, 0.25) + 1.0
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    out = compiled(q, k, v, cache, *md)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, cache_ref)  # the in-place KV write survives functionalization


def test_backend_table():
    assert backends.backend_op("torch") is torch.ops.rlt.attention_torch.default
    assert backends.backend_op("triton") is torch.ops.rlt.attention_triton.default
    assert set(backends.ATTENTION_BACKENDS) == {"torch", "triton"}
    assert "flash" in backends.BACKEND_NAMES
    with pytest.raises(ValueError, match="unknown attention backend"):
        backends.backend_op("nope")
    schema = str(torch.ops.rlt.attention_triton.default._schema)
    assert schema.endswith('float scale, str precision="ieee") -> Tensor'), schema
    assert "Tensor(a3!) kv_cache" in schema


def test_backend_flash_needs_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    with pytest.raises(backends.BackendUnavailableError, match="flash_attn"):
        backends.backend_op("flash")
    assert "flash_attn" not in sys.modules


# ------------------------------------------------------------------------------------------ GPU
GPU_MIXES = {
    "decode_long": ([1] * 6, [1, 500, 1023, 1024, 2049, 4000]),
    "mixed": ([1, 300, 1, 77, 1], [1500, 0, 17, 400, 3000]),
    "chunked": ([512, 256], [1024, 333]),
}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("split_k", [None, False, 8], ids=["auto", "nosplit", "split8"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("heads", [(48, 8, 128), (16, 16, 128), (8, 2, 96)], ids=["gqa48/8", "mha16", "gqa-d96"])
@pytest.mark.parametrize("mix", list(GPU_MIXES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_attention_parity(dtype, mix, heads, block_size, split_k):
    query_lens, context_lens = GPU_MIXES[mix]
    case = make_case(
        query_lens,
        context_lens,
        *heads,
        block_size,
        dtype,
        pad_tokens=2 if mix.startswith("decode") else 5,
        pad_seqs=2,
        device="cuda",
        seed=11,
    )
    tol = {"atol": 2e-4, "rtol": 2e-4} if dtype == torch.float32 else None
    check_attention(case, split_k, precision="ieee", tol=tol)


@pytest.mark.gpu
@gpu
def test_gpu_attention_tf32():
    case = make_case([1, 200], [700, 50], 16, 4, 128, 16, torch.float32, device="cuda", seed=12)
    check_attention(case, None, precision="tf32", tol={"atol": 2e-2, "rtol": 2e-2})


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_gpu_decode_all_splits(batch):
    gen = torch.Generator().manual_seed(batch)
    ctx = torch.randint(1, 3000, (batch,), generator=gen).tolist()
    case = make_case([1] * batch, ctx, 48, 8, 128, 16, torch.bfloat16, device="cuda", seed=13)
    for split in (None, 1, 2, 16, 64):
        check_attention(case, split)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused-write", "write-kernel"])
@pytest.mark.parametrize("heads", [(48, 8, 128), (16, 16, 128), (8, 2, 96)], ids=["gqa48/8", "mha16", "gqa-d96"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_decode_kernel_parity(dtype, heads, fused):
    """The decode kernel (all-decode shapes) with its default and the sweep's config variations."""
    ctx = [1, 17, 500, 1023, 1024, 2049, 4000]
    case = make_case([1] * len(ctx), ctx, *heads, 16, dtype, pad_tokens=2, pad_seqs=2, device="cuda", seed=30)
    assert uses_decode_kernel(case[0].shape[0], case[4].num_seqs)
    tol = {"atol": 2e-4, "rtol": 2e-4} if dtype == torch.float32 else None
    group = heads[0] // heads[1]
    configs = [None, {"splits": 1}, {"splits": 8}, {"splits": 64, "block_n": 16}, {"use_dot": group == 1}]
    configs += [{"block_n": 128}, {"block_n": 32, "warps": 8, "stages": 3}, {"warps": 2, "stages": 1}]
    configs += [{"prefetch": False}, {"waves": 4}, {"l2_prefetch": 1}, {"l2_prefetch": 2, "splits": 2}]
    configs += [{"l2_prefetch": 4, "splits": 1, "warps": 8}]
    configs += [{"fuse_reduce": group != 1, "splits": 2}, {"fuse_reduce": group != 1, "splits": 8}]
    configs += [{"fuse_reduce": True, "splits": 64, "early_exit": True}]  # empty splits leave before the wait
    configs += [{"split_grain": 16}, {"split_grain": 16, "splits": 32, "fuse_reduce": True}, {"early_q": False}]
    for config in configs:
        check_attention(case, None, tol=tol, config=config, fused=fused)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [32, 64])
def test_gpu_decode_kernel_block_sizes_and_multi_token_rows(block_size):
    ctx = [0, 63, 64, 65, 700]
    case = make_case([1] * 5, ctx, 16, 4, 128, block_size, torch.bfloat16, pad_tokens=3, pad_seqs=3, device="cuda")
    for split in (None, 1, 4):
        check_attention(case, split, fused=True)
        check_attention(case, split)
    # a decode-shaped batch holding a 4-token sequence (rows find their sequence by counting)
    case = make_case([1, 4, 1], [300, 70, 0], 16, 4, 128, block_size, torch.bfloat16, pad_seqs=3, device="cuda")
    for split in (None, 1, 4):
        check_attention(case, split, fused=True)
        check_attention(case, split)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config", [None, {"splits": 1}, {"splits": 16}, {"use_dot": True}, {"decode": False}], ids=str)
@pytest.mark.parametrize("kv_heads", [4, 16])
def test_gpu_cuda_graph_replay_fused_decode(kv_heads, config):
    """rlt::attention's decode path (KV write fused into the decode kernel) captured once, replayed
    with new metadata/q/k/v: output and the written cache rows match."""
    bs, heads, dim, block, max_blocks = 6, 16, 128, 16, 40
    num_blocks = bs * max_blocks + 1
    dev = "cuda"
    cache = torch.randn(2, num_blocks, block, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    q = torch.randn(bs, heads, dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(bs, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn(bs, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    static = build_metadata(
        [1] * bs, [0] * bs, [[i + 1] for i in range(bs)], block, device=dev, pad_blocks_to=max_blocks
    )

    def step():
        return attention_forward(q, k, v, cache, *static, dim**-0.5, config=config)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for trial in range(3):
        gen = torch.Generator().manual_seed(100 + trial)
        n_real = bs - trial  # the last rows become padding (slot -1, empty sequences)
        ctx = torch.randint(0, max_blocks * block - 1, (n_real,), generator=gen).tolist()
        perm = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()
        tables = [perm[i * max_blocks : (i + 1) * max_blocks] for i in range(n_real)]
        md = build_metadata(
            [1] * n_real, ctx, tables, block, device=dev, pad_tokens_to=bs, pad_seqs_to=bs, pad_blocks_to=max_blocks
        )
        for dst, src in zip(static, md):
            dst.copy_(src)
        q.normal_()
        k.normal_()
        v.normal_()
        before = cache.clone()
        graph.replay()
        ref_cache = before.clone()
        kv_write_reference(k, v, ref_cache, md.slot_mapping)
        assert torch.equal(cache, ref_cache)
        ref = paged_attention_reference(q, ref_cache, md.block_tables, md.seq_lens, md.query_start_loc, dim**-0.5)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
        assert torch.count_nonzero(out[n_real:]) == 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("split_k", [None, False])
def test_gpu_cuda_graph_replay_with_new_metadata(split_k):
    """Capture once with a padded shape, then change the metadata values in place and replay."""
    bs, heads, kv_heads, dim, block = 4, 16, 4, 128, 16
    max_blocks = 64
    num_blocks = bs * max_blocks + 1
    dev = "cuda"
    cache = torch.randn(2, num_blocks, block, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    q = torch.randn(bs, heads, dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(bs, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn(bs, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    static = build_metadata([1] * bs, [0] * bs, [[0]] * bs, block, device=dev, pad_blocks_to=max_blocks)

    def step():
        torch.ops.rlt.attention_triton(q, k, v, cache, *static, dim**-0.5, "ieee")
        return paged_attention_triton(
            q, cache, static.block_tables, static.seq_lens, static.query_start_loc, dim**-0.5, split_k=split_k
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up / compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for trial in range(3):
        gen = torch.Generator().manual_seed(trial)
        ctx = torch.randint(0, max_blocks * block - 1, (bs,), generator=gen).tolist()
        perm = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()
        tables = [perm[i * max_blocks : (i + 1) * max_blocks] for i in range(bs)]
        md = build_metadata([1] * bs, ctx, tables, block, device=dev, pad_blocks_to=max_blocks)
        for dst, src in zip(static, md):
            dst.copy_(src)
        q.normal_()
        k.normal_()
        v.normal_()
        graph.replay()
        ref_cache = cache.clone()
        ref = paged_attention_reference(q, ref_cache, md.block_tables, md.seq_lens, md.query_start_loc, dim**-0.5)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


@pytest.mark.gpu
@gpu
def test_gpu_custom_op_under_inductor():
    q, k, v, cache, md = make_case([1, 64, 1], [300, 0, 90], 48, 8, 128, 16, torch.bfloat16, device="cuda")

    def step(q, k, v, cache, *md):
        return torch.ops.rlt.attention_triton(q, k, v, cache, *md, 0.088, "ieee") * 2.0

    cache_ref = cache.clone()
    ref = attention_reference(q, k, v, cache_ref, *md, 0.088) * 2.0
    out = torch.compile(step, fullgraph=True)(q, k, v, cache, *md)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(cache, cache_ref)


def test_large_mha_decode_batches_take_the_unified_kernel():
    """Measured choice (docs/benchmarks.md): MHA decode beyond two waves of programs runs the unified
    kernel; GQA and small MHA batches the decode kernel; an explicit config wins."""
    assert uses_decode_kernel(16, 16, None, 1, 16, 132)  # 256 programs <= 2 waves
    assert not uses_decode_kernel(32, 32, None, 1, 16, 132)  # 512 programs
    assert uses_decode_kernel(128, 128, None, 6, 8, 132)  # GQA: always the decode kernel
    assert uses_decode_kernel(32, 32, {"decode": True}, 1, 16, 132)
    assert not uses_decode_kernel(33, 32, None, 6, 8, 132)


def _decode_launch_values(key: str, max_model_len: int, dtype: torch.dtype, modes=("decode", "decode-split")) -> dict:
    """``key`` of the decode-kernel launches for an H200 (recorded on meta tensors; Ouro and Nanbeige
    at ``max_model_len``), per (GROUP, rows)."""
    import dataclasses

    from rlt_compile.kernels import aot
    from rlt_compile.platform import Platform

    workloads = [dataclasses.replace(w, max_model_len=max_model_len) for w in aot.WORKLOADS[:2]]
    launches = aot.capture_launches(Platform.mock("cuda"), workloads, (dtype,), modes)
    return {
        (launch.kwargs["GROUP"], launch.grid[0]): launch.kwargs[key]
        for launch in launches
        if launch.kernel.endswith("_paged_attention_decode_kernel")
    }


def _decode_key_tiles(max_model_len: int, dtype: torch.dtype) -> dict:
    return _decode_launch_values("BLOCK_N", max_model_len, dtype)


def test_decode_splits_ignore_a_short_table_only_where_the_merge_is_fused(monkeypatch):
    """On an H200 (launches recorded on meta tensors) at a 128-position table: where the merge is fused
    in the kernel (empty splits free) the split count is the waves target though the table's 2 key
    tiles fill only 2 (8 decode rows: MHA 128 programs, 4 splits for 264 wanted; GQA 64 programs, 8;
    one row: MHA 16 programs, 32); at one GQA row (8 programs, a reduce kernel reads every split) it
    stays at the table's key tiles (8: a table this short takes 16-key tiles), as does the CPU
    interpreter, which runs every program."""
    splits = _decode_launch_values("NUM_SPLITS", 128, torch.bfloat16, ("decode-split",))
    assert splits == {(1, 8): 4, (6, 8): 8, (1, 1): 32, (6, 1): 8}

    q, k, v, cache, md = make_case([1] * 8, [20] * 8, 4, 4, 16, 16, torch.float32)  # MHA, interpreted
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs.get("NUM_SPLITS"))

    monkeypatch.setattr(triton_attention, "kernel_for", lambda fn, interpret: Recorder())
    table_blocks = md.block_tables.shape[1]  # = key tiles: the interpreter's are one 16-position block
    attention_forward(q, k, v, cache, md.slot_mapping, md.block_tables, md.seq_lens, md.query_start_loc, 0.25)
    assert choose_decode_splits(8, 4, table_blocks, 16, 16, 64, cap_to_table=False) > table_blocks
    assert seen == [choose_decode_splits(8, 4, table_blocks, 16, 16, 64)]


def test_short_context_decode_takes_16_key_tiles():
    """16-bit decode takes 16-key tiles where the block table holds at most SHORT_DECODE_CONTEXT
    positions (or ``decode_context_limit`` promises as much) and its unsplit grid is below a wave;
    64-key tiles otherwise. fp32 keeps its 32-key tiles."""
    assert SHORT_DECODE_CONTEXT == 256
    bf16 = torch.bfloat16
    assert set(_decode_key_tiles(256, bf16).values()) == {16}  # rows 1 and 8: 16 / 128 programs < 132 SMs
    assert set(_decode_key_tiles(257, bf16).values()) == {64}
    assert set(_decode_key_tiles(4096, bf16).values()) == {64}
    assert set(_decode_key_tiles(128, torch.float32).values()) == {32}
    with decode_context_limit(200):
        assert set(_decode_key_tiles(4096, bf16).values()) == {16}
    with decode_context_limit(4096):
        assert set(_decode_key_tiles(128, bf16).values()) == {16}  # a limit never widens the table
    assert set(_decode_key_tiles(4096, bf16).values()) == {64}
    cfg = _decode_tile_config(False, 1, 128, bf16, {}, programs=132, num_sms=132, max_context=128)
    assert cfg["block_n"] == 64  # a full wave of programs keeps the wide tile
    assert decode_table_blocks(300, 16) == 300
    with decode_context_limit(100):
        assert decode_table_blocks(300, 16) == 7 and decode_table_blocks(3, 16) == 3


@pytest.mark.parametrize("limit", [16, 100])
def test_decode_under_a_broken_context_promise_stays_exact(limit):
    """``decode_context_limit`` only steers tiles and split counts: contexts longer than it promised
    still attend over every key (interpreter, reduce kernel: its split count follows the limit)."""
    case = make_case([1, 1, 1], [20, 300, 700], 6, 2, 16, 16, torch.float32, seed=12)
    with decode_context_limit(limit):
        check_attention(case, None, fused=True, config={"fuse_reduce": False})
        check_attention(case, None, fused=True, config={"fuse_reduce": True})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_mha_decode_takes_the_dot_tile_only_where_the_context_is_split(dtype):
    """The launcher's choice for an H200 (launches recorded on meta tensors): 16-bit MHA decode uses
    the 16-row ``tl.dot`` tile with split-K and the multiply + sum without; fp32 MHA never the tile,
    GQA always (its group's heads are the tile's rows)."""
    from rlt_compile.kernels import aot
    from rlt_compile.platform import Platform

    launches = aot.capture_launches(Platform.mock("cuda"), aot.WORKLOADS[:2], (dtype,), ("decode", "decode-split"))
    seen = {}
    for launch in launches:
        if launch.kernel.endswith("_paged_attention_decode_kernel"):
            kw = launch.kwargs
            seen[(kw["GROUP"] > 1, kw["NUM_SPLITS"] > 1)] = kw["USE_DOT"]
    assert set(seen) == {(False, False), (False, True), (True, False), (True, True)}
    assert seen[(False, True)] is (dtype != torch.float32)
    assert seen[(False, False)] is False
    assert seen[(True, False)] is True and seen[(True, True)] is True
