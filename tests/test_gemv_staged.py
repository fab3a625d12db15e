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

from rlt_compile.kernels import aot, gemv_staged

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (run with -m gpu on the device)")


def compile_sm90(n: int, k: int, config=None) -> aot.KernelReport:
    records = []
    weight = torch.empty(n, k, dtype=torch.bfloat16, device="meta")
    x = torch.empty(1, k, dtype=torch.bfloat16, device="meta")
    saved = gemv_staged.sm_count
    gemv_staged.sm_count = lambda device: 132
    try:
        with aot._recording(records, "staged"):
            gemv_staged.linear_staged(x, weight, config, pdl=2)
    finally:
        gemv_staged.sm_count = saved
    target = aot.gpu_target("cuda", "sm_90")
    return aot.compile_specialisation(aot._bind(records[0], target), "cuda", "sm_90", target=target, sass=True)


@pytest.mark.parametrize("n,k,config", [(2048, 2048, None), (2048, 5632, None), (11264, 2048, {"ws": 1})])
def test_compiles_for_sm90(n, k, config):
    report = compile_sm90(n, k, config)
    assert report.ok, report.error
    assert report.n_spills == 0
    assert report.shared <= 227 * 1024
    if "memory_order" in report.extra:  # the weights go by TMA before the wait; x, then y, after it
        order = report.extra["memory_order"]
        assert order.index("WAIT") < order.index("LDG") < order.index("STG"), order


def test_plan_fits_the_ring_into_shared_memory():
    for n, k in [(6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]:
        for per_sm in (1, 2):
            plan = gemv_staged.staged_plan(n, k, 132, {"programs_per_sm": per_sm})
            ring = plan["stages"] * plan["block_n"] * plan["block_k"] * 2
            assert ring * per_sm <= gemv_staged._SMEM_BUDGET
            assert plan["grid"] * plan["rb_per_program"] * plan["block_n"] >= n
            assert plan["grid"] <= 132 * per_sm


def _check(x, weight, config=None):
    got = gemv_staged.linear_staged(x, weight, config)
    want = F.linear(x.float(), weight.float())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    return got


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("n,k", [(6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (1000, 576), (8, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_linear(n, k, dtype):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    weight = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) * k**-0.5
    x = torch.randn(1, k, device="cuda", dtype=dtype, generator=g)
    _check(x, weight)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(
    "config",
    [{"stages": 2}, {"stages": 7}, {"block_n": 32}, {"block_k": 256}, {"block_n": 8, "block_k": 64},
     {"programs_per_sm": 2}, {"programs_per_sm": 3, "warps": 8}, {"ws": 1}, {"ws": 1, "stages": 3},
     {"ws": 1, "block_k": 256, "programs_per_sm": 2}],
)  # fmt: skip
def test_options_match_linear(config):
    g = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.randn(3000, 2048, device="cuda", dtype=torch.bfloat16, generator=g) * 2048**-0.5
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    _check(x, weight, config)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("config", [None, {"ws": 1}])
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
