"""Before/after snapshots of each FX pass on the smallest graph that has its pattern.

Graph only: Dynamo captures the function on the CPU with a recording backend, then one pass runs
for a mock Platform. ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_pass_snapshots.py``
refreshes the literals; review the diff.
"""

from __future__ import annotations

import copy
import os

import expecttest
import torch
import torch.nn.functional as F

import rlt_compile.kernels  # noqa: F401  (registers torch.ops.rlt.*)
from rlt_compile.kernels.reference import apply_rope_half
from rlt_compile.passes.manager import PassContext, PassManager, build_passes, format_graph
from rlt_compile.platform import Platform


def capture(fn, *args):
    """(graph, the real tensors of its inputs) as our torch.compile backend would receive them."""
    seen = []

    def record(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(fn, backend=record, fullgraph=True, dynamic=False)(*args)
    (captured,) = seen
    return captured


def before_after(captured, passes: list[str], kind: str) -> str:
    gm, inputs = copy.deepcopy(captured[0]), captured[1]
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        records = PassManager(build_passes(passes)).run(gm, PassContext(Platform.mock(kind), example_inputs=inputs))
    finally:
        torch.set_float32_matmul_precision(old)
    log = "".join(f"# {r.pass_name}: {r.message}\n" for r in records)
    return f"# before\n{format_graph(captured[0], asserts=False)}# after\n{log}{format_graph(gm, asserts=False)}"


def attention_call(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc):
    out = torch.ops.rlt.attention(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, 0.25)
    return out * 2


def attention_inputs():
    from rlt_compile.kernels.metadata import build_metadata

    q, k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    return (q, k, v, torch.zeros(2, 2, 16, 2, 16), *build_metadata([3], [0], [[1]], 16))


class QKV(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(8, n, bias=False) for n in (8, 4, 4))

    def forward(self, x):
        return F.silu(self.q(x)) + self.k(x).repeat(1, 2) * self.v(x).repeat(1, 2)


class RopeQKV(torch.nn.Module):
    """``models.layers.Attention`` up to the attention call."""

    def __init__(self, leak_q: bool = False):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(32, n, bias=False) for n in (64, 32, 32))
        self.leak_q = leak_q

    def forward(self, x, cos, sin):
        T = x.shape[0]
        q, k, v = self.q(x).view(T, 4, 16), self.k(x).view(T, 2, 16), self.v(x).view(T, 2, 16)
        q_rot, k_rot = apply_rope_half(q, cos, sin), apply_rope_half(k, cos, sin)
        out = q_rot.sum(1) + k_rot.sum(1) * v.sum(1)
        return out + q.sum(1) if self.leak_q else out


class Sandwich(torch.nn.Module):
    """Ouro's pattern, smallest: a sublayer output's post-norm, the residual add, the next pre-norm."""

    def __init__(self):
        super().__init__()
        from rlt_compile.models.layers import RMSNorm

        self.post_norm, self.pre_norm = RMSNorm(8, 1e-6), RMSNorm(8, 1e-5)

    def forward(self, h, y):
        h = h + self.post_norm(y)
        return h, self.pre_norm(h)


