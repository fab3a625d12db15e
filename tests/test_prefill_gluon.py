"""Causal prefill in Gluon (``kernels/prefill_gluon.py``, ``gluon_prefill``: on by default).

CPU: the kernel compiled offline for sm_90 (Triton's interpreter cannot run Gluon): no spills, no
``wgmma`` serialized by ptxas, two programs per SM; which caches it can read; the op's routing (the
whole batch to the Gluon launch unless ``gluon_prefill`` is 0) with a stand-in for the launch. GPU
(``-m gpu``, Hopper): the op's path against the torch reference, with the KV write, for fresh
prompts, chunks after a cached prefix, decode rows, GQA and MHA, lengths off the tiles and blocks,
cache blocks of 8-128 slots, a cache holding NaN outside the prefixes, and padding token rows.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_triton_kernels import check_attention, make_case

from rlt_compile.kernels import aot, prefill_gluon, prefill_tma
from rlt_compile.kernels.reference import kv_write_reference, paged_attention_reference
from rlt_compile.kernels.triton_attention import attention_forward
from rlt_compile.platform import Platform

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (run with -m gpu on the device)")
GLUON = {"prefill_tma": True, "gluon_prefill": 1}


def compile_sm90(
    num_heads: int, num_kv_heads: int, dtype=torch.bfloat16, head_dim: int = 128, tile=None
) -> aot.KernelReport:
    """The kernel as the op would launch it for 300 tokens of 3 sequences, compiled for sm_90 from meta
    tensors by ``aot.compile_specialisation`` (Gluon's AST source; with its SASS where the wheel has
    ``nvdisasm``)."""
    meta = torch.device("meta")
    q = torch.empty(300, num_heads, head_dim, dtype=dtype, device=meta)
    k = torch.empty(300, num_kv_heads, head_dim, dtype=dtype, device=meta)
    cache = torch.empty(2, 40, 16, num_kv_heads, head_dim, dtype=dtype, device=meta)
    seq_lens = torch.empty(3, dtype=torch.int32, device=meta)
    starts = torch.empty(4, dtype=torch.int32, device=meta)
    slots = torch.empty(300, dtype=torch.int64, device=meta)
    tables = torch.empty(3, 10, dtype=torch.int32, device=meta)
    kernel, grid, args, kwargs = prefill_gluon.gluon_prefill_launch(
        q, k, torch.empty_like(k), cache, tables, seq_lens, starts, torch.empty_like(q), head_dim**-0.5, slots, tile
    )
    name = f"{prefill_gluon.__name__}._gluon_prefill_kernel"
    spec = aot._bind(aot.Launch(name, kernel, args, kwargs, grid, "test"), aot.gpu_target("cuda", "sm_90"))
    report = aot.compile_specialisation(spec, "cuda", "sm_90", sass=aot.nvdisasm_path().exists())
    assert report.ok, report.error
    return report


@pytest.mark.parametrize(
    ("heads", "dtype"), [((16, 16), torch.bfloat16), ((48, 8), torch.bfloat16), ((8, 2), torch.float16)]
)
def test_compiles_for_sm90_without_spills(heads, dtype):
    """sm_90 (triton 3.6 as on the device; 114908 B): no spills, no wgmma serialized (ptxas C7514), two
    programs per SM, launched at 128 registers a thread (the warp group and the copy warp take two warp
    groups), then the warp group raised to 232 and the copy warp's group lowered to 24; in the key loop
    the tile's eight score wgmmas and the previous tile's four PV wgmmas issue back to back (only the V
    tile's barrier between them)."""
    report = compile_sm90(*heads, dtype)
    assert (report.spill_stores, report.spill_loads) == (0, 0), report
    assert report.n_regs == 128, report
    assert not any("C7514" in w for w in report.extra["ptxas_perf_warnings"]), report.extra
    assert report.shared + 1024 <= 228 * 1024 // 2, report.shared  # + the 1 KiB reserved per CTA
    if "sass" in report.extra:
        regs = re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP0, )?(0x[0-9a-f]+)", report.extra["sass"])
        assert {int(r, 16) for r in regs} == {24, 232}, regs
        ops = [
            m.group(1)
            for m in re.finditer(r"\s(HGMMA\.64x\d+x16|WARPGROUP\.DEPBAR|SYNCS\.PHASECHK)", report.extra["sass"])
        ]
        loop = ["HGMMA.64x64x16"] * 8 + ["SYNCS.PHASECHK"] + ["HGMMA.64x128x16"] * 4 + ["WARPGROUP.DEPBAR"]
        assert any(ops[i : i + len(loop)] == loop for i in range(len(ops))), ops


