"""L2 prefetch of later weights by the decode GEMVs: the plan, the ``prefetch_weights`` pass, the kernel.

CPU: ``plan_l2_prefetch`` asks for every byte of the weight stream after the first weight exactly
once and never more than ``lookahead`` past the asking GEMV's own weight (with ``wrap``, the first
weight too); the GEMV launcher's range checks; the pass on the loop step of tiny models of every
family (mock CUDA platform with PDL) gives the GEMV ops ranges that follow the plan and leaves the
results bit-identical, and stays off where the GEMV cannot prefetch. GPU (``-m gpu``): the kernel
with prefetch ranges (and ``evict_first``) gives the same bits as without, also inside a CUDA graph.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from test_pass_snapshots import capture
from test_passes import loop_step_inputs, tiny_model

from rlt_compile.kernels import gemv
from rlt_compile.passes.manager import PassContext, PassManager, build_passes
from rlt_compile.passes.prefetch_weights import plan_l2_prefetch
from rlt_compile.platform import Platform

_DEFAULT = ["attention_swap", "fuse_linears", "fuse_rmsnorm", "gemv_swap", "fuse_rope_gemv", "fuse_swiglu_gemv"]
_GEMV_OPS = ("linear_small", "rope_linear_small", "swiglu_linear_small", "silu_mul_linear_small")


@pytest.fixture
def pdl(monkeypatch):
    monkeypatch.setattr("rlt_compile.platform.triton_supports_pdl", lambda: True)
    monkeypatch.delenv("RLT_PDL", raising=False)
    monkeypatch.delenv("RLT_L2_PREFETCH_MB", raising=False)


def _asked(sizes, plan):
    """Per GEMV, the set of stream positions (virtual, past the end for wrapped ones) it asks for."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [[(starts[j] + start, starts[j] + start + n) for j, start, n in ranges] for ranges in plan]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("wrap", [False, True])
@pytest.mark.parametrize("max_ranges", [2, 100])
def test_plan_asks_for_each_later_byte_once_within_the_lookahead(seed, wrap, max_ranges):
    rng = random.Random(seed)
    sizes = [rng.randrange(1, 50) * 16 for _ in range(rng.randrange(2, 12))]
    lookahead = rng.randrange(1, 120) * 16
    plan = plan_l2_prefetch(sizes, lookahead, wrap=wrap, max_ranges=max_ranges)
    total, starts = sum(sizes), [sum(sizes[:i]) for i in range(len(sizes))]
    counts = [0] * total
    for i, ranges in enumerate(plan):
        assert len(ranges) <= max_ranges
        end = starts[i] + sizes[i]
        pos = None
        for j, start, n in ranges:
            assert n > 0 and start >= 0 and start + n <= sizes[j]
            for b in range(starts[j] + start, starts[j] + start + n):
                counts[b] += 1
            virtual = starts[j] + start + (total if starts[j] + start < end else 0)
            assert pos is None or virtual == pos  # one run of the stream, in order
            assert end <= virtual and virtual + n <= end + lookahead
            pos = virtual + n
    assert all(c <= 1 for c in counts), "no byte twice"
    if not wrap:
        assert counts[: sizes[0]] == [0] * sizes[0], "nothing before the first GEMV asks for its weight"
    if max_ranges < len(sizes) or lookahead < max(sizes):
        # cut windows: later GEMVs go on from where the cut left off, the tail may stay unasked;
        # a short lookahead leaves the part of a weight its own GEMV reaches first to that GEMV
        return
    assert all(c == 1 for c in counts[sizes[0] :]), "every byte after the first weight once"
    if wrap and lookahead >= sizes[0]:
        assert all(c == 1 for c in counts[: sizes[0]]), "the loop's next step: its first weight"


def test_plan_small_cases():
    assert plan_l2_prefetch([64, 64, 64], 0) == [[], [], []]
    assert plan_l2_prefetch([64], 1 << 20, wrap=True) == [[]]
    # a lookahead shorter than a weight: each GEMV asks for the head of the next one only
    assert plan_l2_prefetch([32, 32, 32], 16) == [[(1, 0, 16)], [(2, 0, 16)], []]
    # wrapped: the last GEMV asks for the first weight; a long lookahead spans two weights at once
    assert plan_l2_prefetch([32, 32, 32], 48, wrap=True) == [
        [(1, 0, 32), (2, 0, 16)],
        [(2, 16, 16), (0, 0, 16)],
        [(0, 16, 16)],
    ]


def test_launcher_checks_and_aligns_ranges():
    w = torch.empty(64, dtype=torch.bfloat16)  # 128 bytes
    base = w.data_ptr()
    flat = gemv._prefetch_args([(w, 3, 100)], enabled=True)
    assert len(flat) == 2 * gemv.L2_PREFETCH_RANGES
    lo, n = flat[:2]
    assert lo % 16 == 0 and n % 16 == 0 and base + 3 <= lo and lo + n <= base + 103
    assert gemv._prefetch_args([(w, 0, 128)], enabled=False) == [0] * (2 * gemv.L2_PREFETCH_RANGES)
    with pytest.raises(ValueError, match="outside a tensor of 128 bytes"):
        gemv._prefetch_args([(w, 64, 65)], enabled=True)
    with pytest.raises(ValueError, match="at most"):
        gemv._prefetch_args([(w, 0, 16)] * (gemv.L2_PREFETCH_RANGES + 1), enabled=True)
    with pytest.raises(ValueError, match="a \\(start, length\\) pair per prefetch tensor"):
        torch.ops.rlt.linear_small(torch.randn(1, 8), torch.randn(8, 8), [w], [0])


