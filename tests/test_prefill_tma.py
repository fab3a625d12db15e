"""Prefill attention with the step's own keys read through TMA (``kernels/prefill_tma.py``).

CPU: the kernel in Triton's interpreter (forced with ``config={"prefill_tma": True}``) against the
torch reference through the op's path (``attention_forward``: KV write, then attention), for fresh
prompts, chunks with a cached prefix, mixed batches with decode rows, GQA and MHA, padding token rows;
the dispatch rule per platform. GPU (``-m gpu``): the same parity in bf16 / fp16 at model shapes,
taken by the automatic rule, and fp32 when forced.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_kernels import check_attention, make_case

from rlt_compile import platform as _platform
from rlt_compile.kernels import prefill_tma
from rlt_compile.platform import Platform

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with TMA (run with -m gpu on the device)")
FORCE = {"prefill_tma": True}


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [
        ([40, 17, 64], [0, 0, 0]),  # fresh prompts
        ([33, 20], [50, 7]),  # chunks after a cached prefix (partial last prefix tile)
        ([1, 45, 1, 9], [30, 0, 70, 16]),  # decode rows in a prefill batch
    ],
)
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_tma_matches_reference(interpret, heads, query_lens, context_lens, block_size):
    case = make_case(
        query_lens, context_lens, *heads, 16, block_size, torch.float32, pad_tokens=5, seed=len(query_lens)
    )
    check_attention(case, None, config=FORCE, fused=True)


def test_prefill_tma_separate_write(interpret):
    """``fuse_write=False``: the write kernel stores the rows first, the TMA kernel only reads them."""
    case = make_case([29, 1, 12], [0, 21, 40], 6, 2, 16, 8, torch.float32, pad_tokens=3, seed=4)
    check_attention(case, None, config={**FORCE, "fuse_write": False}, fused=True)


def test_prefill_tma_tile_config_overrides(interpret):
    case = make_case([70, 3], [5, 40], 4, 2, 16, 16, torch.float32, seed=3)
    check_attention(case, None, config={**FORCE, "block_m": 16, "block_n": 16}, fused=True)
    with pytest.raises(ValueError, match="multiple of block_n"):
        check_attention(case, None, config={**FORCE, "block_m": 16, "block_n": 32}, fused=True)
    with pytest.raises(ValueError, match="rescale_slack"):
        check_attention(case, None, config={**FORCE, "rescale_slack": prefill_tma.MAX_RESCALE_SLACK + 1}, fused=True)


SOFTMAX_OPTIONS = [{"fold_scale": 1}, {"rescale_slack": 1}, {"rescale_slack": 8}, {"rescale_slack": 8, "fold_scale": 1}]


@pytest.mark.parametrize("options", SOFTMAX_OPTIONS)
def test_prefill_tma_softmax_options_match_reference(interpret, options):
    """``fold_scale`` / ``rescale_slack`` change the key tile's work, not the softmax (random scores:
    with a slack of 8 most tiles keep the running max and skip the rescale)."""
    for heads, query_lens, context_lens in (((4, 4), [40, 17], [0, 30]), ((6, 2), [33, 20, 1], [50, 7, 12])):
        case = make_case(query_lens, context_lens, *heads, 16, 8, torch.float32, pad_tokens=3, seed=7)
        check_attention(case, None, config={**FORCE, **options}, fused=True)


def test_prefill_tma_tiles_first_grid_matches_reference(interpret):
    """``heads_first=0`` swaps the grid's axes back (query tiles on the first): the same programs,
    the same outputs and KV write, padding rows included."""
    for heads, query_lens, context_lens in (((4, 4), [40, 17], [0, 30]), ((6, 2), [33, 20, 1], [50, 7, 12])):
        case = make_case(query_lens, context_lens, *heads, 16, 8, torch.float32, pad_tokens=3, seed=8)
        check_attention(case, None, config={**FORCE, "heads_first": 0}, fused=True)


@pytest.mark.parametrize("options", SOFTMAX_OPTIONS[1:])
def test_prefill_tma_lazy_rescale_follows_a_climbing_max(interpret, options):
    """Scores that climb by ~100 (log2) per key tile: the running max must move on every tile, or
    the weights against a stale max would overflow fp32 (2**128) into inf / NaN."""
    q, k, v, cache, md = make_case([64, 40], [0, 0], 6, 2, 16, 8, torch.float32, pad_tokens=2, seed=9)
    u = torch.randn(16, generator=torch.Generator().manual_seed(1))
    u = u / u.norm()
    scale_log2 = 16**-0.5 * 1.4426950408889634
    pos = torch.cat([torch.arange(64), torch.arange(40)])  # fresh prompts: positions from 0
    q[:104] = u * 8.0
    k[:104] = u * (pos.float() * 7.0 / (8.0 * scale_log2))[:, None, None]  # score = 7 * position (log2)
    out = check_attention((q, k, v, cache, md), None, config={**FORCE, **options}, fused=True)
    assert torch.isfinite(out).all()


def test_prefill_tma_reads_strided_k_v(interpret):
    """k/v as views of a fused q/k/v row (what the models pass), not contiguous tensors."""
    q, k, v, cache, md = make_case([24, 11], [0, 13], 4, 2, 16, 8, torch.float32, seed=5)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q2, k2, v2 = qkv.split([64, 32, 32], dim=1)
    views = (q2.view(q.shape), k2.view(k.shape), v2.view(v.shape))
    assert not views[1].is_contiguous()
    check_attention((*views, cache, md), None, config=FORCE, fused=True)


@pytest.mark.parametrize(
    ("platform", "expected"),
    [
        (Platform.mock("cuda", capability=(9, 0)), True),
        (Platform.mock("cuda", capability=(8, 0)), False),
        (Platform.mock("rocm"), False),
    ],
)
def test_dispatch_rule_is_shape_and_platform_only(monkeypatch, platform, expected):
    monkeypatch.setattr(_platform, "current_platform", lambda: platform)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    uses = prefill_tma.uses_prefill_tma
    assert uses(8 * 1024, 8, 128, cuda, bf16) is expected
    assert uses(8 * 1024, 8, 128, cuda, torch.float16) is expected
    assert uses(8 * 1024, 8, 128, cuda, torch.float32) is False  # fp32 caches keep the unified kernel
    mix = 32 * prefill_tma.MIN_AVERAGE_QUERY
    assert uses(mix - 1, 32, 128, cuda, bf16, group=6) is False  # a decode-heavy GQA mix: the unified kernel
    assert uses(mix, 32, 128, cuda, bf16, group=6) is expected
    assert uses(33, 32, 128, cuda, bf16) is expected  # MHA: one query of two tokens among decode rows is enough
    assert uses(64, 64, 128, cuda, bf16) is False  # all decode
    assert uses(4096, 1, 96, cuda, bf16) is False  # TMA blocks need a power-of-two head dim
    assert uses(4096, 1, 128, torch.device("cpu"), bf16) is False  # the interpreter only when forced
    assert uses(4096, 1, 128, cuda, bf16, {"prefill_tma": False}) is False


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(16, 16), (48, 8)])
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [([1024, 1024, 300], [0, 0, 0]), ([512, 700], [1000, 33]), ([1, 600, 1, 90], [900, 0, 4000, 70])],
)
def test_prefill_tma_gpu_matches_reference(dtype, heads, query_lens, context_lens):
    assert prefill_tma.uses_prefill_tma(sum(query_lens) + 7, len(query_lens), 128, torch.device("cuda"), dtype)
    case = make_case(query_lens, context_lens, *heads, 128, 16, dtype, pad_tokens=7, device="cuda", seed=1)
    check_attention(case, None, fused=True)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("options", SOFTMAX_OPTIONS[2:])
@pytest.mark.parametrize("heads", [(16, 16), (48, 8)])
def test_prefill_tma_gpu_softmax_options_match_reference(heads, options):
    case = make_case([1024, 300], [0, 700], *heads, 128, 16, torch.bfloat16, pad_tokens=3, device="cuda", seed=3)
    check_attention(case, None, config=options, fused=True)


@gpu
@pytest.mark.gpu
def test_prefill_tma_gpu_fp32_when_forced():
    case = make_case([300, 40], [0, 200], 16, 16, 128, 16, torch.float32, device="cuda", seed=2)
    check_attention(case, None, tol={"atol": 1e-4, "rtol": 1e-4}, config=FORCE, fused=True)