@pytest.mark.parametrize("head_dim", prefill_gluon.HEAD_DIMS)
def test_compiles_for_each_head_dim_it_takes(head_dim):
    """Every head dim the op sends to the kernel compiles for sm_90 at 128 registers, two programs per SM."""
    report = compile_sm90(16, 16, head_dim=head_dim)
    assert report.n_regs == 128, report
    assert report.shared + 1024 <= 228 * 1024 // 2, report.shared


@pytest.mark.parametrize(("head_dim", "dtype", "expected"), [(64, torch.bfloat16, True), (128, torch.float16, True),
                                                             (256, torch.bfloat16, False), (96, torch.bfloat16, False),
                                                             (128, torch.float32, False)])  # fmt: skip
def test_op_sends_only_the_head_dims_it_compiles_for(monkeypatch, head_dim, dtype, expected):
    """On a Hopper GPU the op takes the Gluon kernel for 16-bit head dims 64 and 128; 256 (ptxas runs out
    of registers at 128 a thread), Huginn's 96 and fp32 stay on the TMA kernel."""
    monkeypatch.setattr(prefill_tma._platform, "current_platform", lambda: Platform.mock("cuda", capability=(9, 0)))
    meta = torch.device("meta")
    q = torch.empty(64, 4, head_dim, dtype=dtype, device=meta)
    cache = torch.empty(2, 8, 16, 4, head_dim, dtype=dtype, device=meta)
    assert prefill_tma.uses_gluon_prefill(q, cache, interpret=False) is expected
    monkeypatch.setattr(prefill_tma._platform, "current_platform", lambda: Platform.mock("cuda", capability=(8, 0)))
    assert prefill_tma.uses_gluon_prefill(q, cache, interpret=False) is False


@pytest.mark.parametrize("stages", [2, 3])
def test_two_consumer_warp_groups_compile_for_sm90(stages):
    """128-row tiles: two consumer warp groups and the copy warp, launched at 168 registers a thread
    (three warp groups' worth of the SM's 64K at one program per SM), 240 each for the consumers after
    setmaxnreg; the shared memory fits one program per SM with 3 stages. (triton 3.6, the device's,
    compiles it without spills; later versions spill it, which only the device's numbers would show.)"""
    report = compile_sm90(48, 8, tile={"block_m": 128, "block_n": 128, "stages": stages})
    assert report.n_regs == 168, report
    assert report.shared + 1024 <= 228 * 1024, report.shared
    if "sass" in report.extra:
        regs = re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP0, )?(0x[0-9a-f]+)", report.extra["sass"])
        assert {24, 240} <= {int(r, 16) for r in regs}, regs


@pytest.mark.parametrize("block", [64, 128])
def test_dynamic_order_compiles_for_sm90_without_spills(block):
    """The persistent programs' dynamic order (the copy warp takes items from a global counter and hands
    them over in shared memory): no spills with one warp group (as the default); the 128-row tiles'
    registers and shared memory as without it (spills there show only on the device's triton)."""
    tile = {"persistent": 2, "dynamic": 1, "block_m": block, "block_n": block, "stages": 3 if block == 64 else 2}
    report = compile_sm90(48, 8, tile=tile)
    assert report.n_regs == (128 if block == 64 else 168), report
    if block == 64:
        assert (report.spill_stores, report.spill_loads) == (0, 0), report
        assert report.shared + 1024 <= 228 * 1024 // 2, report.shared
    else:
        assert report.shared + 1024 <= 228 * 1024, report.shared


