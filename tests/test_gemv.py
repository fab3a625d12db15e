"""The prefetching decode GEMV (``kernels/gemv.py``), its custom op and the ``gemv_swap`` pass.

CPU: the kernel under Triton's interpreter against ``x @ W.T`` (one row without ``tl.dot``, several
rows with it, shapes that cross the tile edges, with and without the prefetched first tile), the
op's fallbacks, the pass's platform gating and rewrite. GPU (``-m gpu``): bf16/fp16 parity with
``F.linear`` at the real Ouro shapes, inside a CUDA graph with PDL.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from rlt_compile.kernels import gemv
from rlt_compile.passes.gemv_swap import GemvSwapPass
from rlt_compile.passes.manager import PassContext, PassManager
from rlt_compile.platform import Platform

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])  # one row without tl.dot, more through its tile
@pytest.mark.parametrize(("n", "k"), [(40, 70), (64, 128), (17, 33)])
@pytest.mark.parametrize("prefetch", [True, False])
def test_gemv_matches_matmul(interpret, rows, n, k, prefetch):
    gen = torch.Generator().manual_seed(rows * 1000 + n * 10 + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    y = gemv.linear_gemv(x, w, {"prefetch": prefetch})
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.fixture
def launches(monkeypatch):
    """The keyword arguments of every GEMV kernel launch (the launches still run)."""
    seen = []
    kernel_for = gemv.kernel_for

    def recording(fn, interpreted):
        grid_launcher = kernel_for(fn, interpreted)

        class Recorder:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    seen.append(kwargs)
                    return grid_launcher[grid](*args, **kwargs)

                return launch

        return Recorder()

    monkeypatch.setattr(gemv, "kernel_for", recording)
    return seen


@pytest.mark.parametrize(("n", "k"), [(40, 70), (17, 33), (64, 128)])
@pytest.mark.parametrize("prefetch", [True, False])
def test_one_row_gemv_summed_once_after_its_loop(interpret, launches, n, k, prefetch):
    """``acc_2d``: per-lane fp32 products over the whole row, reduced once; also with the SiLU
    prologue and the SwiGLU epilogue (more rows keep the tl.dot tile: the option is ignored there)."""
    gen = torch.Generator().manual_seed(n * 10 + k)
    x = torch.randn(1, 2 * k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    cfg = {"prefetch": prefetch, "acc_2d": True}
    torch.testing.assert_close(gemv.linear_gemv(x[:, :k], w, cfg), x[:, :k] @ w.T, rtol=1e-5, atol=1e-5)
    gate, up = x.chunk(2, dim=-1)
    want = (F.silu(gate) * up) @ w.T
    torch.testing.assert_close(gemv.linear_gemv(x, w, cfg, silu_mul=True), want, rtol=1e-5, atol=1e-5)
    gu = torch.cat([w, w.flip(0)])  # a gate/up pair
    y = gemv.linear_gemv(x[:, :k], gu, {**cfg, "block_n": 2}, swiglu=True)
    g, u = (x[:, :k] @ gu.T).chunk(2, dim=-1)
    torch.testing.assert_close(y, F.silu(g) * u, rtol=1e-5, atol=1e-5)
    rows = torch.randn(3, k, generator=gen)
    torch.testing.assert_close(gemv.linear_gemv(rows, w, cfg), rows @ w.T, rtol=1e-5, atol=1e-5)
    assert [launch["ACC_2D"] for launch in launches] == [True, True, True, False]


def test_rlt_gemv_config_sets_the_defaults_under_a_callers_config(interpret, launches, monkeypatch):
    x, w = torch.randn(1, 40), torch.randn(8, 40)
    monkeypatch.setenv("RLT_GEMV_CONFIG", "acc_2d=1, block_k=16")
    torch.testing.assert_close(gemv.linear_gemv(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemv.linear_gemv(x, w, {"acc_2d": False}), x @ w.T, rtol=1e-5, atol=1e-5)
    assert [(launch["ACC_2D"], launch["BLOCK_K"]) for launch in launches] == [(True, 16), (False, 16)]
    monkeypatch.setenv("RLT_GEMV_CONFIG", "only_n=8, only_k=40, block_k=32")  # one weight shape only
    w2 = torch.randn(8, 24)
    torch.testing.assert_close(gemv.linear_gemv(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemv.linear_gemv(x[:, :24], w2), x[:, :24] @ w2.T, rtol=1e-5, atol=1e-5)
    assert [launch["BLOCK_K"] for launch in launches[2:]] == [
        32,
        gemv.gemv_config(1, 8, 24, w.dtype, x.device)["block_k"],
    ]
    monkeypatch.setenv("RLT_GEMV_CONFIG", "only_n=8, only_k=24, block_k=16; only_n=8, only_k=40, block_k=64")
    launches.clear()  # one entry per weight shape, the first that matches
    gemv.linear_gemv(x, w), gemv.linear_gemv(x[:, :24], w2)
    assert [launch["BLOCK_K"] for launch in launches] == [64, 16]
    monkeypatch.setenv("RLT_GEMV_CONFIG", "only_n=8, block_k=16; acc2d=1")
    with pytest.raises(ValueError, match="unknown GEMV config keys"):
        gemv.linear_gemv(x, w)
    monkeypatch.delenv("RLT_GEMV_CONFIG")
    with pytest.raises(ValueError, match="unknown GEMV config keys"):
        gemv.linear_gemv(x, w, {"only_n": 8})  # a caller's config names its own tiles
    monkeypatch.setenv("RLT_GEMV_CONFIG", "acc_2d")
    with pytest.raises(ValueError, match="RLT_GEMV_CONFIG must be key=int"):
        gemv.linear_gemv(x, w)


def test_one_row_tiles_follow_the_weight_row_length(monkeypatch):
    """2-column programs of 4 warps; 1024-long runs of the weight row, 2048-long from rows of 4096 on
    unless that splits a grid resident at once (16 programs per SM) into two waves (10 per SM). A
    2-column grid that fills at most half the resident programs: 4 columns, 2048-long runs (at most
    the row; 4096-long for rows over 4096), 8 warps."""
    monkeypatch.setattr(gemv, "sm_count", lambda device: 132)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    cases = [
        (2048, 2048, 4, 2048, 8),  # Ouro's o: 1024 programs, under half of 16 x 132
        (2112, 2048, 4, 2048, 8),  # 1056: exactly half
        (2176, 2048, 2, 1024, 4),  # 1088: more than half
        (6144, 2048, 2, 1024, 4),  # Ouro's q/k/v
        (6144, 4096, 2, 2048, 4),
        (2048, 3072, 4, 2048, 8),  # 1024 programs: wide tiles whatever the row length
        (2048, 4096, 4, 2048, 8),
        (2048, 4097, 4, 4096, 8),
        (2048, 5632, 4, 4096, 8),  # Ouro's down: rows over 4096 take 4096-long runs
        (3072, 6144, 2, 1024, 4),  # Nanbeige's o: 1536 programs, one wave only with short runs
        (3072, 10752, 2, 1024, 4),
        (5280, 17920, 2, 2048, 4),  # Huginn's down: 2640 programs, more than one wave either way
        (64, 100, 4, 128, 8),
    ]
    for n, k, block_n, block_k, warps in cases:
        cfg = gemv.gemv_config(1, n, k, bf16, cuda)
        assert (cfg["block_n"], cfg["block_k"], cfg["warps"], cfg["dot"]) == (block_n, block_k, warps, False), (n, k)
    assert gemv.gemv_config(1, 2048, 5632, torch.float32, cuda)["block_k"] == 256
    assert gemv.gemv_config(4, 2048, 5632, bf16, cuda)["dot"]


def test_gemv_rows_without_the_dot_tile_are_refused(interpret):
    x, w = torch.randn(2, 32), torch.randn(8, 32)
    with pytest.raises(ValueError, match="2 rows need the tl.dot tile"):
        gemv.linear_gemv(x, w, {"dot": False})
    torch.testing.assert_close(gemv.linear_gemv(x[:1], w, {"dot": True}), x[:1] @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("prefetch", [True, False])
def test_gemv_silu_mul_prologue(interpret, rows, prefetch):
    gen = torch.Generator().manual_seed(rows + 7)
    gate_up = torch.randn(rows, 2 * 45, generator=gen)
    w = torch.randn(21, 45, generator=gen)
    gate, up = gate_up.chunk(2, dim=-1)
    y = gemv.linear_gemv(gate_up, w, {"prefetch": prefetch}, silu_mul=True)
    torch.testing.assert_close(y, (F.silu(gate) * up) @ w.T, rtol=1e-5, atol=1e-5)


def test_gemv_keeps_leading_dims_and_fp16(interpret):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1, 48, generator=gen).half()
    w = torch.randn(24, 48, generator=gen).half()
    y = gemv.linear_gemv(x, w)
    assert y.shape == (2, 1, 24) and y.dtype == torch.float16
    torch.testing.assert_close(y.float(), x.float() @ w.float().T, rtol=2e-3, atol=2e-3)


def test_gemv_rejects_what_it_cannot_serve():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="<= 16 rows"):
        gemv.linear_gemv(torch.randn(17, 16), w)
    with pytest.raises(ValueError, match="stride"):
        gemv.linear_gemv(torch.randn(1, 16), torch.randn(16, 8).T)
    assert not gemv.supports_gemv(torch.randn(1, 16).half(), w)


def test_ops_fall_back_to_torch_off_gpu():
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    assert torch.equal(torch.ops.rlt.linear_small(x, w), F.linear(x, w))
    big = torch.randn(40, 16)
    assert torch.equal(torch.ops.rlt.linear_small(big, w), F.linear(big, w))
    gate_up = torch.randn(3, 32)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(torch.ops.rlt.silu_mul_linear_small(gate_up, w), F.linear(F.silu(gate) * up, w))


class TwoLinears(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.a = torch.nn.Linear(16, 32, bias=False, dtype=dtype)
        self.b = torch.nn.Linear(32, 8, bias=True, dtype=dtype)

    def forward(self, x):
        return self.b(F.silu(self.a(x)))


def _capture(module, x):
    seen = []

    def record(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(module, backend=record, fullgraph=True, dynamic=False)(x)
    return seen[0]


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_pass_swaps_bias_free_16bit_linears_on_pdl_gpus(monkeypatch):
    monkeypatch.setattr("rlt_compile.platform.triton_supports_pdl", lambda: True)
    monkeypatch.delenv("RLT_PDL", raising=False)
    module = TwoLinears(torch.bfloat16)
    x = torch.randn(1, 16, dtype=torch.bfloat16)
    gm, inputs = _capture(module, x)
    records = PassManager([GemvSwapPass()]).run(gm, PassContext(Platform.mock("cuda")))
    assert [r.message.split()[0] for r in records] == ["1"]  # the biased linear stays
    targets = _targets(gm)
    assert targets.count("rlt.linear_small.default") == 1
    assert any("linear" in t and "linear_small" not in t for t in targets)
    with torch.no_grad():
        (out,) = gm(*inputs)
        assert torch.equal(out, module(x))  # on the CPU the op is F.linear


class GateUpLeak(torch.nn.Module):
    """A SwiGLU whose gated product is also returned: the fold must not happen."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 64, bias=False, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(32, 16, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        gate, up = self.fc(x).chunk(2, dim=-1)
        act = F.silu(gate) * up
        return self.proj(act), act