def test_prefetch_is_a_hint_off_hopper():
    x = torch.randn(1, 16)
    w = torch.randn(8, 16)
    assert not gemv.supports_l2_prefetch(x)
    assert torch.equal(torch.ops.rlt.linear_small(x, w, [w], [0, 64]), torch.ops.rlt.linear_small(x, w))


def _run(captured, passes, unit="loop_step", platform=None):
    gm, inputs = copy.deepcopy(captured[0]), captured[1]
    ctx = PassContext(platform or Platform.mock("cuda"), unit=unit, example_inputs=inputs)
    records = PassManager(build_passes(passes)).run(gm, ctx)
    inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    return gm, {r.pass_name: r.message for r in records}, gm(*inputs)


def _gemvs(gm):
    names = {f"rlt.{op}.default" for op in _GEMV_OPS}
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in names]


@pytest.mark.parametrize("family", ["ouro", "nanbeige", "huginn"])
def test_pass_gives_the_gemvs_the_plan_and_changes_no_bits(pdl, monkeypatch, family):
    model = tiny_model(family, torch.bfloat16)
    captured = capture(model.loop_step, *loop_step_inputs(model, 1, torch.bfloat16))
    _, _, expected = _run(captured, _DEFAULT)
    monkeypatch.setenv("RLT_L2_PREFETCH_MB", "1")
    gm, log, got = _run(captured, [*_DEFAULT, "prefetch_weights"])
    assert torch.equal(got[0], expected[0])
    gemvs = _gemvs(gm)
    weights = [n.args[1] for n in gemvs]
    sizes = [n.args[1].meta["example_value"].numel() * 2 for n in gemvs]
    plan = plan_l2_prefetch(sizes, 1 << 20, wrap=True)
    assert len(gemvs) >= 4 and "GEMVs prefetch later weights into L2" in log["prefetch_weights"]
    def same(a, b):  # the same input, or a fetch of the same attribute
        return a is b or (a.op == b.op == "get_attr" and a.target == b.target)

    for node, ranges in zip(gemvs, plan):
        asked = node.kwargs.get("prefetch", [])
        assert len(asked) == len(ranges) and all(same(a, weights[j]) for a, (j, _, _) in zip(asked, ranges))
        assert node.kwargs.get("prefetch_ranges", []) == [v for _, s, n in ranges for v in (s, n)]
    # the tiny models' weights fit in 1 MiB: every GEMV's later weights and, wrapped, the first one
    assert sum(n for r in plan for _, _, n in r) == sum(sizes)


def test_pass_is_off_where_the_gemv_cannot_prefetch(pdl, monkeypatch):
    model = tiny_model("ouro", torch.bfloat16)
    captured = capture(model.loop_step, *loop_step_inputs(model, 1, torch.bfloat16))
    passes = [*_DEFAULT, "prefetch_weights"]
    assert "prefetch_weights" not in _run(captured, passes, platform=Platform.mock("rocm"))[1]
    assert "prefetch_weights" not in _run(captured, passes, platform=Platform.mock("cuda", capability=(8, 0)))[1]
    monkeypatch.setenv("RLT_L2_PREFETCH_MB", "0")
    assert "prefetch_weights" not in _run(captured, passes)[1]
    monkeypatch.setenv("RLT_L2_PREFETCH_MB", "lots")
    with pytest.raises(ValueError, match="RLT_L2_PREFETCH_MB must be a non-negative integer"):
        _run(captured, passes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("evict_first", [False, True])
@pytest.mark.parametrize("pf_programs", [0, 8])
def test_gpu_prefetching_gemvs_give_the_same_bits(evict_first, pf_programs):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(6144, 2048, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    later = torch.randn(11264, 2048, device="cuda", dtype=torch.bfloat16, generator=gen)
    ranges = [(later, 0, 8 << 20), (later, 8 << 20, 1 << 20), (w, 4096, 12345)]
    cfg = {"evict_first": evict_first, "pf_programs": pf_programs}
    assert gemv.supports_l2_prefetch(x) == (torch.cuda.get_device_capability()[0] >= 9)
    for kwargs in ({}, {"swiglu": True}):
        want = gemv.linear_gemv(x, w, **kwargs)
        got = gemv.linear_gemv(x, w, cfg, prefetch=ranges, **kwargs)
        assert torch.equal(got, want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = gemv.linear_gemv(x, w, cfg, prefetch=ranges, **kwargs)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, want)
    op = torch.ops.rlt.linear_small(x, w, [later, w], [0, 1 << 20, 0, 4096])
    assert torch.equal(op, gemv.linear_gemv(x, w))