def meta_launch(tokens: int, heads: int, kv_heads: int, cache=None, tile=None, head_dim: int = 64):
    """``gluon_prefill_launch`` for one sequence of ``tokens`` on meta tensors (by default head dim 64
    and a cache of 8 blocks of 16 slots)."""
    meta = torch.device("meta")
    q = torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16, device=meta)
    k = torch.empty(tokens, kv_heads, head_dim, dtype=torch.bfloat16, device=meta)
    if cache is None:
        cache = torch.empty(2, 8, 16, kv_heads, head_dim, dtype=torch.bfloat16, device=meta)
    lens = torch.empty(1, dtype=torch.int32, device=meta)
    tables = torch.empty(1, 4, dtype=torch.int32, device=meta)
    return prefill_gluon.gluon_prefill_launch(q, k, k, cache, tables, lens, lens, q, 0.1, tile=tile)


@pytest.mark.parametrize(
    ("tile", "message"),
    [
        ({"block_m": 128}, "block_m must equal block_n"),  # the KV write and the output use the last key tile
        ({"block_m": 96, "block_n": 96}, "one or two warp groups"),
        ({"warps": 8}, "one or two warp groups"),
    ],
)
def test_tiles_are_square_and_one_or_two_warp_groups(tile, message):
    with pytest.raises(ValueError, match=message):
        meta_launch(64, 4, 2, tile=tile)


@pytest.mark.parametrize(
    ("tokens", "seqs", "head_dim", "overrides", "expected"),
    [
        (4096, 1, 128, None, (128, 3, 1)),  # an average query of LONG_PROMPT_TOKENS: the long-prompt tile
        (16384, 2, 128, None, (128, 3, 1)),
        (4095, 1, 128, None, (64, 3, 2)),  # just below it: GLUON_TILE
        (8191, 2, 128, None, (64, 3, 2)),
        (8192, 1, 64, None, (64, 3, 2)),  # head dim 64: not timed with it
        (8192, 1, 128, {"block_m": 64, "block_n": 64}, (64, 3, 2)),  # a tile size named: GLUON_TILE under it
        (8192, 1, 128, {"stages": 2}, (128, 2, 1)),  # other overrides go over the long-prompt tile
    ],
)
def test_long_prompts_take_the_long_prompt_tile(tokens, seqs, head_dim, overrides, expected):
    """Batches whose queries average ``LONG_PROMPT_TOKENS`` or more take ``LONG_PROMPT_TILE`` (128-row
    tiles, three stages, one program per SM) unless a tile size is given; the rest keeps ``GLUON_TILE``."""
    tile = prefill_gluon.launch_tile(overrides, tokens, seqs, head_dim)
    assert (tile["block_m"], tile["stages"], tile["persistent"]) == expected
    assert tile["block_n"] == tile["block_m"] and tile["dynamic"] == prefill_gluon.GLUON_TILE["dynamic"]


def test_a_long_prompt_launches_one_two_warp_group_program_per_sm(monkeypatch):
    """The launch of one 4096-token prompt (head dim 128): 128-row tiles, three stages, a program per SM
    on the dynamic order."""
    monkeypatch.setattr(prefill_gluon, "sm_count", lambda device: 132)
    cache = torch.empty(2, 8, 16, 2, 128, dtype=torch.bfloat16, device="meta")
    _, grid, _, kwargs = meta_launch(4096, 16, 2, cache=cache, head_dim=128)
    assert (kwargs["BLOCK_M"], kwargs["STAGES"], kwargs["CONSUMERS"], kwargs["maxnreg"]) == (128, 3, 2, 168)
    assert grid == (132,) and kwargs["DYNAMIC"]
    _, grid, _, kwargs = meta_launch(4095, 16, 2, cache=cache, head_dim=128)
    assert (kwargs["BLOCK_M"], kwargs["STAGES"], grid) == (64, 3, (264,))


