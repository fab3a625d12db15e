"""Rotary folded into the decode GEMV: the kernel epilogue, ``rlt::rope_linear_small``, the pass.

CPU: the kernel under Triton's interpreter against ``F.linear`` + the models' eager rotation (fp32
and bf16, tiles of 2 to 16 columns, q+k and k-only ranges); the op's fallback; the pass on a
q/k/v module and on the real loop step of tiny Ouro and Nanbeige models in bf16 (mock CUDA
platform): the rewritten graph gives the same bits as the graph without it, and the pass leaves a
graph alone when an un-rotated q is read elsewhere. GPU (``-m gpu``): the op at real head sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_pass_snapshots import RopeQKV, capture
from test_passes import tiny_model

from rlt_compile.kernels import gemv
from rlt_compile.kernels.metadata import build_metadata
from rlt_compile.kernels.reference import apply_rope_half
from rlt_compile.models.layers import rope_cos_sin, rope_inv_freq
from rlt_compile.passes.manager import PassContext, PassManager, build_passes
from rlt_compile.platform import Platform


def _tables(positions: list[int], head_dim: int, device="cpu"):
    return rope_cos_sin(torch.tensor(positions, device=device), rope_inv_freq(head_dim, 10000.0, device))


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_n", [2, 4, 16])
@pytest.mark.parametrize(("heads", "lo_head", "hi_head"), [((4, 2, 2), 0, 6), ((4, 2, 2), 4, 6), ((2, 2, 0), 0, 4)])
def test_kernel_rotates_the_range_and_leaves_the_rest(interpret, dtype, block_n, heads, lo_head, hi_head):
    head_dim, k = 16, 40
    n = sum(heads) * head_dim
    gen = torch.Generator().manual_seed(block_n + 10 * lo_head + n)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    cos, sin = _tables([7], head_dim)
    rope = gemv.RopeColumns(cos, sin, lo_head * head_dim, hi_head * head_dim, head_dim)
    y = gemv.linear_gemv(x, w, {"block_n": block_n}, rope=rope)
    ref = gemv.rope_columns_reference(F.linear(x, w), rope)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol)
    outside = torch.ones(n, dtype=torch.bool)
    outside[rope.lo : rope.hi] = False
    plain = gemv.linear_gemv(x, w, {"block_n": block_n})
    assert torch.equal(y[:, outside], plain[:, outside])
    assert not torch.allclose(y[:, ~outside].float(), plain[:, ~outside].float(), atol=1e-3)


def test_rope_factors_loaded_early_or_late_give_the_same_bits(interpret, monkeypatch):
    """``gemv._EARLY_ROPE`` only moves the cos/sin loads (to right after the PDL wait); the old
    order stays for A/B runs, and ``acc_2d`` composes with the rotation."""
    head_dim, k, n = 16, 40, 96
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen) * k**-0.5
    cos, sin = _tables([11], head_dim)
    rope = gemv.RopeColumns(cos, sin, 0, 64, head_dim)
    early = gemv.linear_gemv(x, w, {"block_n": 4}, rope=rope)
    monkeypatch.setattr(gemv, "_EARLY_ROPE", False)
    assert torch.equal(gemv.linear_gemv(x, w, {"block_n": 4}, rope=rope), early)
    ref = gemv.rope_columns_reference(F.linear(x, w), rope)
    torch.testing.assert_close(gemv.linear_gemv(x, w, {"block_n": 4, "acc_2d": True}, rope=rope), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize(("lo", "hi"), [(0, 96), (64, 96), (32, 64)])
def test_rotary_kernel_for_many_rows_matches_the_reference(interpret, dtype, rows, lo, hi):
    gen = torch.Generator().manual_seed(rows * 100 + lo + hi)
    y = torch.randn(rows, 128, generator=gen).to(dtype)
    cos, sin = _tables(list(range(9, 9 + rows)), 16)
    rope = gemv.RopeColumns(cos, sin, lo, hi, 16)
    want = gemv.rope_columns_reference(y, rope)
    got = gemv.rope_columns_triton(y.clone(), rope)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(got[:, :lo], y[:, :lo]) and torch.equal(got[:, hi:], y[:, hi:])


def test_kernel_rejects_what_it_cannot_rotate(interpret):
    w = torch.randn(64, 8)
    cos, sin = _tables([0], 16)
    with pytest.raises(ValueError, match="one row"):
        gemv.linear_gemv(torch.randn(2, 8), w, rope=gemv.RopeColumns(cos, sin, 0, 32, 16))
    with pytest.raises(ValueError, match="whole heads"):
        gemv.linear_gemv(torch.randn(1, 8), w, rope=gemv.RopeColumns(cos, sin, 0, 24, 16))
    with pytest.raises(ValueError, match="split no rotary pair"):
        gemv.linear_gemv(torch.randn(1, 8), w, {"block_n": 32}, rope=gemv.RopeColumns(cos, sin, 16, 48, 16))


@pytest.mark.parametrize("rows", [1, 3])
def test_op_falls_back_to_linear_and_the_eager_rotation_off_gpu(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 24, generator=gen).bfloat16()
    w = torch.randn(64, 24, generator=gen).bfloat16()
    cos, sin = _tables(list(range(3, 3 + rows)), 16)
    y = torch.ops.rlt.rope_linear_small(x, w, cos, sin, 0, 48, 16)
    full = F.linear(x, w)
    q = apply_rope_half(full[:, :32].view(rows, 2, 16), cos, sin).reshape(rows, 32)
    k = apply_rope_half(full[:, 32:48].view(rows, 1, 16), cos, sin).reshape(rows, 16)
    assert torch.equal(y, torch.cat([q, k, full[:, 48:]], dim=-1))


def _run(captured, passes: list[str]):
    gm, inputs = copy.deepcopy(captured[0]), captured[1]
    records = PassManager(build_passes(passes)).run(gm, PassContext(Platform.mock("cuda"), example_inputs=inputs))
    inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    return gm, {r.pass_name: r.message for r in records}, gm(*inputs)


def _ops(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "rlt." in str(n.target)]


@pytest.fixture
def pdl(monkeypatch):
    monkeypatch.setattr("rlt_compile.platform.triton_supports_pdl", lambda: True)
    monkeypatch.delenv("RLT_PDL", raising=False)


@pytest.mark.parametrize("tokens", [1, 3])
def test_pass_folds_q_and_k_rotaries_into_the_fused_gemv(pdl, tokens):
    torch.manual_seed(tokens)
    module = RopeQKV().bfloat16()
    cos, sin = _tables(list(range(5, 5 + tokens)), 16)
    captured = capture(module, torch.randn(tokens, 32, dtype=torch.bfloat16), cos, sin)
    plain, _, expected = _run(captured, ["fuse_linears", "gemv_swap"])
    fused, log, got = _run(captured, ["fuse_linears", "gemv_swap", "fuse_rope_gemv"])
    assert log["fuse_rope_gemv"].startswith("2 rotaries folded into 1 ")
    assert _ops(fused) == ["rlt.rope_linear_small.default"]
    assert not any(n.target is torch.cat for n in fused.graph.nodes)
    assert torch.equal(got[0], expected[0])


def test_pass_leaves_a_graph_whose_unrotated_q_is_read_elsewhere(pdl):
    module = RopeQKV(leak_q=True).bfloat16()
    cos, sin = _tables([4], 16)
    captured = capture(module, torch.randn(1, 32, dtype=torch.bfloat16), cos, sin)
    fused, log, _ = _run(captured, ["fuse_linears", "gemv_swap", "fuse_rope_gemv"])
    # k alone still qualifies (its columns follow q's, which stay un-rotated for the other reader)
    assert log.get("fuse_rope_gemv", "").startswith("1 rotaries folded into 1 ")
    (op,) = [n for n in fused.graph.nodes if n.op == "call_function" and "rope_linear_small" in str(n.target)]
    assert op.args[4:] == (64, 96, 16)


def test_pass_needs_gemv_swap_first(pdl):
    module = RopeQKV().bfloat16()
    cos, sin = _tables([4], 16)
    captured = capture(module, torch.randn(1, 32, dtype=torch.bfloat16), cos, sin)
    _, log, _ = _run(captured, ["fuse_linears", "fuse_rope_gemv"])
    assert "fuse_rope_gemv" not in log


@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("triton_attention", [False, True])
def test_pass_on_the_loop_step_gives_the_same_bits(pdl, monkeypatch, family, tokens, triton_attention):
    """With ``triton_attention`` the Triton attention op (interpreter) reads q and k as strided
    views of the GEMV's output instead of the rotation's fresh tensors."""
    head = ["attention_swap"] if triton_attention else []
    if triton_attention:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tiny_model(family, torch.bfloat16)
    hidden, head_dim = model.config.hidden_size, model.rope_params()[0]
    cos, sin = _tables(list(range(2, 2 + tokens)), head_dim)
    h = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    planes = model.allocate_kv_cache(2, 16, max_steps=1)
    attn = build_metadata([tokens], [2], [[0, 1]], 16)
    captured = capture(model.loop_step, h, cos, sin, planes, attn)
    _, _, expected = _run(captured, [*head, "fuse_linears", "gemv_swap"])
    fused, log, got = _run(captured, [*head, "fuse_linears", "gemv_swap", "fuse_rope_gemv"])
    assert ("rlt.attention_triton.default" in _ops(fused)) == triton_attention
    layers = model.config.num_hidden_layers
    assert log["fuse_rope_gemv"].startswith(f"{2 * layers} rotaries folded into {layers} ")
    assert torch.equal(got[0], expected[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim", "k"), [(16, 16, 128, 2048), (24, 4, 128, 3072), (4, 2, 64, 300)]
)
def test_gpu_op_matches_linear_and_rotation(q_heads, kv_heads, head_dim, k):
    gen = torch.Generator(device="cuda").manual_seed(q_heads + k)
    n = (q_heads + 2 * kv_heads) * head_dim
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
    hi = (q_heads + kv_heads) * head_dim
    for rows in (1, 3):  # the GEMV's epilogue; cuBLAS + the rotary kernel
        cos, sin = _tables(list(range(1234, 1234 + rows)), head_dim, "cuda")
        xs = x.expand(rows, k).contiguous()
        y = torch.ops.rlt.rope_linear_small(xs, w, cos, sin, 0, hi, head_dim)
        ref = gemv.rope_columns_reference(
            (xs.float() @ w.float().T).bfloat16(), gemv.RopeColumns(cos, sin, 0, hi, head_dim)
        )
        torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(y[:, hi:], torch.ops.rlt.linear_small(xs, w)[:, hi:])
