"""The one-launch decode layer (``kernels/decode_layer.py``) against the eager layer, op for op.

CPU: the kernel's phases under Triton's interpreter (fp32) on random layers: MHA and GQA, a
loop step's first layer (no ``norm_a``) and later ones, contexts from empty to several blocks and
splits, shuffled block tables; the cache row written. GPU (``-m gpu``): the fused launch (grid
barriers) and the phased one in bf16 and fp32 at real Ouro sizes, long contexts, repeated launches
(the barrier counter carries across them) and inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from rlt_compile.kernels.decode_layer import (
    layer_config,
    sandwich_layer_reference,
    sandwich_layer_triton,
    supports_sandwich_layer,
)

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_layer(hidden, inter, heads, kv_heads, head_dim, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def w(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

    return {
        "w_qkv": w((heads + 2 * kv_heads) * head_dim, hidden, scale=hidden**-0.5),
        "w_o": w(hidden, heads * head_dim, scale=(heads * head_dim) ** -0.5),
        "w_gu": w(2 * inter, hidden, scale=hidden**-0.5),
        "w_down": w(hidden, inter, scale=inter**-0.5),
        "w_a": 1 + 0.1 * w(hidden),
        "w_in": 1 + 0.1 * w(hidden),
        "w_in2": 1 + 0.1 * w(hidden),
        "w_post": 1 + 0.1 * w(hidden),
    }


def make_step(layer, ctx, kv_heads, head_dim, block_size, num_blocks, dtype, device, first, seed=1):
    """Inputs of one decode step at position ``ctx`` (``ctx`` cached tokens) over a shuffled table."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = layer["w_in"].shape[0]
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype=dtype, device=device)
    need = ctx // block_size + 1
    table = torch.randperm(num_blocks, generator=g)[: need + 1].to(torch.int32)[None].to(device)
    slot = torch.tensor([int(table[0, ctx // block_size]) * block_size + ctx % block_size], device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angle = (torch.tensor([float(ctx)])[:, None] * inv).to(device)
    args = {
        "y": torch.randn(1, hidden, generator=g).to(dtype=dtype, device=device),
        "residual": torch.randn(1, hidden, generator=g).to(dtype=dtype, device=device),
        "w_a": None if first else layer["w_a"],
        "w_in": layer["w_in"],
        "eps_a": 1e-6,
        "eps_in": 1e-5,
        "w_qkv": layer["w_qkv"],
        "cos": angle.cos(),
        "sin": angle.sin(),
        "slot_mapping": slot,
        "block_tables": table,
        "seq_lens": torch.tensor([ctx + 1], dtype=torch.int32, device=device),
        "scale": head_dim**-0.5,
        "w_o": layer["w_o"],
        "w_in2": layer["w_in2"],
        "w_post": layer["w_post"],
        "eps_in2": 1e-6,
        "eps_post": 1e-6,
        "w_gu": layer["w_gu"],
        "w_down": layer["w_down"],
    }
    return args, cache


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(args, cache, config=None, tol=1e-5):
    got_cache, ref_cache = cache.clone(), cache.clone()
    got = sandwich_layer_triton(kv_cache=got_cache, config=config, **args)
    ref = sandwich_layer_reference(kv_cache=ref_cache, query_start_loc=None, **args)
    assert got is not None
    for name, a, b in (("h2", got[0], ref[0]), ("d", got[1], ref[1]), ("kv cache", got_cache, ref_cache)):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < tol, (name, rel(a, b))
    return got


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("ctx", [0, 5, 16, 37])
@pytest.mark.parametrize("first", [False, True])
def test_interpreted_phases_match_the_eager_layer(interpret, heads, kv_heads, ctx, first):
    layer = make_layer(48, 40, heads, kv_heads, 16, torch.float32, "cpu", seed=ctx)
    args, cache = make_step(layer, ctx, kv_heads, 16, 4, 16, torch.float32, "cpu", first, seed=ctx + 7)
    check(args, cache)


def test_interpreted_other_tiles_and_depth(interpret):
    layer = make_layer(64, 96, 4, 2, 16, torch.float32, "cpu")
    args, cache = make_step(layer, 22, 2, 16, 8, 8, torch.float32, "cpu", first=False)
    for config in (
        {"rows": 2, "block_k": 64, "depth": 2},
        {"stages": 2, "rows": 4},
        {"rows": 8, "block_k": 16, "nprog": 5, "block_n": 4},
    ):
        check(args, cache, config)


def test_the_written_row_is_this_steps_rotated_key(interpret):
    """A wrong slot or an unrotated key would show in the cache; the other rows stay as they were."""
    layer = make_layer(32, 32, 2, 2, 16, torch.float32, "cpu")
    args, cache = make_step(layer, 9, 2, 16, 4, 8, torch.float32, "cpu", first=False)
    got_cache = cache.clone()
    sandwich_layer_triton(kv_cache=got_cache, **args)
    slot = int(args["slot_mapping"])
    changed = (got_cache != cache).flatten(3).any(-1).flatten(1, 2).any(0)  # per flat slot
    assert changed.nonzero().flatten().tolist() == [slot]


def test_supports_and_config_checks():
    x = torch.zeros(1, 32)
    qkv = torch.zeros((4 + 2 * 2) * 16, 32)
    cache = torch.zeros(2, 4, 4, 2, 16)
    assert supports_sandwich_layer(x, qkv, cache, torch.zeros(64, 32))
    assert not supports_sandwich_layer(torch.zeros(2, 32), qkv, cache, torch.zeros(64, 32))  # two rows
    assert not supports_sandwich_layer(x, torch.zeros(100, 32), cache, torch.zeros(64, 32))  # not (H + 2Hkv) D
    assert not supports_sandwich_layer(x.half(), qkv, cache, torch.zeros(64, 32))  # mixed dtypes
    with pytest.raises(ValueError, match="unknown decode-layer config key"):
        layer_config(torch.device("cpu"), torch.float32, {"tiles": 3})
    with pytest.raises(ValueError, match="power of two"):
        layer_config(torch.device("cpu"), torch.float32, {"rows": 6})


# ---------------------------------------------------------------------------------------------- GPU


@pytest.fixture
def no_interpret(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


GPU_SHAPES = {
    "ouro": (2048, 5632, 16, 16, 128),
    "gqa": (3072, 10752, 48, 8, 128),
}


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("ctx", [0, 127, 1000, 4100])
@pytest.mark.parametrize("phased", [0, 1])
def test_gpu_layer_matches_the_eager_layer(no_interpret, dtype, shape, ctx, phased):
    hidden, inter, heads, kv_heads, head_dim = GPU_SHAPES[shape]
    layer = make_layer(hidden, inter, heads, kv_heads, head_dim, dtype, "cuda", seed=ctx)
    args, cache = make_step(layer, ctx, kv_heads, head_dim, 16, ctx // 16 + 4, dtype, "cuda", first=ctx == 127)
    prec = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # the fp32 reference without tf32
    try:
        check(args, cache, {"phased": phased}, tol=2e-2 if dtype == torch.bfloat16 else 1e-4)
    finally:
        torch.set_float32_matmul_precision(prec)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("config", [{}, {"depth": 2}, {"rows": 32, "warps": 16}, {"rows": 8, "block_k": 2048}])
def test_gpu_fused_launch_repeats_and_replays_in_a_graph(no_interpret, config):
    """Many launches in a row (the barrier counter keeps growing) and graph replays give the same bits."""
    hidden, inter, heads, kv_heads, head_dim = GPU_SHAPES["ouro"]
    layer = make_layer(hidden, inter, heads, kv_heads, head_dim, torch.bfloat16, "cuda")
    args, cache = make_step(layer, 300, kv_heads, head_dim, 16, 32, torch.bfloat16, "cuda", first=False)
    first = check(args, cache, config, tol=2e-2)
    for _ in range(50):
        again = sandwich_layer_triton(kv_cache=cache.clone(), config=config, **args)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    static_cache = cache.clone()
    sandwich_layer_triton(kv_cache=static_cache.clone(), config=config, **args)  # warm: sync buffers exist
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sandwich_layer_triton(kv_cache=static_cache, config=config, **args)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], first[0]) and torch.equal(out[1], first[1])