@pytest.mark.parametrize(("persistent", "sms", "programs"), [(0, 132, 12), (2, 132, 12), (2, 3, 6), (1, 1, 1)])
def test_persistent_grid(monkeypatch, persistent, sms, programs):
    """One program per work item ((query tile slots + sequences + the padding rows') x heads), or
    ``persistent`` programs per SM when that is fewer."""
    monkeypatch.setattr(prefill_gluon, "sm_count", lambda device: sms)
    _, grid, _, _ = meta_launch(64 * 4, 2, 1, tile={"persistent": persistent})
    assert grid == (programs,)


@pytest.mark.parametrize(
    ("persistent", "sms", "loop_items", "snake"), [(0, 3, 12, False), (2, 3, 12, True), (1, 5, 15, True)]
)
def test_snake_order_runs_whole_rounds(monkeypatch, persistent, sms, loop_items, snake):
    """With ``snake`` the persistent programs' loop runs whole rounds (12 items: 2 rounds of 6 programs,
    3 of 5), where a reversed round's item can lie past a program's own last index; one program per
    item has no rounds to reverse."""
    monkeypatch.setattr(prefill_gluon, "sm_count", lambda device: sms)
    _, grid, args, kwargs = meta_launch(64 * 4, 2, 1, tile={"persistent": persistent, "snake": 1, "dynamic": 0})
    assert args[16] == loop_items
    assert kwargs.get("SNAKE", False) is snake


@pytest.mark.parametrize(("persistent", "sms", "dynamic"), [(0, 3, False), (2, 3, True), (2, 132, False)])
def test_dynamic_order_takes_a_counter(monkeypatch, persistent, sms, dynamic):
    """``dynamic`` (with fewer programs than items) passes the device's counters and takes the place of
    the snake order; with one program per item neither has anything to balance."""
    monkeypatch.setattr(prefill_gluon, "sm_count", lambda device: sms)
    tile = {"persistent": persistent, "dynamic": 1, "snake": 1}
    _, grid, args, kwargs = meta_launch(64 * 4, 2, 1, tile=tile)
    assert kwargs.get("DYNAMIC", False) is dynamic
    assert "SNAKE" not in kwargs
    if dynamic:
        assert kwargs["counter_ptr"].shape == (2,) and kwargs["counter_ptr"].dtype == torch.int32
        assert args[16] == 12  # the items; the counter, not the loop index, ends the programs' loops


