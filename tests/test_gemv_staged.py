"""The decode GEMV with TMA-staged weights (``kernels/gemv_staged.py``).

CPU: the kernel compiled offline for sm_90 from meta tensors (Triton's interpreter cannot run Gluon):
no spills, the ring within shared memory, the PDL wait after the weight copies. GPU (``-m gpu``,
Hopper): against ``F.linear`` in fp32 on the same 16-bit inputs, for the Ouro decode shapes, rows
and keys off the tile, every tile and ring option, two GEMVs chained through PDL (the second reads
the first's output only after its wait) and replayed in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from rlt_compile.kernels import aot, gemv, gemv_staged

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (run with -m gpu on the device)")


def compile_sm90(n: int, k: int, config=None, swiglu=False) -> aot.KernelReport:
    records = []
    weight = torch.empty(n, k, dtype=torch.bfloat16, device="meta")
    x = torch.empty(1, k, dtype=torch.bfloat16, device="meta")
    saved = gemv_staged.sm_count
    gemv_staged.sm_count = lambda device: 132
    try:
        with aot._recording(records, "staged"):
            gemv_staged.linear_staged(x, weight, config, swiglu=swiglu, pdl=2)
    finally:
        gemv_staged.sm_count = saved
    target = aot.gpu_target("cuda", "sm_90")
    return aot.compile_specialisation(aot._bind(records[0], target), "cuda", "sm_90", target=target, sass=True)


@pytest.mark.parametrize(
    "n,k,config,swiglu",
    [
        (2048, 2048, None, False),
        (2048, 5632, None, False),
        (11264, 2048, None, True),
        (11264, 2048, {"warps": 8}, True),
    ],
)
def test_compiles_for_sm90(n, k, config, swiglu):
    report = compile_sm90(n, k, config, swiglu)
    assert report.ok, report.error
    assert report.n_spills == 0
    assert report.shared <= 227 * 1024
    if "memory_order" in report.extra:  # the weights go by TMA before the wait; x, then y, after it
        order = report.extra["memory_order"]
        assert order.index("WAIT") < order.index("LDG") < order.index("STG"), order


def test_plan_fits_the_ring_into_shared_memory_and_covers_every_output():
    for n, k in [(6144, 2048), (2048, 2048), (11264, 2048), (5632, 2048), (2048, 5632), (8, 64)]:
        for per_sm in (1, 2):
            plan = gemv_staged.staged_plan(n, k, 132, {"programs_per_sm": per_sm})
            ring = plan["stages"] * plan["block_n"] * plan["block_k"] * 2
            x_rows = triton.next_power_of_2(plan["kb"]) * plan["block_k"] * 2
            assert (ring + x_rows) * per_sm <= gemv_staged._SMEM_BUDGET
            if plan["balanced"]:  # an equal share of the tiles for every program
                assert plan["grid"] == 132 * per_sm
            else:  # whole blocks: every output covered, no empty program
                assert plan["grid"] * plan["blocks_per_program"] * plan["block_n"] >= n
                assert (plan["grid"] - 1) * plan["blocks_per_program"] * plan["block_n"] < n
                assert plan["grid"] <= 132 * per_sm


def test_plan_picks_the_block_that_evens_out_the_programs():
    # balanced (the default): the tallest block that leaves every program at least a block's tiles
    plan = gemv_staged.staged_plan(5632, 2048, 132, swiglu=True)  # Ouro's gate/up pair
    assert (plan["block_n"], plan["balanced"], plan["grid"]) == (32, True, 132)
    assert gemv_staged.staged_plan(2048, 2048, 132)["block_n"] == 8  # 256 blocks of 8 rows, 128 of 16
    assert not gemv_staged.staged_plan(8, 64, 132)["balanced"]  # one block: one program
    # whole blocks: 5632 outputs on 132 SMs (42.7 rows each at best); 32-row blocks leave the busiest program
    # 64 rows, 16- and 8-row blocks 48, so 16 (the larger of the two)
    whole = {"balanced": 0}
    assert gemv_staged.staged_plan(5632, 2048, 132, whole, swiglu=True)["block_n"] == 16
    assert gemv_staged.staged_plan(11264, 2048, 132, whole)["block_n"] == 8  # 88 rows, against 96 with 16 or 32
    assert gemv_staged.staged_plan(11264, 2048, 132, {"block_n": 16})["block_n"] == 16


def test_balanced_ranges_leave_no_block_to_three_programs():
    for n, k, swiglu in [(5632, 2048, True), (2048, 5632, False), (6144, 2048, False), (2048, 2048, False)]:
        plan = gemv_staged.staged_plan(n, k, 132, swiglu=swiglu)
        tiles_per_block = plan["kb"] * (2 if swiglu else 1)
        total = triton.cdiv(n, plan["block_n"]) * tiles_per_block
        ranges = [(p * total // plan["grid"], (p + 1) * total // plan["grid"]) for p in range(plan["grid"])]
        assert plan["balanced"] and all(hi - lo >= tiles_per_block for lo, hi in ranges)
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def _check(x, weight, config=None, swiglu=False):
    got = gemv_staged.linear_staged(x, weight, config, swiglu=swiglu)
    want = F.linear(x.float(), weight.float())
    if swiglu:  # the Triton epilogue's rounding: gate and up rounded, SiLU rounded, the product rounded
        gate, up = want.to(x.dtype).chunk(2, dim=-1)
        want = (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype).float()
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    return got


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("n,k", [(6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (1000, 576), (8, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("swiglu", [False, True])
def test_matches_linear(n, k, dtype, swiglu):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    weight = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) * k**-0.5
    x = torch.randn(1, k, device="cuda", dtype=dtype, generator=g)
    _check(x, weight, swiglu=swiglu)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(
    "config",
    [{"stages": 2}, {"stages": 7}, {"block_n": 32}, {"block_n": 16, "block_k": 128}, {"block_n": 8, "block_k": 64},
     {"programs_per_sm": 2}, {"programs_per_sm": 3, "warps": 8}, {"warps": 8}, {"warps": 4, "stages": 3},
     {"balanced": 0}, {"balanced": 0, "block_n": 8}],
)  # fmt: skip
@pytest.mark.parametrize("swiglu", [False, True])
def test_options_match_linear(config, swiglu):
    g = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.randn(3000, 2048, device="cuda", dtype=torch.bfloat16, generator=g) * 2048**-0.5
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    _check(x, weight, config, swiglu)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("swiglu", [False, True])
def test_gemv_config_staged_routes_through_it(monkeypatch, swiglu):
    """``RLT_GEMV_CONFIG=staged=1``: ``linear_gemv`` (what the decode ops call) runs the staged kernel,
    with the same result as a direct call."""
    g = torch.Generator(device="cuda").manual_seed(3)
    weight = torch.randn(5632, 2048, device="cuda", dtype=torch.bfloat16, generator=g) * 2048**-0.5
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    calls = []
    real = gemv_staged.linear_staged
    monkeypatch.setattr(gemv_staged, "linear_staged", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setenv("RLT_GEMV_CONFIG", "staged=1")
    got = gemv.linear_gemv(x, weight, swiglu=swiglu)
    assert calls == [{"swiglu": swiglu}]
    assert torch.equal(got, real(x, weight, swiglu=swiglu))
    monkeypatch.setenv("RLT_GEMV_CONFIG", "staged=1")
    gemv.linear_gemv(x, weight, rope=None, config={"staged": 0}, swiglu=swiglu)
    assert len(calls) == 1  # staged=0 in the call's config wins


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("config", [None, {"warps": 8}, {"balanced": 0}])
def test_chain_through_pdl_and_graph_replays(config):
    g = torch.Generator(device="cuda").manual_seed(2)
    w1 = torch.randn(5632, 2048, device="cuda", dtype=torch.bfloat16, generator=g) * 2048**-0.5
    w2 = torch.randn(2048, 5632, device="cuda", dtype=torch.bfloat16, generator=g) * 5632**-0.5
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16, generator=g)

    def chain():
        h = x
        for _ in range(4):
            h = gemv_staged.linear_staged(gemv_staged.linear_staged(h, w1, config), w2, config)
        return h

    want = x.float()
    for _ in range(4):
        want = F.linear(F.linear(want, w1.float()).bfloat16().float(), w2.float()).bfloat16().float()
    eager = chain()
    torch.testing.assert_close(eager.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    chain()  # warm, then capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
