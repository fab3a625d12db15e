"""fuse_rmsnorm: the fused residual-add + RMSNorm Triton kernel and the FX pass that installs it.

CPU: the kernel runs in Triton's interpreter (fp32 / fp16) against the torch references; the pass
runs on Dynamo graphs of the tiny models for a mock CUDA platform (on CPU tensors the ops run the
references, so the rewritten graph must equal the original bit for bit in fp32). GPU (``-m gpu``):
the kernel in bf16 at real hidden sizes, and a compiled tiny Ouro against eager.
"""

from __future__ import annotations

import copy
import inspect
import operator

import pytest
import torch
from conftest import FAMILIES, family_options
from torch import fx

from rlt_compile import load_model
from rlt_compile.compiler import _dims_table, compile_model, mark_dynamic_args, private_method, run_passes
from rlt_compile.kernels import rmsnorm as K
from rlt_compile.kernels.metadata import build_metadata
from rlt_compile.passes import DEFAULT_PASSES
from rlt_compile.passes.fuse_rmsnorm import FuseRMSNormPass, _norm_instance
from rlt_compile.passes.manager import PassContext, is_op, short_name
from rlt_compile.platform import Platform

OPS = {
    "rmsnorm": torch.ops.rlt.rmsnorm.default,
    "add_rmsnorm": torch.ops.rlt.add_rmsnorm.default,
    "add_rmsnorm2": torch.ops.rlt.add_rmsnorm2.default,
    "add_rmsnorm_rmsnorm": torch.ops.rlt.add_rmsnorm_rmsnorm.default,
}
TOL = {torch.float32: {"rtol": 1e-6, "atol": 1e-6}, torch.float16: {"rtol": 1e-3, "atol": 1e-3}}


# ------------------------------------------------------------------------------------------ kernel
def _variants(y, r, wa, wb, eps_a=1e-6, eps_b=1e-5):
    """name -> (Triton launcher outputs, reference outputs)."""
    return {
        "rmsnorm": ((K.rmsnorm_triton(y, wa, eps_a),), (K.rmsnorm_reference(y, wa, eps_a),)),
        "add_rmsnorm": (K.add_rmsnorm_triton(y, r, wa, eps_b), K.add_rmsnorm_reference(y, r, wa, eps_b)),
        "add_rmsnorm2": (
            K.add_rmsnorm2_triton(y, r, wa, wb, eps_a, eps_b),
            K.add_rmsnorm2_reference(y, r, wa, wb, eps_a, eps_b),
        ),
        "add_rmsnorm_rmsnorm": (
            K.add_rmsnorm_rmsnorm_triton(y, r, wa, wb, eps_a, eps_b),
            K.add_rmsnorm_rmsnorm_reference(y, r, wa, wb, eps_a, eps_b),
        ),
    }


def _inputs(rows, hidden, dtype, device="cpu", seed=0, shape=None):
    gen = torch.Generator().manual_seed(seed)
    shape = shape or (rows, hidden)
    y = torch.randn(shape, generator=gen).to(dtype) * 3
    r = torch.randn(shape, generator=gen).to(dtype)
    wa = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype)
    wb = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype)
    return [t.to(device) for t in (y, r, wa, wb)]