def test_counters_are_not_made_inside_a_capture(monkeypatch):
    """A first launch inside CUDA-graph capture gets no counters (a buffer made there would stay unzeroed
    until the graph's first replay) and none are kept; outside a capture they are made once and kept."""
    monkeypatch.setattr(prefill_gluon, "_COUNTERS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert prefill_gluon._counters(torch.device("cuda", 0)) is None
    assert prefill_gluon._COUNTERS == {}
    meta = torch.device("meta")  # never a capture: made, then the same buffer again
    assert prefill_gluon._counters(meta) is prefill_gluon._counters(meta)


def test_first_launch_inside_a_capture_takes_one_program_per_item(monkeypatch):
    """Without counters (``_counters`` None: a capture's first launch) the dynamic order falls back to one
    program per work item, which needs none."""
    monkeypatch.setattr(prefill_gluon, "sm_count", lambda device: 3)
    monkeypatch.setattr(prefill_gluon, "_counters", lambda device: None)
    _, grid, args, kwargs = meta_launch(64 * 4, 2, 1, tile={"persistent": 2, "dynamic": 1})
    assert grid == (12,) and args[16] == 12
    assert "DYNAMIC" not in kwargs and "counter_ptr" not in kwargs


SENTINEL = 7.0  # the output rows the Gluon launch's stand-in writes


@pytest.mark.parametrize(
    ("shape", "layout", "expected"),
    [
        ((2, 6, 16, 2, 64), "packed", True),
        ((2, 6, 128, 2, 64), "packed", True),
        ((2, 6, 8, 2, 64), "packed", True),
        ((2, 6, 4, 2, 64), "packed", False),  # a box narrower than the swizzle's 8-row period
        ((2, 6, 24, 2, 64), "packed", False),  # not a power of two
        ((2, 6, 16, 2, 64), "halves_interleaved", False),  # [blocks, 2, ...] storage: no 2D view of a half
    ],
)
def test_supports(shape, layout, expected):
    """The kernel reads a cache's prefix through one TMA descriptor per half: contiguous halves with
    blocks of 8+ slots, a power of two; otherwise the launch refuses it."""
    cache = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    if layout == "halves_interleaved":
        cache = torch.empty(shape[1], 2, *shape[2:], dtype=torch.bfloat16, device="meta").transpose(0, 1)
    assert prefill_gluon.supports(cache) is expected
    if not expected:
        with pytest.raises(ValueError, match="contiguous cache halves"):
            meta_launch(64, 4, 2, cache=cache)


def stand_in_gluon(monkeypatch) -> tuple[list[int], list[int]]:
    """Triton's interpreter for the TMA kernel, and the Gluon launch (which it cannot run) replaced by
    a stand-in that fills ``out`` with ``SENTINEL`` and does the reference's KV write. Returns the
    sequences of each Gluon launch and the TMA kernel's launches, filled in as the op runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(prefill_tma, "uses_gluon_prefill", lambda *args: True)
    gluon_launches, tma_launches = [], []

    def stand_in(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, out, scale, slot_mapping=None, tile=None):
        gluon_launches.append(seq_lens.shape[0])
        out.fill_(SENTINEL)
        kv_write_reference(k, v, kv_cache, slot_mapping)

    kernel_for = prefill_tma.kernel_for
    monkeypatch.setattr(prefill_gluon, "launch_gluon_prefill", stand_in)
    monkeypatch.setattr(prefill_tma, "kernel_for", lambda *a: tma_launches.append(1) or kernel_for(*a))
    return gluon_launches, tma_launches


@pytest.mark.parametrize(
    ("heads", "config", "expected"),
    [
        ((6, 2), {}, True),  # on unless set
        ((4, 4), {}, True),
        ((6, 2), {"gluon_prefill": 0}, False),
        ((4, 4), {"gluon_prefill": 1}, True),
    ],
)
def test_gluon_prefill_takes_whole_batches_unless_off(monkeypatch, heads, config, expected):
    """Unset, ``gluon_prefill`` sends a prefill batch (fresh prompts, a chunk after a cached prefix, a
    decode row, padding rows) of GQA and MHA models to one Gluon launch (its stand-in here), and no TMA
    kernel runs then; set to 0, the TMA kernel (Triton's interpreter) computes it all."""
    gluon_launches, tma_launches = stand_in_gluon(monkeypatch)
    query_lens, context_lens = [40, 17, 1, 23], [0, 30, 12, 0]
    q, k, v, cache, md = make_case(query_lens, context_lens, *heads, 16, 8, torch.float32, pad_tokens=3, seed=2)
    ref_cache = cache.clone()
    kv_write_reference(k, v, ref_cache, md.slot_mapping)
    meta = (md.block_tables, md.seq_lens, md.query_start_loc, 16**-0.5)
    out = attention_forward(q, k, v, cache, md.slot_mapping, *meta, config={"prefill_tma": True, **config})
    assert torch.equal(cache, ref_cache)
    if expected:
        assert gluon_launches == [4] and tma_launches == [] and (out == SENTINEL).all()
    else:
        assert gluon_launches == [] and tma_launches == [1]
        torch.testing.assert_close(out, paged_attention_reference(q, ref_cache, *meta), rtol=1e-5, atol=1e-5)


def count_gluon_launches(monkeypatch) -> list[int]:
    """Each Gluon launch appends 1 (the launch itself runs)."""
    launches = []
    launch = prefill_gluon.launch_gluon_prefill
    monkeypatch.setattr(prefill_gluon, "launch_gluon_prefill", lambda *a, **k: launches.append(1) or launch(*a, **k))
    return launches


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(16, 16), (48, 8)])
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [
        ([200, 64, 1000], [0, 0, 0]),  # fresh prompts, on and off the 64-row tiles
        ([130, 77, 1, 300], [0, 40, 99, 0]),  # fresh prompts beside chunks off the blocks and a decode row
        ([1, 1, 70], [5, 9, 0]),
        ([64, 200, 33], [128, 1024, 16]),  # prefixes of whole blocks, one of whole key tiles
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("persistent", "sms", "block", "snake"),
    [(0, None, 64, 0), (2, None, 64, 0), (3, 1, 64, 0), (2, None, 64, 1), (3, 1, 64, 1), (0, None, 128, 0),
     (3, 1, 128, 0), (3, 1, 128, 1), (2, None, 64, "dynamic"), (3, 1, 64, "dynamic"), (3, 1, 128, "dynamic")],
)  # fmt: skip
def test_gluon_prefill_matches_reference(
    monkeypatch, heads, query_lens, context_lens, dtype, persistent, sms, block, snake
):  # fmt: skip
    """One program per work item, ``persistent`` programs per SM, and three programs in all (``sms`` 1),
    each then serving dozens of items through the same ring of stages and query buffer, in stride or
    snake order or taking them from the counter (``dynamic``, whose counters must be back at zero after
    each launch); 64-row tiles (one consumer warp group) and 128-row tiles (two)."""
    monkeypatch.setitem(prefill_gluon.GLUON_TILE, "persistent", persistent)
    monkeypatch.setitem(prefill_gluon.GLUON_TILE, "snake", int(snake == 1))
    monkeypatch.setitem(prefill_gluon.GLUON_TILE, "dynamic", int(snake == "dynamic"))
    monkeypatch.setitem(prefill_gluon.GLUON_TILE, "block_m", block)
    monkeypatch.setitem(prefill_gluon.GLUON_TILE, "block_n", block)
    monkeypatch.setitem(prefill_gluon.GLUON_TILE, "stages", 3 if block == 64 else 2)
    if sms is not None:
        monkeypatch.setattr(prefill_gluon, "sm_count", lambda device: sms)
    launches = count_gluon_launches(monkeypatch)
    case = make_case(
        query_lens, context_lens, *heads, 128, 16, dtype, pad_tokens=7, device="cuda", seed=len(query_lens)
    )
    check_attention(case, None, config=GLUON, fused=True)
    assert launches == [1]
    if snake == "dynamic":  # the counters back at zero, and a second launch from them as right as the first
        assert [c.tolist() for c in prefill_gluon._COUNTERS.values() if c.is_cuda] == [[0, 0]]
        check_attention(case, None, config=GLUON, fused=True)
        assert [c.tolist() for c in prefill_gluon._COUNTERS.values() if c.is_cuda] == [[0, 0]]