@pytest.mark.parametrize("kind", ["separate", "fused", "leak"])
def test_pass_folds_the_swiglu_gate_into_the_down_gemv(monkeypatch, kind):
    from rlt_compile.models.layers import FusedSwiGLU, SwiGLU
    from rlt_compile.passes.fuse_linears import FuseLinearsPass

    monkeypatch.setattr("rlt_compile.platform.triton_supports_pdl", lambda: True)
    monkeypatch.delenv("RLT_PDL", raising=False)
    torch.manual_seed(0)
    module = {"separate": lambda: SwiGLU(16, 24), "fused": lambda: FusedSwiGLU(16, 24), "leak": GateUpLeak}[kind]()
    module = module.to(torch.bfloat16)
    x = torch.randn(1, 16, dtype=torch.bfloat16)
    expected = module(x)
    gm, inputs = _capture(module, x)
    plain = copy.deepcopy(gm)
    ctx = PassContext(Platform.mock("cuda"), example_inputs=inputs)
    PassManager([FuseLinearsPass(), GemvSwapPass()]).run(plain, ctx)
    assert "rlt.silu_mul_linear_small.default" not in _targets(plain)  # opt-in only
    PassManager([FuseLinearsPass(), GemvSwapPass(fold_swiglu=True)]).run(gm, ctx)
    targets = _targets(gm)
    folded = targets.count("rlt.silu_mul_linear_small.default")
    assert folded == (0 if kind == "leak" else 1)
    assert targets.count("rlt.linear_small.default") == 2 - folded
    assert not any("silu" in t and "linear" not in t for t in targets) or kind == "leak"
    with torch.no_grad():
        out = gm(*inputs)
    for got, want in zip(out, expected if isinstance(expected, tuple) else (expected,)):
        assert torch.equal(got, want)  # on the CPU the ops run the same torch code as eager