class TestPassSnapshots(expecttest.TestCase):
    maxDiff = None

    def test_attention_swap_cuda(self):
        captured = capture(attention_call, *attention_inputs())
        self.assertExpectedInline(
            before_after(captured, ["attention_swap"], "cuda"),
            """\
# before
input q
input k
input v
input kv_cache
input slot_mapping
input block_tables
input seq_lens
input query_start_loc
out = rlt.attention(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, 0.25)
mul = mul(out, 2)
return (mul,)
# after
# attention_swap: 1 nodes rlt.attention -> rlt.attention_triton (backend 'triton' on cuda)
input q
input k
input v
input kv_cache
input slot_mapping
input block_tables
input seq_lens
input query_start_loc
out = rlt.attention_triton(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, 0.25, 'ieee')
mul = mul(out, 2)
return (mul,)
""",
        )

    def test_dot_precision_rocm(self):
        captured = capture(attention_call, *attention_inputs())
        self.assertExpectedInline(
            before_after(captured, ["attention_swap", "dot_precision"], "rocm"),
            """\
# before
input q
input k
input v
input kv_cache
input slot_mapping
input block_tables
input seq_lens
input query_start_loc
out = rlt.attention(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, 0.25)
mul = mul(out, 2)
return (mul,)
# after
# attention_swap: 1 nodes rlt.attention -> rlt.attention_triton (backend 'triton' on rocm)
# dot_precision: rlt.attention_triton on rocm: 1 nodes (float32 cache) precision='ieee'
input q
input k
input v
input kv_cache
input slot_mapping
input block_tables
input seq_lens
input query_start_loc
out = rlt.attention_triton(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, 0.25, 'ieee')
mul = mul(out, 2)
return (mul,)
""",
        )

    def test_fuse_linears_cpu(self):
        torch.manual_seed(0)
        module = QKV()
        captured = capture(module, torch.randn(3, 8))
        self.assertExpectedInline(
            before_after(captured, ["fuse_linears"], "cpu"),
            """\
# before
input q.weight
input x
input k.weight
input v.weight
linear = torch.nn.functional.linear(x, q.weight, None)
silu = torch.nn.functional.silu(linear)
linear_1 = torch.nn.functional.linear(x, k.weight, None)
repeat = linear_1.repeat(1, 2)
linear_2 = torch.nn.functional.linear(x, v.weight, None)
repeat_1 = linear_2.repeat(1, 2)
mul = mul(repeat, repeat_1)
add = add(silu, mul)
return (add,)
# after
# fuse_linears: 3 linears -> 1 fused GEMMs (weights concatenated once, params re-pointed to views)
input q.weight
input x
input k.weight
input v.weight
_rlt_fused_linear_0 = getattr('_rlt_fused_linear_0')
linear_3 = torch.nn.functional.linear(x, _rlt_fused_linear_0, None)
narrow = torch.narrow(linear_3, -1, 0, 8)
narrow_1 = torch.narrow(linear_3, -1, 8, 4)
narrow_2 = torch.narrow(linear_3, -1, 12, 4)
silu = torch.nn.functional.silu(narrow)
repeat = narrow_1.repeat(1, 2)
repeat_1 = narrow_2.repeat(1, 2)
mul = mul(repeat, repeat_1)
add = add(silu, mul)
return (add,)
""",
        )

    def test_fuse_rmsnorm_cuda(self):
        captured = capture(Sandwich(), torch.randn(3, 8), torch.randn(3, 8))
        self.assertExpectedInline(
            before_after(captured, ["fuse_rmsnorm"], "cuda"),
            """\
# before
input y
input post_norm.weight
input h_in
input pre_norm.weight
xf = y.float()
pow_1 = xf.pow(2)
mean = pow_1.mean(-1, keepdim=True)
add = add(mean, 1e-06)
rsqrt = torch.rsqrt(add)
xf_1 = mul(xf, rsqrt)
to = xf_1.to(torch.float32)
mul_1 = mul(post_norm.weight, to)
h = add(h_in, mul_1)
xf_2 = h.float()
pow_2 = xf_2.pow(2)
mean_1 = pow_2.mean(-1, keepdim=True)
add_2 = add(mean_1, 1e-05)
rsqrt_1 = torch.rsqrt(add_2)
xf_3 = mul(xf_2, rsqrt_1)
to_1 = xf_3.to(torch.float32)
mul_3 = mul(pre_norm.weight, to_1)
return (h, mul_3)
# after
# fuse_rmsnorm: 2 RMSNorms + 1 residual adds -> 1 fused ops (1 rlt.add_rmsnorm2)
input y
input post_norm.weight
input h
input pre_norm.weight
add_rmsnorm2_default = rlt.add_rmsnorm2(y, h, post_norm.weight, pre_norm.weight, 1e-06, 1e-05)
getitem = getitem(add_rmsnorm2_default, 0)
getitem_1 = getitem(add_rmsnorm2_default, 1)
return (getitem, getitem_1)
""",
        )

    def test_gemv_swap_cuda(self):
        from unittest import mock

        module = QKV().to(torch.bfloat16)
        captured = capture(module, torch.randn(1, 8, dtype=torch.bfloat16))
        with mock.patch("rlt_compile.platform.triton_supports_pdl", lambda: True), mock.patch.dict("os.environ"):
            os.environ.pop("RLT_PDL", None)
            text = before_after(captured, ["fuse_linears", "gemv_swap"], "cuda")
        self.assertExpectedInline(
            text,
            """\
# before
input q.weight
input x
input k.weight
input v.weight
linear = torch.nn.functional.linear(x, q.weight, None)
silu = torch.nn.functional.silu(linear)
linear_1 = torch.nn.functional.linear(x, k.weight, None)
repeat = linear_1.repeat(1, 2)
linear_2 = torch.nn.functional.linear(x, v.weight, None)
repeat_1 = linear_2.repeat(1, 2)
mul = mul(repeat, repeat_1)
add = add(silu, mul)
return (add,)
# after
# fuse_linears: 3 linears -> 1 fused GEMMs (weights concatenated once, params re-pointed to views)
# gemv_swap: 1 linears -> rlt.linear_small (Triton GEMV for one row, F.linear above)
input q.weight
input x
input k.weight
input v.weight
_rlt_fused_linear_0 = getattr('_rlt_fused_linear_0')
linear_small_default = rlt.linear_small(x, _rlt_fused_linear_0)
narrow = torch.narrow(linear_small_default, -1, 0, 8)
narrow_1 = torch.narrow(linear_small_default, -1, 8, 4)
narrow_2 = torch.narrow(linear_small_default, -1, 12, 4)
silu = torch.nn.functional.silu(narrow)
repeat = narrow_1.repeat(1, 2)
repeat_1 = narrow_2.repeat(1, 2)
mul = mul(repeat, repeat_1)
add = add(silu, mul)
return (add,)
""",
        )

    def test_fuse_rope_gemv_cuda(self):
        from unittest import mock

        from rlt_compile.models.layers import rope_cos_sin, rope_inv_freq

        torch.manual_seed(0)
        module = RopeQKV().to(torch.bfloat16)
        cos, sin = rope_cos_sin(torch.tensor([3]), rope_inv_freq(16, 10000.0))
        captured = capture(module, torch.randn(1, 32, dtype=torch.bfloat16), cos, sin)
        with mock.patch("rlt_compile.platform.triton_supports_pdl", lambda: True), mock.patch.dict("os.environ"):
            os.environ.pop("RLT_PDL", None)
            text = before_after(captured, ["fuse_linears", "gemv_swap", "fuse_rope_gemv"], "cuda")
        self.assertExpectedInline(
            text,
            """\
# before
input x
input q.weight
input k.weight
input v.weight
input cos_in
input sin_in
linear = torch.nn.functional.linear(x, q.weight, None)
q = linear.view(1, 4, 16)
linear_1 = torch.nn.functional.linear(x, k.weight, None)
k = linear_1.view(1, 2, 16)
linear_2 = torch.nn.functional.linear(x, v.weight, None)
v = linear_2.view(1, 2, 16)
getitem = getitem(cos_in, (slice(None, None, None), None, slice(None, None, None)))
cos = getitem.to(torch.bfloat16)
getitem_1 = getitem(sin_in, (slice(None, None, None), None, slice(None, None, None)))
sin = getitem_1.to(torch.bfloat16)
chunk = q.chunk(2, dim=-1)
x1 = getitem(chunk, 0)
x2 = getitem(chunk, 1)
mul = mul(x1, cos)
neg = neg(x2)
mul_1 = mul(neg, sin)
add = add(mul, mul_1)
mul_2 = mul(x2, cos)
mul_3 = mul(x1, sin)
add_1 = add(mul_2, mul_3)
q_rot = torch.cat([add, add_1], dim=-1)
getitem_4 = getitem(cos_in, (slice(None, None, None), None, slice(None, None, None)))
cos_1 = getitem_4.to(torch.bfloat16)
getitem_5 = getitem(sin_in, (slice(None, None, None), None, slice(None, None, None)))
sin_1 = getitem_5.to(torch.bfloat16)
chunk_1 = k.chunk(2, dim=-1)
x1_1 = getitem(chunk_1, 0)
x2_1 = getitem(chunk_1, 1)
mul_4 = mul(x1_1, cos_1)
neg_1 = neg(x2_1)
mul_5 = mul(neg_1, sin_1)
add_2 = add(mul_4, mul_5)
mul_6 = mul(x2_1, cos_1)
mul_7 = mul(x1_1, sin_1)
add_3 = add(mul_6, mul_7)
k_rot = torch.cat([add_2, add_3], dim=-1)
sum_1 = q_rot.sum(1)
sum_2 = k_rot.sum(1)
sum_3 = v.sum(1)
mul_8 = mul(sum_2, sum_3)
out = add(sum_1, mul_8)
return (out,)
# after
# fuse_linears: 3 linears -> 1 fused GEMMs (weights concatenated once, params re-pointed to views)
# gemv_swap: 1 linears -> rlt.linear_small (Triton GEMV for one row, F.linear above)
# fuse_rope_gemv: 2 rotaries folded into 1 rlt.rope_linear_small (rotation in the GEMV's epilogue)
input x
input q.weight
input k.weight
input v.weight
input cos
input sin
_rlt_fused_linear_0 = getattr('_rlt_fused_linear_0')
rope_linear_small_default = rlt.rope_linear_small(x, _rlt_fused_linear_0, cos, sin, 0, 96, 16)
narrow = torch.narrow(rope_linear_small_default, -1, 0, 64)
narrow_1 = torch.narrow(rope_linear_small_default, -1, 64, 32)
narrow_2 = torch.narrow(rope_linear_small_default, -1, 96, 32)
q = narrow.view(1, 4, 16)
k = narrow_1.view(1, 2, 16)
v = narrow_2.view(1, 2, 16)
sum_1 = q.sum(1)
sum_2 = k.sum(1)
sum_3 = v.sum(1)
mul_8 = mul(sum_2, sum_3)
out = add(sum_1, mul_8)
return (out,)
""",
        )

    def test_fuse_swiglu_gemv_cuda(self):
        from unittest import mock

        from rlt_compile.models.layers import FusedSwiGLU

        torch.manual_seed(0)
        module = FusedSwiGLU(8, 12).to(torch.bfloat16)
        captured = capture(module, torch.randn(1, 8, dtype=torch.bfloat16))
        with mock.patch("rlt_compile.platform.triton_supports_pdl", lambda: True), mock.patch.dict("os.environ"):
            os.environ.pop("RLT_PDL", None)
            text = before_after(captured, ["gemv_swap", "fuse_swiglu_gemv"], "cuda")
        self.assertExpectedInline(
            text,
            """\
# before
input fc.weight
input x
input proj.weight
linear = torch.nn.functional.linear(x, fc.weight, None)
chunk = linear.chunk(2, dim=-1)
gate = getitem(chunk, 0)
up = getitem(chunk, 1)
silu = torch.nn.functional.silu(gate)
mul = mul(silu, up)
linear_1 = torch.nn.functional.linear(mul, proj.weight, None)
return (linear_1,)
# after
# gemv_swap: 2 linears -> rlt.linear_small (Triton GEMV for one row, F.linear above)
# fuse_swiglu_gemv: 1 SwiGLU gates folded into rlt.swiglu_linear_small (the gate in the GEMV's epilogue)
input fc.weight
input x
input proj.weight
swiglu_linear_small_default = rlt.swiglu_linear_small(x, fc.weight)
linear_small_default_1 = rlt.linear_small(swiglu_linear_small_default, proj.weight)
return (linear_small_default_1,)
""",
        )

    def test_gemv_swap_swiglu_cuda(self):
        from unittest import mock

        from rlt_compile.models.layers import SwiGLU

        torch.manual_seed(0)
        module = SwiGLU(8, 12).to(torch.bfloat16)
        captured = capture(module, torch.randn(1, 8, dtype=torch.bfloat16))
        with mock.patch("rlt_compile.platform.triton_supports_pdl", lambda: True), mock.patch.dict("os.environ"):
            os.environ.pop("RLT_PDL", None)
            text = before_after(captured, ["fuse_linears", "gemv_swap_swiglu"], "cuda")
        self.assertExpectedInline(
            text,
            """\
# before
input gate_proj.weight
input x
input up_proj.weight
input down_proj.weight
linear = torch.nn.functional.linear(x, gate_proj.weight, None)
silu = torch.nn.functional.silu(linear)
linear_1 = torch.nn.functional.linear(x, up_proj.weight, None)
mul = mul(silu, linear_1)
linear_2 = torch.nn.functional.linear(mul, down_proj.weight, None)
return (linear_2,)
# after
# fuse_linears: 2 linears -> 1 fused GEMMs (weights concatenated once, params re-pointed to views)
# gemv_swap_swiglu: 2 linears -> rlt.linear_small (Triton GEMV for one row, F.linear above), 1 with the SwiGLU gate folded in (rlt.silu_mul_linear_small)
input gate_proj.weight
input x
input up_proj.weight
input down_proj.weight
_rlt_fused_linear_0 = getattr('_rlt_fused_linear_0')
linear_small_default = rlt.linear_small(x, _rlt_fused_linear_0)
silu_mul_linear_small_default = rlt.silu_mul_linear_small(linear_small_default, down_proj.weight)
return (silu_mul_linear_small_default,)
""",
        )