@hopper
@pytest.mark.gpu
def test_first_launch_inside_a_cuda_graph_capture(monkeypatch):
    """No counters on the device yet when a graph captures the op: the captured launch takes one program
    per item, its replays match the reference, and the dynamic order starts at the next eager launch."""
    monkeypatch.setattr(prefill_gluon, "_COUNTERS", {})
    case = make_case([300, 77], [0, 40], 48, 8, 128, 16, torch.bfloat16, device="cuda")
    q, k, v, cache, md = case
    meta = (md.block_tables, md.seq_lens, md.query_start_loc, 128**-0.5)
    ref_cache = cache.clone()
    kv_write_reference(k, v, ref_cache, md.slot_mapping)
    ref = paged_attention_reference(q, ref_cache, *meta)
    # the kernel the capture launches, compiled and loaded outside it (no counters made: one program per item)
    attention_forward(q, k, v, cache.clone(), md.slot_mapping, *meta, config={**GLUON, "gluon_persistent": 0})
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = attention_forward(q, k, v, cache, md.slot_mapping, *meta, config=GLUON)
    assert prefill_gluon._COUNTERS == {}
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
    eager = attention_forward(q, k, v, cache, md.slot_mapping, *meta, config=GLUON)
    assert [c.tolist() for c in prefill_gluon._COUNTERS.values()] == [[0, 0]]
    torch.testing.assert_close(eager.float(), ref.float(), rtol=2e-2, atol=2e-2)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(16, 16), (48, 8)])
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [([4500, 3800], [0, 300]), ([4300, 4000], [0, 2001])],  # prompts, a chunk after a prefix off the blocks
)
def test_long_prompts_match_reference_on_the_long_prompt_tile(monkeypatch, heads, query_lens, context_lens):
    """Queries averaging ``LONG_PROMPT_TOKENS`` or more, through the op on its default tile: the launch
    takes the long-prompt tile and matches the reference, the KV write included."""
    tiles = []
    launch = prefill_gluon.gluon_prefill_launch

    def spy(*args, **kwargs):
        kernel, grid, launch_args, launch_kwargs = launch(*args, **kwargs)
        tiles.append((launch_kwargs["BLOCK_M"], launch_kwargs["STAGES"]))
        return kernel, grid, launch_args, launch_kwargs

    monkeypatch.setattr(prefill_gluon, "gluon_prefill_launch", spy)
    case = make_case(query_lens, context_lens, *heads, 128, 16, torch.bfloat16, device="cuda", seed=len(query_lens))
    check_attention(case, None, config=GLUON, fused=True)
    assert tiles == [(128, 3)]


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("config", [{}, {"gluon_block": 128, "gluon_stages": 3}])
def test_block_sizes_with_nan_outside_the_prefixes(monkeypatch, block_size, config):
    """Prefix boxes of one cache block (8-32 slots) or of one key tile (128-slot blocks), prefixes
    ending inside a box, on a box's edge and on a key tile's; every cache slot outside the prefixes
    holds NaN, which must not reach an output (a partial key tile's value rows are zeroed)."""
    launches = count_gluon_launches(monkeypatch)
    query_lens, context_lens = [33, 100, 1, 64, 5], [40, 128, 77, 0, 8]
    q, k, v, cache, md = make_case(query_lens, context_lens, 48, 8, 128, block_size, torch.bfloat16, device="cuda")
    prefix = torch.zeros(cache.shape[1] * block_size, dtype=torch.bool, device="cuda")
    for seq, ctx in enumerate(context_lens):
        pos = torch.arange(ctx, device="cuda")
        prefix[md.block_tables[seq, pos // block_size].long() * block_size + pos % block_size] = True
    cache.view(2, -1, *cache.shape[3:])[:, ~prefix] = float("nan")
    ref_cache = cache.clone()
    kv_write_reference(k, v, ref_cache, md.slot_mapping)
    meta = (md.block_tables, md.seq_lens, md.query_start_loc, 128**-0.5)
    out = attention_forward(q, k, v, cache, md.slot_mapping, *meta, config={**GLUON, **config})
    assert launches == [1]
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0, equal_nan=True)
    ref = paged_attention_reference(q, ref_cache, *meta)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@hopper
@pytest.mark.gpu
def test_on_by_default_off_for_fp32_and_small_blocks(monkeypatch):
    """``gluon_prefill`` unset: GQA and MHA batches take the Gluon kernel; an fp32 batch (forced onto the
    TMA kernel) and a cache of 4-slot blocks never do; launches counted, outputs checked."""
    launches = count_gluon_launches(monkeypatch)
    case = make_case([100], [0], 4, 4, 128, 16, torch.bfloat16, device="cuda")
    check_attention(case, None, config={"prefill_tma": True}, fused=True)
    assert launches == [1]
    case = make_case([100], [0], 4, 4, 64, 16, torch.float32, device="cuda")
    check_attention(case, None, config=GLUON, fused=True)
    case = make_case([100, 37], [0, 20], 12, 4, 128, 4, torch.bfloat16, device="cuda")
    check_attention(case, None, config=GLUON, fused=True)
    assert launches == [1]
    case = make_case([100, 37], [0, 20], 12, 4, 128, 16, torch.bfloat16, device="cuda")
    check_attention(case, None, config={"prefill_tma": True}, fused=True)
    assert launches == [1, 1]