def test_residual_loaded_with_the_input_or_after_norm_a_gives_the_same_bits(monkeypatch):
    """``_EARLY_RESIDUAL`` (Ouro's add after norm a) only moves the residual's load; the old order
    stays for A/B runs."""
    y, r, wa, wb = _inputs(3, 100, torch.float32, seed=5)
    early = K.add_rmsnorm2_triton(y, r, wa, wb, 1e-6, 1e-5)
    monkeypatch.setattr(K, "_EARLY_RESIDUAL", False)
    late = K.add_rmsnorm2_triton(y, r, wa, wb, 1e-6, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(early, late))
    torch.testing.assert_close(late[1], K.add_rmsnorm2_reference(y, r, wa, wb, 1e-6, 1e-5)[1], **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("hidden", [48, 100, 2048])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_interpreted_kernel_matches_reference(rows, hidden, dtype):
    for name, (got, want) in _variants(*_inputs(rows, hidden, dtype, seed=rows * hidden)).items():
        assert len(got) == len(want), name
        for g, w in zip(got, want):
            assert g.dtype == w.dtype == dtype and g.shape == w.shape, name
            torch.testing.assert_close(g, w, **TOL[dtype], msg=lambda m, name=name: f"{name}: {m}")


def test_interpreted_kernel_on_3d_and_strided_inputs():
    y, r, wa, wb = _inputs(0, 64, torch.float32, shape=(2, 5, 64))
    for name, (got, want) in _variants(y, r, wa, wb).items():
        for g, w in zip(got, want):
            assert g.shape == (2, 5, 64) and g.is_contiguous(), name
            torch.testing.assert_close(g, w, **TOL[torch.float32])
    wide = torch.randn(7, 96)
    x = wide[:, 16:80]  # rows with a stride of 96
    torch.testing.assert_close(K.rmsnorm_triton(x, wa, 1e-6), K.rmsnorm_reference(x, wa, 1e-6), **TOL[torch.float32])
    assert K.rmsnorm_triton(torch.empty(0, 64), wa, 1e-6).shape == (0, 64)


def test_launcher_rejects_mismatched_dtypes_and_shapes():
    y, r, wa, _ = _inputs(3, 32, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        K.rmsnorm_triton(y, wa.half(), 1e-6)
    with pytest.raises(ValueError, match="residual shape"):
        K.add_rmsnorm_triton(y, r[:2], wa, 1e-6)
    with pytest.raises(ValueError, match=r"weight_a must be \[32\]"):
        K.rmsnorm_triton(y, wa[:16], 1e-6)


def test_custom_ops_on_cpu_run_the_reference_exactly():
    y, r, wa, wb = _inputs(5, 40, torch.float32)
    torch.testing.assert_close(OPS["rmsnorm"](y, wa, 1e-6), K.rmsnorm_reference(y, wa, 1e-6), rtol=0, atol=0)
    for name in ("add_rmsnorm2", "add_rmsnorm_rmsnorm"):
        got = OPS[name](y, r, wa, wb, 1e-6, 1e-5)
        want = getattr(K, f"{name}_reference")(y, r, wa, wb, 1e-6, 1e-5)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    got = OPS["add_rmsnorm"](y, r, wa, 1e-5)
    for g, w in zip(got, K.add_rmsnorm_reference(y, r, wa, 1e-5)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_fake_impls_give_contiguous_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = torch.empty(3, 8).t()  # non-contiguous input
        w = torch.empty(3)
        h, out = OPS["add_rmsnorm2"](y, y, w, w, 1e-6, 1e-6)
        assert h.shape == out.shape == (8, 3) and h.is_contiguous() and out.is_contiguous()
        assert OPS["rmsnorm"](y, w, 1e-6).is_contiguous()


# -------------------------------------------------------------------------------------------- pass
def _model(tiny_dirs, family, dtype=torch.float32):
    return load_model(tiny_dirs[family], dtype=dtype, load_tokenizer=False).eval()


def _unit_args(model, unit: str, num_tokens=3):
    """Arguments of ``model.<unit>`` for one prefill of ``num_tokens`` tokens (fp32 tiny models)."""
    huginn = model.family == "huginn"
    hidden = model.config.n_embd if huginn else model.config.hidden_size
    gen = torch.Generator().manual_seed(num_tokens)
    h = torch.randn(num_tokens, hidden, generator=gen).to(next(model.parameters()).dtype)
    half = model.rope_params()[0] // 2
    angles = torch.arange(num_tokens, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1, half)
    cos, sin = angles.cos(), angles.sin()
    planes = model.allocate_kv_cache(2, 16, max_steps=1)
    attn = build_metadata([num_tokens], [0], [[0, 1]], 16)
    if not huginn:
        assert unit == "loop_step"
        return (h, cos, sin, planes, attn)
    c = model.config
    if unit == "loop_step":
        return (h, torch.randn_like(h), cos, sin, planes[-c.n_layers_in_recurrent_block :], attn)
    assert unit == "coda"
    coda = planes[c.n_layers_in_prelude : c.n_layers_in_prelude + c.n_layers_in_coda]
    return (h, cos, sin, coda, attn, torch.tensor([num_tokens - 1]))


def capture(model, unit: str, *args) -> tuple[fx.GraphModule, list]:
    """(Dynamo graph of ``model.<unit>`` with compile_model's dynamic token dims, a function that
    runs a graph on the unit's real inputs): the graph's placeholders include unbacked sizes, whose
    real values only exist at run time, so the runner calls the compiled unit again."""
    seen, graphs = [], []

    def record(gm, example_inputs):
        seen.append(gm)
        graphs.append(gm)
        return lambda *real: graphs[-1](*[x.clone() if isinstance(x, torch.Tensor) else x for x in real])

    method = private_method(model, unit)
    compiled = torch.compile(method, backend=record, fullgraph=True, dynamic=False)

    def run(gm):
        graphs.append(gm)
        mark_dynamic_args(inspect.signature(method).bind(*args), _dims_table(model))
        with torch.no_grad():
            return compiled(*copy.deepcopy(args))

    mark_dynamic_args(inspect.signature(method).bind(*args), _dims_table(model))
    with torch.no_grad():
        compiled(*copy.deepcopy(args))
    (gm,) = seen
    return gm, run


def fused(gm: fx.GraphModule) -> dict[str, int]:
    return {name: sum(1 for n in gm.graph.nodes if is_op(n, op)) for name, op in OPS.items()}


def norm_arithmetic(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes recorded inside an RMSNorm that are plain torch arithmetic (not our ops)."""
    return [
        n
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method")
        and _norm_instance(n) is not None
        and n.target not in OPS.values()
        and n.target is not operator.getitem
        and isinstance(n.meta.get("example_value"), torch.Tensor)
    ]


def expected_counts(model, unit: str) -> dict[str, int]:
    c = model.config
    counts = dict.fromkeys(OPS, 0)
    if model.family == "ouro":  # 4 norms per layer + model.norm -> 2 per layer + the first pre-norm
        counts.update(rmsnorm=1, add_rmsnorm2=2 * c.num_hidden_layers)
    elif model.family == "nanbeige":  # 2 per layer + model.norm -> an add + norm each + the first
        counts.update(rmsnorm=1, add_rmsnorm=2 * c.num_hidden_layers)
    elif unit == "loop_step":  # Huginn: adapter -> norm_1 alone; add -> norm -> norm; last block's norm_4
        counts.update(rmsnorm=1, add_rmsnorm_rmsnorm=2 * c.n_layers_in_recurrent_block - 1, add_rmsnorm=1)
    else:  # Huginn coda: ln_f (twice: latent and after select_rows) alone, blocks as above
        counts.update(rmsnorm=3, add_rmsnorm_rmsnorm=2 * c.n_layers_in_coda - 1, add_rmsnorm=1)
    return counts


CASES = [("ouro", "loop_step"), ("nanbeige", "loop_step"), ("huginn", "loop_step"), ("huginn", "coda")]


@pytest.mark.parametrize(("family", "unit"), CASES)
@pytest.mark.parametrize("kind", ["cuda", "rocm"])
def test_pass_fuses_every_norm_and_keeps_results_exact(tiny_dirs, family, unit, kind):
    model = _model(tiny_dirs, family)
    gm, run = capture(model, unit, *_unit_args(model, unit))
    assert norm_arithmetic(gm) and not any(fused(gm).values())
    rewritten = copy.deepcopy(gm)
    records = run_passes(rewritten, Platform.mock(kind), passes=["fuse_rmsnorm"], unit=unit)
    assert [r.pass_name for r in records] == ["fuse_rmsnorm"]
    want = expected_counts(model, unit)
    assert fused(rewritten) == want
    assert not norm_arithmetic(rewritten)
    norms = want["rmsnorm"] + want["add_rmsnorm"] + 2 * (want["add_rmsnorm2"] + want["add_rmsnorm_rmsnorm"])
    assert records[0].message.startswith(f"{norms} RMSNorms + {sum(want.values()) - want['rmsnorm']} residual adds")
    rewritten.graph.lint()
    got, ref = run(rewritten), run(gm)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


def test_ouro_per_layer_layout(tiny_dirs):
    """Per Ouro layer: attention-out -> add_rmsnorm2(input_layernorm_2, post_attention_layernorm);
    mlp-out -> add_rmsnorm2(post_attention_layernorm_2, next input_layernorm / model.norm)."""
    model = _model(tiny_dirs, "ouro")
    gm, _ = capture(model, "loop_step", *_unit_args(model, "loop_step"))
    run_passes(gm, Platform.mock("cuda"), passes=["fuse_rmsnorm"])

    def weight(node):
        return short_name(node.name).removeprefix("model.layers.").removesuffix(".weight")

    pairs = [(weight(n.args[2]), weight(n.args[3])) for n in gm.graph.nodes if is_op(n, OPS["add_rmsnorm2"])]
    layers = model.config.num_hidden_layers
    want = []
    for i in range(layers):
        nxt = f"{i + 1}.input_layernorm" if i + 1 < layers else "model.norm"
        want += [(f"{i}.input_layernorm_2", f"{i}.post_attention_layernorm"), (f"{i}.post_attention_layernorm_2", nxt)]
    assert pairs == want
    # The residual stream of each add_rmsnorm2 is the h output of the one before.
    chain = [n for n in gm.graph.nodes if is_op(n, OPS["add_rmsnorm2"])]
    for prev, cur in zip(chain, chain[1:]):
        assert cur.args[1].target is operator.getitem and cur.args[1].args == (prev, 0)


def test_pass_is_a_no_op_on_cpu(tiny_dirs):
    model = _model(tiny_dirs, "ouro")
    gm, _ = capture(model, "loop_step", *_unit_args(model, "loop_step"))
    assert FuseRMSNormPass().run(gm, PassContext(Platform.mock("cpu"))) is None
    assert not any(fused(gm).values()) and norm_arithmetic(gm)


def test_pass_leaves_unexpected_norm_arithmetic_alone():
    """A module named RMSNorm whose recorded arithmetic differs (here: an extra op inside) is kept."""
    from rlt_compile.models.layers import RMSNorm

    class OddNorm(RMSNorm):
        def forward(self, x):
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * xf.to(x.dtype) + 1.0

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = OddNorm(8, 1e-6), RMSNorm(8, 1e-6)

        def forward(self, h, y):
            h = h + self.a(y)
            return h, self.b(h)

    block = Block()
    gm, inputs = capture_plain(block, torch.randn(3, 8), torch.randn(3, 8))
    before = gm(*inputs)
    records = run_passes(gm, Platform.mock("cuda"), passes=["fuse_rmsnorm"])
    assert fused(gm) == {"rmsnorm": 0, "add_rmsnorm": 1, "add_rmsnorm2": 0, "add_rmsnorm_rmsnorm": 0}
    assert records[0].message.startswith("1 RMSNorms + 1 residual adds")
    assert len(norm_arithmetic(gm)) == 9  # OddNorm's float, pow, mean, add, rsqrt, mul, to, mul, add
    for g, w in zip(gm(*inputs), before):
        assert torch.equal(g, w)


def capture_plain(module, *args):
    seen = []

    def record(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    with torch.no_grad():
        torch.compile(module, backend=record, fullgraph=True, dynamic=False)(*args)
    (captured,) = seen
    return captured


def test_mixed_dtype_norms_are_left_alone():
    """fp32 weights on a bf16 input promote the product to fp32: not the kernel's contract."""
    from rlt_compile.models.layers import RMSNorm

    norm = RMSNorm(8, 1e-6)  # fp32 weight
    gm, _ = capture_plain(norm, torch.randn(3, 8, dtype=torch.bfloat16))
    assert run_passes(gm, Platform.mock("cuda"), passes=["fuse_rmsnorm"]) == []


def _steps(fn, planes, family):
    """A 2-sequence prefill, then a decode step."""
    opts = family_options(family)
    outs = []
    for qlens, ctx in (([5, 3], [0, 0]), ([1, 1], [5, 3])):
        meta = build_metadata(qlens, ctx, [[0, 1], [2, 3]], 16)
        gen = torch.Generator().manual_seed(sum(qlens))
        ids = torch.randint(0, 256, (sum(qlens),), generator=gen)
        pos = torch.cat([torch.arange(c, c + q) for q, c in zip(qlens, ctx)])
        with torch.no_grad():
            outs.append(fn(ids, pos, planes, meta, torch.cumsum(torch.tensor(qlens), 0) - 1, **opts))
    return outs


@pytest.mark.parametrize("family", FAMILIES)
def test_compile_model_with_the_pass_for_a_mock_gpu(tiny_dirs, family):
    """compile_model end to end for a mock CUDA platform on CPU tensors (the ops run their
    references): graphs only (exactly eager) and through Inductor (two-output custom ops)."""
    ref = _model(tiny_dirs, family)
    want = _steps(ref, ref.allocate_kv_cache(4, 16), family)
    for inductor in (False, True):
        model = _model(tiny_dirs, family)
        cm = compile_model(model, Platform.mock("cuda"), inductor=inductor, passes=["fuse_rmsnorm"])
        got = _steps(cm, model.allocate_kv_cache(4, 16), family)
        assert "fuse_rmsnorm" in {r.pass_name for r in cm.pass_log}
        for g, w in zip(got, want):
            if inductor:
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
            else:
                assert torch.equal(g, w)
        if inductor:
            code = "\n".join(c for r in cm.graph_records("loop_step") for c in r.output_code)
            op = {"ouro": "add_rmsnorm2", "nanbeige": "add_rmsnorm", "huginn": "add_rmsnorm_rmsnorm"}[family]
            assert f"torch.ops.rlt.{op}.default" in code
        cm.uninstall()


def test_compile_model_on_cpu_skips_the_pass(tiny_dirs):
    model = _model(tiny_dirs, "ouro")
    cm = compile_model(model, "cpu", inductor=False, passes=[*DEFAULT_PASSES])
    _steps(cm, model.allocate_kv_cache(4, 16), "ouro")
    assert "fuse_rmsnorm" in DEFAULT_PASSES
    assert "fuse_rmsnorm" not in {r.pass_name for r in cm.pass_log}


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [2048, 5280])
@pytest.mark.parametrize("rows", [1, 7, 130])
def test_triton_ops_match_reference_bf16_on_gpu(rows, hidden):
    y, r, wa, wb = _inputs(rows, hidden, torch.bfloat16, device="cuda", seed=hidden + rows)
    got = {
        "rmsnorm": (OPS["rmsnorm"](y, wa, 1e-6),),
        "add_rmsnorm": OPS["add_rmsnorm"](y, r, wa, 1e-5),
        "add_rmsnorm2": OPS["add_rmsnorm2"](y, r, wa, wb, 1e-6, 1e-5),
        "add_rmsnorm_rmsnorm": OPS["add_rmsnorm_rmsnorm"](y, r, wa, wb, 1e-6, 1e-5),
    }
    for name, (_, want) in _variants(y, r, wa, wb).items():
        for g, w in zip(got[name], want):
            assert g.dtype == torch.bfloat16 and g.device.type == "cuda"
            torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2, msg=lambda m, n=name: f"{n}: {m}")
            # Same roundings as eager: almost every element is bit-identical.
            assert (g == w).float().mean() > 0.99, name


@pytest.mark.gpu
def test_compiled_tiny_ouro_bf16_on_gpu_matches_eager(tiny_dirs):
    model = load_model(tiny_dirs["ouro"], dtype=torch.bfloat16, device="cuda", load_tokenizer=False)
    ref = load_model(tiny_dirs["ouro"], dtype=torch.bfloat16, device="cuda", load_tokenizer=False)
    cm = compile_model(model, platform="cuda")
    planes, ref_planes = model.allocate_kv_cache(4, 16), ref.allocate_kv_cache(4, 16)
    for qlens, ctx in (([5, 3], [0, 0]), ([1, 1], [5, 3]), ([1, 1], [6, 4])):
        meta = build_metadata(qlens, ctx, [[0, 1], [2, 3]], 16, device="cuda")
        gen = torch.Generator().manual_seed(sum(qlens) + sum(ctx))
        ids = torch.randint(0, 256, (sum(qlens),), generator=gen).cuda()
        pos = torch.cat([torch.arange(c, c + q) for q, c in zip(qlens, ctx)]).cuda()
        last = torch.cumsum(torch.tensor(qlens), 0).cuda() - 1
        with torch.no_grad():
            got, want = cm(ids, pos, planes, meta, last), ref(ids, pos, ref_planes, meta, last)
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=6e-2)
    (record,) = [r for r in cm.pass_log if r.pass_name == "fuse_rmsnorm"]
    layers = model.config.num_hidden_layers
    assert f"-> {2 * layers + 1} fused ops ({2 * layers} rlt.add_rmsnorm2, 1 rlt.rmsnorm)" in record.message
    code = "\n".join(c for r in cm.graph_records("loop_step") for c in r.output_code)
    assert "torch.ops.rlt.add_rmsnorm2.default" in code