@pytest.mark.parametrize(
    ("platform", "dtype", "env"),
    [
        (Platform.mock("cpu"), torch.bfloat16, None),
        (Platform.mock("rocm"), torch.bfloat16, None),
        (Platform.mock("cuda", capability=(8, 0)), torch.bfloat16, None),
        (Platform.mock("cuda"), torch.float32, None),
        (Platform.mock("cuda"), torch.bfloat16, "0"),
    ],
    ids=["cpu", "rocm", "sm80", "fp32", "RLT_PDL=0"],
)
def test_pass_leaves_graphs_alone_without_pdl_or_16bit(monkeypatch, platform, dtype, env):
    monkeypatch.setattr("rlt_compile.platform.triton_supports_pdl", lambda: True)
    if env is None:
        monkeypatch.delenv("RLT_PDL", raising=False)
    else:
        monkeypatch.setenv("RLT_PDL", env)
    gm, _ = _capture(TwoLinears(dtype), torch.randn(1, 16, dtype=dtype))
    assert PassManager([GemvSwapPass()]).run(gm, PassContext(platform)) == []
    assert "rlt.linear_small.default" not in _targets(gm)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16])
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 2048), (2048, 2048), (2048, 5632), (11264, 2048), (49152, 2048), (3072, 6144), (1000, 300)]
)
def test_gemv_gpu_matches_f_linear(dtype, rows, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k + rows)
    x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * k**-0.5
    ref = (x.float() @ w.float().T).to(dtype)
    y = gemv.linear_gemv(x, w)
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2)
    gate_up = torch.randn(rows, 2 * k, device="cuda", dtype=dtype, generator=gen)
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate) * up).float()
    y = gemv.linear_gemv(gate_up, w, silu_mul=True)
    torch.testing.assert_close(y.float(), (act @ w.float().T).to(dtype).float(), rtol=1e-2, atol=1e-2)
    # inside a CUDA graph (PDL launches on sm_90+), twice in a row: the second reads the first's output
    w2 = torch.randn(k, n, device="cuda", dtype=dtype, generator=gen) * n**-0.5
    out = {}

    def chain():
        out["y"] = gemv.linear_gemv(gemv.linear_gemv(x, w), w2)

    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ref2 = ((x.float() @ w.float().T).to(dtype).float() @ w2.float().T).to(dtype)
    torch.testing.assert_close(out["y"].float(), ref2.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("rows", [gemv.OP_MAX_ROWS, gemv.OP_MAX_ROWS + 1])
def test_ops_send_more_rows_than_op_max_rows_to_cublas(rows):
    """Up to ``OP_MAX_ROWS`` rows the op runs the Triton GEMV, above it exactly ``F.linear``."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16, generator=gen) * 512**-0.5
    gate_up = torch.cat([x, x.flip(-1)], -1)
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch.ops.rlt.linear_small(x, w)
    y2 = torch.ops.rlt.silu_mul_linear_small(gate_up, w)
    if rows > gemv.OP_MAX_ROWS:
        assert torch.equal(y, F.linear(x, w)) and torch.equal(y2, F.linear(F.silu(gate) * up, w))
    else:
        assert torch.equal(y, gemv.linear_gemv(x, w))
        assert torch.equal(y2, gemv.linear_gemv(gate_up, w, silu_mul=True))
