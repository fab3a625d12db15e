"""expecttest snapshots of the post-pass graph of ``loop_step`` (one-layer tiny models, fp32).

Graph only, no run: Dynamo's graph is captured on the CPU with a recording backend, then our
PassManager runs for a (mock) cpu, cuda and rocm Platform. A change to a pass, or to a model's
loop body, shows up as a diff here. Refresh with ``EXPECTTEST_ACCEPT=1 python -m pytest
tests/test_snapshots.py`` and review the diff. Names are normalised (``format_graph``: inputs
shortened, runtime size assertions left out); fp32 matmul precision is fixed to "high" so the
cuda graphs show the tf32 choice of the dot-precision pass.
"""

from __future__ import annotations

import functools

import expecttest
import pytest
import torch
from test_passes import loop_step_inputs, tiny_model

from rlt_compile.compiler import capture_unit_graph, run_passes
from rlt_compile.passes.manager import format_graph
from rlt_compile.platform import Platform

ONE_LAYER = {
    "ouro": {"num_hidden_layers": 1},
    "nanbeige": {"num_hidden_layers": 1},
    "huginn": {"n_layers_in_recurrent_block": 1},
}


@functools.cache
def _captured(family: str):
    torch.manual_seed(0)
    model = tiny_model(family, **ONE_LAYER[family])
    return capture_unit_graph(model, "loop_step", *loop_step_inputs(model))


def post_pass_graph(family: str, kind: str) -> str:
    import copy

    gm = copy.deepcopy(_captured(family))
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        records = run_passes(gm, Platform.mock(kind), unit="loop_step")
    finally:
        torch.set_float32_matmul_precision(old)
    log = "".join(f"# {r.pass_name}: {r.message}\n" for r in records)
    return log + format_graph(gm, asserts=False)


@pytest.fixture(autouse=True)
def _plain_backend_choice(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("RLT_ATTENTION_BACKEND", raising=False)


class TestLoopStepSnapshots(expecttest.TestCase):
    maxDiff = None

    def test_ouro_cpu(self):
        self.assertExpectedInline(
            post_pass_graph("ouro", "cpu"),
            """\
# attention_swap: 1 nodes rlt.attention -> rlt.attention_torch (backend 'torch' on cpu)
input h_in
input model.layers.0.input_layernorm.weight
input model.layers.0.self_attn.q_proj.weight
input model.layers.0.self_attn.k_proj.weight
input model.layers.0.self_attn.v_proj.weight
input cos_in
input u2
input sin_in
input kv_caches.0
input attn_slot_mapping
input attn_block_tables
input attn_seq_lens
input attn_query_start_loc
input model.layers.0.self_attn.o_proj.weight
input model.layers.0.input_layernorm_2.weight
input model.layers.0.post_attention_layernorm.weight
input model.layers.0.mlp.gate_proj.weight
input model.layers.0.mlp.up_proj.weight
input model.layers.0.mlp.down_proj.weight
input model.layers.0.post_attention_layernorm_2.weight
input model.norm.weight
xf = h_in.float()
pow_1 = xf.pow(2)
mean = pow_1.mean(-1, keepdim=True)
add = add(mean, 1e-06)
rsqrt = torch.rsqrt(add)
xf_1 = mul(xf, rsqrt)
to = xf_1.to(torch.float32)
mul_1 = mul(model.layers.0.input_layernorm.weight, to)
linear = torch.nn.functional.linear(mul_1, model.layers.0.self_attn.q_proj.weight, None)
q = linear.view(u2, 4, 16)
linear_1 = torch.nn.functional.linear(mul_1, model.layers.0.self_attn.k_proj.weight, None)
k = linear_1.view(u2, 4, 16)
linear_2 = torch.nn.functional.linear(mul_1, model.layers.0.self_attn.v_proj.weight, None)
v = linear_2.view(u2, 4, 16)
getitem_2 = getitem(cos_in, (slice(None, None, None), None, slice(None, None, None)))
cos = getitem_2.to(torch.float32)
getitem_3 = getitem(sin_in, (slice(None, None, None), None, slice(None, None, None)))
sin = getitem_3.to(torch.float32)
chunk = q.chunk(2, dim=-1)
x1 = getitem(chunk, 0)
x2 = getitem(chunk, 1)
mul_2 = mul(x1, cos)
neg = neg(x2)
mul_3 = mul(neg, sin)
add_1 = add(mul_2, mul_3)
mul_4 = mul(x2, cos)
mul_5 = mul(x1, sin)
add_2 = add(mul_4, mul_5)
q_1 = torch.cat([add_1, add_2], dim=-1)
getitem_6 = getitem(cos_in, (slice(None, None, None), None, slice(None, None, None)))
cos_1 = getitem_6.to(torch.float32)
getitem_7 = getitem(sin_in, (slice(None, None, None), None, slice(None, None, None)))
sin_1 = getitem_7.to(torch.float32)
chunk_1 = k.chunk(2, dim=-1)
x1_1 = getitem(chunk_1, 0)
x2_1 = getitem(chunk_1, 1)
mul_6 = mul(x1_1, cos_1)
neg_1 = neg(x2_1)
mul_7 = mul(neg_1, sin_1)
add_3 = add(mul_6, mul_7)
mul_8 = mul(x2_1, cos_1)
mul_9 = mul(x1_1, sin_1)
add_4 = add(mul_8, mul_9)
k_1 = torch.cat([add_3, add_4], dim=-1)
out = rlt.attention_torch(q_1, k_1, v, kv_caches.0, attn_slot_mapping, attn_block_tables, attn_seq_lens, attn_query_start_loc, 0.25)
reshape = out.reshape(u2, 64)
linear_3 = torch.nn.functional.linear(reshape, model.layers.0.self_attn.o_proj.weight, None)
xf_2 = linear_3.float()
pow_2 = xf_2.pow(2)
mean_1 = pow_2.mean(-1, keepdim=True)
add_5 = add(mean_1, 1e-06)
rsqrt_1 = torch.rsqrt(add_5)
xf_3 = mul(xf_2, rsqrt_1)
to_5 = xf_3.to(torch.float32)
mul_11 = mul(model.layers.0.input_layernorm_2.weight, to_5)
h = add(h_in, mul_11)
xf_4 = h.float()
pow_3 = xf_4.pow(2)
mean_2 = pow_3.mean(-1, keepdim=True)
add_7 = add(mean_2, 1e-06)
rsqrt_2 = torch.rsqrt(add_7)
xf_5 = mul(xf_4, rsqrt_2)
to_6 = xf_5.to(torch.float32)
mul_13 = mul(model.layers.0.post_attention_layernorm.weight, to_6)
linear_4 = torch.nn.functional.linear(mul_13, model.layers.0.mlp.gate_proj.weight, None)
silu = torch.nn.functional.silu(linear_4)
linear_5 = torch.nn.functional.linear(mul_13, model.layers.0.mlp.up_proj.weight, None)
mul_14 = mul(silu, linear_5)
linear_6 = torch.nn.functional.linear(mul_14, model.layers.0.mlp.down_proj.weight, None)
xf_6 = linear_6.float()
pow_4 = xf_6.pow(2)
mean_3 = pow_4.mean(-1, keepdim=True)
add_8 = add(mean_3, 1e-06)
rsqrt_3 = torch.rsqrt(add_8)
xf_7 = mul(xf_6, rsqrt_3)
to_7 = xf_7.to(torch.float32)
mul_16 = mul(model.layers.0.post_attention_layernorm_2.weight, to_7)
h_1 = add(h, mul_16)
xf_8 = h_1.float()
pow_5 = xf_8.pow(2)
mean_4 = pow_5.mean(-1, keepdim=True)
add_10 = add(mean_4, 1e-06)
rsqrt_4 = torch.rsqrt(add_10)
xf_9 = mul(xf_8, rsqrt_4)
to_8 = xf_9.to(torch.float32)
mul_18 = mul(model.norm.weight, to_8)
return (mul_18,)
""",
        )

    def test_ouro_cuda(self):
        self.assertExpectedInline(
            post_pass_graph("ouro", "cuda"),
            """\
# attention_swap: 1 nodes rlt.attention -> rlt.attention_triton (backend 'triton' on cuda)
# dot_precision: rlt.attention_triton on cuda: 1 nodes (float32 cache) precision='tf32'
# fuse_rmsnorm: 5 RMSNorms + 2 residual adds -> 3 fused ops (2 rlt.add_rmsnorm2, 1 rlt.rmsnorm)
input h
input model.layers.0.input_layernorm.weight
input model.layers.0.self_attn.q_proj.weight
input model.layers.0.self_attn.k_proj.weight
input model.layers.0.self_attn.v_proj.weight
input cos_in
input u2
input sin_in
input kv_caches.0
input attn_slot_mapping
input attn_block_tables
input attn_seq_lens
input attn_query_start_loc
input model.layers.0.self_attn.o_proj.weight
input model.layers.0.input_layernorm_2.weight
input model.layers.0.post_attention_layernorm.weight
input model.layers.0.mlp.gate_proj.weight
input model.layers.0.mlp.up_proj.weight
input model.layers.0.mlp.down_proj.weight
input model.layers.0.post_attention_layernorm_2.weight
input model.norm.weight
rmsnorm_default = rlt.rmsnorm(h, model.layers.0.input_layernorm.weight, 1e-06)
linear = torch.nn.functional.linear(rmsnorm_default, model.layers.0.self_attn.q_proj.weight, None)
q = linear.view(u2, 4, 16)
linear_1 = torch.nn.functional.linear(rmsnorm_default, model.layers.0.self_attn.k_proj.weight, None)
k = linear_1.view(u2, 4, 16)
linear_2 = torch.nn.functional.linear(rmsnorm_default, model.layers.0.self_attn.v_proj.weight, None)
v = linear_2.view(u2, 4, 16)
getitem_2 = getitem(cos_in, (slice(None, None, None), None, slice(None, None, None)))
cos = getitem_2.to(torch.float32)
getitem_3 = getitem(sin_in, (slice(None, None, None), None, slice(None, None, None)))
sin = getitem_3.to(torch.float32)
chunk = q.chunk(2, dim=-1)
x1 = getitem(chunk, 0)
x2 = getitem(chunk, 1)
mul_2 = mul(x1, cos)
neg = neg(x2)
mul_3 = mul(neg, sin)
add_1 = add(mul_2, mul_3)
mul_4 = mul(x2, cos)
mul_5 = mul(x1, sin)
add_2 = add(mul_4, mul_5)
q_1 = torch.cat([add_1, add_2], dim=-1)
getitem_6 = getitem(cos_in, (slice(None, None, None), None, slice(None, None, None)))
cos_1 = getitem_6.to(torch.float32)
getitem_7 = getitem(sin_in, (slice(None, None, None), None, slice(None, None, None)))
sin_1 = getitem_7.to(torch.float32)
chunk_1 = k.chunk(2, dim=-1)
x1_1 = getitem(chunk_1, 0)
x2_1 = getitem(chunk_1, 1)
mul_6 = mul(x1_1, cos_1)
neg_1 = neg(x2_1)
mul_7 = mul(neg_1, sin_1)
add_3 = add(mul_6, mul_7)
mul_8 = mul(x2_1, cos_1)
mul_9 = mul(x1_1, sin_1)
add_4 = add(mul_8, mul_9)
k_1 = torch.cat([add_3, add_4], dim=-1)
out = rlt.attention_triton(q_1, k_1, v, kv_caches.0, attn_slot_mapping, attn_block_tables, attn_seq_lens, attn_query_start_loc, 0.25, 'tf32')
reshape = out.reshape(u2, 64)
linear_3 = torch.nn.functional.linear(reshape, model.layers.0.self_attn.o_proj.weight, None)
add_rmsnorm2_default = rlt.add_rmsnorm2(linear_3, h, model.layers.0.input_layernorm_2.weight, model.layers.0.post_attention_layernorm.weight, 1e-06, 1e-06)
getitem = getitem(add_rmsnorm2_default, 0)
getitem_8 = getitem(add_rmsnorm2_default, 1)
linear_4 = torch.nn.functional.linear(getitem_8, model.layers.0.mlp.gate_proj.weight, None)
silu = torch.nn.functional.silu(linear_4)
linear_5 = torch.nn.functional.linear(getitem_8, model.layers.0.mlp.up_proj.weight, None)
mul_14 = mul(silu, linear_5)
linear_6 = torch.nn.functional.linear(mul_14, model.layers.0.mlp.down_proj.weight, None)
add_rmsnorm2_default_1 = rlt.add_rmsnorm2(linear_6, getitem, model.layers.0.post_attention_layernorm_2.weight, model.norm.weight, 1e-06, 1e-06)
getitem_10 = getitem(add_rmsnorm2_default_1, 1)
return (getitem_10,)
""",
        )

    def test_ouro_rocm(self):
        self.assertExpectedInline(
            post_pass_graph("ouro", "rocm"),
            """\
# attention_swap: 1 nodes rlt.attention -> rlt.attention_triton (backend 'triton' on rocm)
# dot_precision: rlt.attention_triton on rocm: 1 nodes (float32 cache) precision='ieee'
# fuse_rmsnorm: 5 RMSNorms + 2 residual adds -> 3 fused ops (2 rlt.add_rmsnorm2, 1 rlt.rmsnorm)
input h
input model.layers.0.input_layernorm.weight
input model.layers.0.self_attn.q_proj.weight
input model.layers.0.self_attn.k_proj.weight
input model.layers.0.self_attn.v_proj.weight
input cos_in
input u2
input sin_in
input kv_caches.0
input attn_slot_mapping
input attn_block_tables
input attn_seq_lens
input attn_query_start_loc
input model.layers.0.self_attn.o_proj.weight
input model.layers.0.input_layernorm_2.weight
input model.layers.0.post_attention_layernorm.weight
input model.layers.0.mlp.gate_proj.weight
input model.layers.0.mlp.up_proj.weight
input model.layers.0.mlp.down_proj.weight
input model.layers.0.post_attention_layernorm_2.weight
input model.norm.weight
rmsnorm_default = rlt.rmsnorm(h, model.layers.0.input_layernorm.weight, 1e-06)
linear = torch.nn.functional.linear(rmsnorm_default, model.layers.0.self_attn.q_proj.weight, None)
q = linear.view(u2, 4, 16)
linear_1 = torch.nn.functional.linear(rmsnorm_default, model.layers.0.self_attn.k_proj.weight, None)
k = linear_1.view(u2, 4, 16)
linear_2 = torch.nn.functional.linear(rmsnorm_default, model.layers.0.self_attn.v_proj.weight, None)
v = linear_2.view(u2, 4, 16)
getitem_2 = getitem(cos_in, (slice(None, None, None), None, slice(None, None, None)))
cos = getitem_2.to(torch.float32)
getitem_3 = getitem(sin_in, (slice(None, None, None), None, slice(None, None, None)))
sin = getitem_3.to(torch.float32)
chunk = q.chunk(2, dim=-1)
x1 = getitem(chunk, 0)
x2 = getitem(chunk, 1)
mul_2 = mul(x1, cos)
neg = neg(x2)
mul_3 = mul(neg, sin)
add_1 = add(mul_2, mul_3)
mul_4 = mul(x2, cos)
mul_5 = mul(x1, sin)
add_2 = add(mul_4, mul_5)
q_1 = torch.cat([add_1, add_2], dim=-1)
getitem_6 = getitem(cos_in, (slice(None, None, None), None, slice(None, None, None)))
cos_1 = getitem_6.to(torch.float32)
getitem_7 = getitem(sin_in, (slice(None, None, None), None, slice(None, None, None)))
sin_1 = getitem_7.to(torch.float32)
chunk_1 = k.chunk(2, dim=-1)
x1_1 = getitem(chunk_1, 0)
x2_1 = getitem(chunk_1, 1)
mul_6 = mul(x1_1, cos_1)
neg_1 = neg(x2_1)
mul_7 = mul(neg_1, sin_1)
add_3 = add(mul_6, mul_7)
mul_8 = mul(x2_1, cos_1)
mul_9 = mul(x1_1, sin_1)
add_4 = add(mul_8, mul_9)
k_1 = torch.cat([add_3, add_4], dim=-1)
out = rlt.attention_triton(q_1, k_1, v, kv_caches.0, attn_slot_mapping, attn_block_tables, attn_seq_lens, attn_query_start_loc, 0.25, 'ieee')
reshape = out.reshape(u2, 64)
linear_3 = torch.nn.functional.linear(reshape, model.layers.0.self_attn.o_proj.weight, None)
add_rmsnorm2_default = rlt.add_rmsnorm2(linear_3, h, model.layers.0.input_layernorm_2.weight, model.layers.0.post_attention_layernorm.weight, 1e-06, 1e-06)
getitem = getitem(add_rmsnorm2_default, 0)
getitem_8 = getitem(add_rmsnorm2_default, 1)
linear_4 = torch.nn.functional.linear(getitem_8, model.layers.0.mlp.gate_proj.weight, None)
silu = torch.nn.functional.silu(linear_4)
linear_5 = torch.nn.functional.linear(getitem_8, model.layers.0.mlp.up_proj.weight, None)
mul_14 = mul(silu, linear_5)
linear_6 = torch.nn.functional.linear(mul_14, model.layers.0.mlp.down_proj.weight, None)
add_rmsnorm2_default_1 = rlt.add_rmsnorm2(linear_6, getitem, model.layers.0.post_attention_layernorm_2.weight, model.norm.weight, 1e-06, 1e-06)
getitem_10 = getitem(add_rmsnorm2_default_1, 1)
return (getitem_10,)
""",
        )

    def test_nanbeige_cpu(self):
        self.assertExpectedInline(
            post_pass_graph("nanbeige", "cpu"),
            """\
# attention_swap: 1 nodes rlt.attention -> rlt.attention_torch (backend 'torch' on cpu)
input h_in
input model.layers.0.input_layernorm.weight
input model.layers.0.self_attn.q_proj.weight
input model.layers.0.self_attn.k_proj.weight
input model.layers.0.self_attn.v_proj.weight
input cos_in
input u2
input sin_in
input kv_caches.0
input attn_slot_mapping
input attn_block_tables
input attn_seq_lens
input attn_query_start_loc
input model.layers.0.self_attn.o_proj.weight
input model.layers.0.post_attention_layernorm.weight
input model.layers.0.mlp.gate_proj.weight
input model.layers.0.mlp.up_proj.weight
input model.layers.0.mlp.down_proj.weight
input model.norm.weight
xf = h_in.float()
pow_1 = xf.pow(2)
mean = pow_1.mean(-1, keepdim=True)
add = add(mean, 1e-05)
rsqrt = torch.rsqrt(add)
xf_1 = mul(xf, rsqrt)
to = xf_1.to(torch.float32)
mul_1 = mul(model.layers.0.input_layernorm.weight, to)
linear = torch.nn.functional.linear(mul_1, model.layers.0.self_attn.q_proj.weight, None)
q = linear.view(u2, 8, 16)
linear_1 = torch.nn.functional.linear(mul_1, model.layers.0.self_attn.k_proj.weight, None)
k = linear_1.view(u2, 2, 16)
linear_2 = torch.nn.functional.linear(mul_1, model.layers.0.self_attn.v_proj.weight, None)
v = linear_2.view(u2, 2, 16)
getitem_2 = getitem(cos_in, (slice(None, None, None), None, slice(None, None, None)))
cos = getitem_2.to(torch.float32)
getitem_3 = getitem(sin_in, (slice(None, None, None), None, slice(None, None, None)))
sin = getitem_3.to(torch.float32)
chunk = q.chunk(2, dim=-1)
x1 = getitem(chunk, 0)
x2 = getitem(chunk, 1)
mul_2 = mul(x1, cos)
neg = neg(x2)
mul_3 = mul(neg, sin)
add_1 = add(mul_2, mul_3)
mul_4 = mul(x2, cos)
mul_5 = mul(x1, sin)
add_2 = add(mul_4, mul_5)
q_1 = torch.cat([add_1, add_2], dim=-1)
getitem_6 = getitem(cos_in, (slice(None, None, None), None, slice(None, None, None)))
cos_1 = getitem_6.to(torch.float32)
getitem_7 = getitem(sin_in, (slice(None, None, None), None, slice(None, None, None)))
sin_1 = getitem_7.to(torch.float32)
chunk_1 = k.chunk(2, dim=-1)
x1_1 = getitem(chunk_1, 0)
x2_1 = getitem(chunk_1, 1)
mul_6 = mul(x1_1, cos_1)
neg_1 = neg(x2_1)
mul_7 = mul(neg_1, sin_1)
add_3 = add(mul_6, mul_7)
mul_8 = mul(x2_1, cos_1)
mul_9 = mul(x1_1, sin_1)
add_4 = add(mul_8, mul_9)
k_1 = torch.cat([add_3, add_4], dim=-1)
out = rlt.attention_torch(q_1, k_1, v, kv_caches.0, attn_slot_mapping, attn_block_tables, attn_seq_lens, attn_query_start_loc, 0.25)
reshape = out.reshape(u2, 128)
linear_3 = torch.nn.functional.linear(reshape, model.layers.0.self_attn.o_proj.weight, None)
h = add(h_in, linear_3)
xf_2 = h.float()
pow_2 = xf_2.pow(2)
mean_1 = pow_2.mean(-1, keepdim=True)
add_6 = add(mean_1, 1e-05)
rsqrt_1 = torch.rsqrt(add_6)
xf_3 = mul(xf_2, rsqrt_1)
to_5 = xf_3.to(torch.float32)
mul_11 = mul(model.layers.0.post_attention_layernorm.weight, to_5)
linear_4 = torch.nn.functional.linear(mul_11, model.layers.0.mlp.gate_proj.weight, None)
silu = torch.nn.functional.silu(linear_4)
linear_5 = torch.nn.functional.linear(mul_11, model.layers.0.mlp.up_proj.weight, None)
mul_12 = mul(silu, linear_5)
linear_6 = torch.nn.functional.linear(mul_12, model.layers.0.mlp.down_proj.weight, None)
h_1 = add(h, linear_6)
xf_4 = h_1.float()
pow_3 = xf_4.pow(2)
mean_2 = pow_3.mean(-1, keepdim=True)
add_8 = add(mean_2, 1e-05)
rsqrt_2 = torch.rsqrt(add_8)
xf_5 = mul(xf_4, rsqrt_2)
to_6 = xf_5.to(torch.float32)
mul_14 = mul(model.norm.weight, to_6)
return (mul_14,)
""",
        )

    def test_nanbeige_cuda(self):
        self.assertExpectedInline(
            post_pass_graph("nanbeige", "cuda"),
            """\
# attention_swap: 1 nodes rlt.attention -> rlt.attention_triton (backend 'triton' on cuda)
# dot_precision: rlt.attention_triton on cuda: 1 nodes (float32 cache) precision='tf32'
# fuse_rmsnorm: 3 RMSNorms + 2 residual adds -> 3 fused ops (2 rlt.add_rmsnorm, 1 rlt.rmsnorm)
input h
input model.layers.0.input_layernorm.weight
input model.layers.0.self_attn.q_proj.weight
input model.layers.0.self_attn.k_proj.weight
input model.layers.0.self_attn.v_proj.weight
input cos_in
input u2
input sin_in
input kv_caches.0
input attn_slot_mapping
input attn_block_tables
input attn_seq_lens
input attn_query_start_loc
input model.layers.0.self_attn.o_proj.weight
input model.layers.0.post_attention_layernorm.weight
input model.layers.0.mlp.gate_proj.weight
input model.layers.0.mlp.up_proj.weight
input model.layers.0.mlp.down_proj.weight
input model.norm.weight
rmsnorm_default = rlt.rmsnorm(h, model.layers.0.input_layernorm.weight, 1e-05)
linear = torch.nn.functional.linear(rmsnorm_default, model.layers.0.self_attn.q_proj.weight, None)
q = linear.view(u2, 8, 16)
linear_1 = torch.nn.functional.linear(rmsnorm_default, model.layers.0.self_attn.k_proj.weight, None)
k = linear_1.view(u2, 2, 16)
linear_2 = torch.nn.functional.linear(rmsnorm_default, model.layers.0.self_attn.v_proj.weight, None)
v = linear_2.view(u2, 2, 16)
getitem_2 = getitem(cos_in, (slice(None, None, None), None, slice(None, None, None)))
cos = getitem_2.to(torch.float32)
getitem_3 = getitem(sin_in, (slice(None, None, None), None, slice(None, None, None)))
sin = getitem_3.to(torch.float32)
chunk = q.chunk(2, dim=-1)
x1 = getitem(chunk, 0)
x2 = getitem(chunk, 1)
mul_2 = mul(x1, cos)
neg = neg(x2)
mul_3 = mul(neg, sin)
add_1 = add(mul_2, mul_3)
mul_4 = mul(x2, cos)
mul_5 = mul(x1, sin)
add_2 = add(mul_4, mul_5)
q_1 = torch.cat([add_1, add_2], dim=-1)
getitem_6 = getitem(cos_in, (slice(None, None, None), None, slice(None, None, None)))
cos_1 = getitem_6.to(torch.float32)
getitem_7 = getitem(sin_in, (slice(None, None, None), None, slice(None, None, None)))
sin_1 = getitem_7.to(torch.float32)
chunk_1 = k.chunk(2, dim=-1)
x1_1 = getitem(chunk_1, 0)
x2_1 = getitem(chunk_1, 1)
mul_6 = mul(x1_1, cos_1)
neg_1 = neg(x2_1)
mul_7 = mul(neg_1, sin_1)
add_3 = add(mul_6, mul_7)
mul_8 = mul(x2_1, cos_1)
mul_9 = mul(x1_1, sin_1)
add_4 = add(mul_8, mul_9)
k_1 = torch.cat([add_3, add_4], dim=-1)
out = rlt.attention_triton(q_1, k_1, v, kv_caches.0, attn_slot_mapping, attn_block_tables, attn_seq_lens, attn_query_start_loc, 0.25, 'tf32')
reshape = out.reshape(u2, 128)
linear_3 = torch.nn.functional.linear(reshape, model.layers.0.self_attn.o_proj.weight, None)
add_rmsnorm_default = rlt.add_rmsnorm(h, linear_3, model.layers.0.post_attention_layernorm.weight, 1e-05)
getitem = getitem(add_rmsnorm_default, 0)
getitem_8 = getitem(add_rmsnorm_default, 1)
linear_4 = torch.nn.functional.linear(getitem_8, model.layers.0.mlp.gate_proj.weight, None)
silu = torch.nn.functional.silu(linear_4)
linear_5 = torch.nn.functional.linear(getitem_8, model.layers.0.mlp.up_proj.weight, None)
mul_12 = mul(silu, linear_5)
linear_6 = torch.nn.functional.linear(mul_12, model.layers.0.mlp.down_proj.weight, None)
add_rmsnorm_default_1 = rlt.add_rmsnorm(getitem, linear_6, model.norm.weight, 1e-05)
getitem_10 = getitem(add_rmsnorm_default_1, 1)
return (getitem_10,)
""",
        )

    def test_nanbeige_rocm(self):
        self.assertExpectedInline(
            post_pass_graph("nanbeige", "rocm"),
            """\
# attention_swap: 1 nodes rlt.attention -> rlt.attention_triton (backend 'triton' on rocm)
# dot_precision: rlt.attention_triton on rocm: 1 nodes (float32 cache) precision='ieee'
# fuse_rmsnorm: 3 RMSNorms + 2 residual adds -> 3 fused ops (2 rlt.add_rmsnorm, 1 rlt.rmsnorm)
input h
input model.layers.0.input_layernorm.weight
input model.layers.0.self_attn.q_proj.weight
input model.layers.0.self_attn.k_proj.weight
input model.layers.0.self_attn.v_proj.weight
input cos_in
input u2
input sin_in
input kv_caches.0
input attn_slot_mapping
input attn_block_tables
input attn_seq_lens
input attn_query_start_loc
input model.layers.0.self_attn.o_proj.weight
input model.layers.0.post_attention_layernorm.weight
input model.layers.0.mlp.gate_proj.weight
input model.layers.0.mlp.up_proj.weight
input model.layers.0.mlp.down_proj.weight
input model.norm.weight
rmsnorm_default = rlt.rmsnorm(h, model.layers.0.input_layernorm.weight, 1e-05)
linear = torch.nn.functional.linear(rmsnorm_default, model.layers.0.self_attn.q_proj.weight, None)
q = linear.view(u2, 8, 16)
linear_1 = torch.nn.functional.linear(rmsnorm_default, model.layers.0.self_attn.k_proj.weight, None)
k = linear_1.view(u2, 2, 16)
linear_2 = torch.nn.functional.linear(rmsnorm_default, model.layers.0.self_attn.v_proj.weight, None)
v = linear_2.view(u2, 2, 16)
getitem_2 = getitem(cos_in, (slice(None, None, None), None, slice(None, None, None)))
cos = getitem_2.to(torch.float32)
getitem_3 = getitem(sin_in, (slice(None, None, None), None, slice(None, None, None)))
sin = getitem_3.to(torch.float32)
chunk = q.chunk(2, dim=-1)
x1 = getitem(chunk, 0)
x2 = getitem(chunk, 1)
mul_2 = mul(x1, cos)
neg = neg(x2)
mul_3 = mul(neg, sin)
add_1 = add(mul_2, mul_3)
mul_4 = mul(x2, cos)
mul_5 = mul(x1, sin)
add_2 = add(mul_4, mul_5)
q_1 = torch.cat([add_1, add_2], dim=-1)
getitem_6 = getitem(cos_in, (slice(None, None, None), None, slice(None, None, None)))
cos_1 = getitem_6.to(torch.float32)
getitem_7 = getitem(sin_in, (slice(None, None, None), None, slice(None, None, None)))
sin_1 = getitem_7.to(torch.float32)
chunk_1 = k.chunk(2, dim=-1)
x1_1 = getitem(chunk_1, 0)
x2_1 = getitem(chunk_1, 1)
mul_6 = mul(x1_1, cos_1)
neg_1 = neg(x2_1)
mul_7 = mul(neg_1, sin_1)
add_3 = add(mul_6, mul_7)
mul_8 = mul(x2_1, cos_1)
mul_9 = mul(x1_1, sin_1)
add_4 = add(mul_8, mul_9)
k_1 = torch.cat([add_3, add_4], dim=-1)
out = rlt.attention_triton(q_1, k_1, v, kv_caches.0, attn_slot_mapping, attn_block_tables, attn_seq_lens, attn_query_start_loc, 0.25, 'ieee')
reshape = out.reshape(u2, 128)
linear_3 = torch.nn.functional.linear(reshape, model.layers.0.self_attn.o_proj.weight, None)
add_rmsnorm_default = rlt.add_rmsnorm(h, linear_3, model.layers.0.post_attention_layernorm.weight, 1e-05)
getitem = getitem(add_rmsnorm_default, 0)
getitem_8 = getitem(add_rmsnorm_default, 1)
linear_4 = torch.nn.functional.linear(getitem_8, model.layers.0.mlp.gate_proj.weight, None)
silu = torch.nn.functional.silu(linear_4)
linear_5 = torch.nn.functional.linear(getitem_8, model.layers.0.mlp.up_proj.weight, None)
mul_12 = mul(silu, linear_5)
linear_6 = torch.nn.functional.linear(mul_12, model.layers.0.mlp.down_proj.weight, None)
add_rmsnorm_default_1 = rlt.add_rmsnorm(getitem, linear_6, model.norm.weight, 1e-05)
getitem_10 = getitem(add_rmsnorm_default_1, 1)
return (getitem_10,)
""",
        )

    def test_huginn_cpu(self):
        self.assertExpectedInline(
            post_pass_graph("huginn", "cpu"),
            """\
# attention_swap: 1 nodes rlt.attention -> rlt.attention_torch (backend 'torch' on cpu)
input s_in
input e
input transformer.adapter.weight
input transformer.core_block.0.norm_1.weight
input transformer.core_block.0.attn.wqkv.weight
input transformer.core_block.0.attn.qk_bias
input cos
input u3
input sin
input kv_caches.0
input attn_slot_mapping
input attn_block_tables
input attn_seq_lens
input attn_query_start_loc
input transformer.core_block.0.attn.proj.weight
input transformer.core_block.0.norm_2.weight
input transformer.core_block.0.norm_3.weight
input transformer.core_block.0.mlp.fc.weight
input transformer.core_block.0.mlp.proj.weight
input transformer.core_block.0.norm_4.weight
cat = torch.cat([s_in, e], dim=-1)
s = torch.nn.functional.linear(cat, transformer.adapter.weight, None)
xf = s.float()
pow_1 = xf.pow(2)
mean = pow_1.mean(-1, keepdim=True)
add = add(mean, 1e-06)
rsqrt = torch.rsqrt(add)
xf_1 = mul(xf, rsqrt)
to = xf_1.to(torch.float32)
mul_1 = mul(transformer.core_block.0.norm_1.weight, to)
linear_1 = torch.nn.functional.linear(mul_1, transformer.core_block.0.attn.wqkv.weight, None)
view = linear_1.view(u3, 3, 4, 16)
unbind = view.unbind(1)
q = getitem(unbind, 0)
k = getitem(unbind, 1)
v = getitem(unbind, 2)
getitem_5 = getitem(transformer.core_block.0.attn.qk_bias, 0)
q_1 = add(q, getitem_5)
getitem_6 = getitem(transformer.core_block.0.attn.qk_bias, 1)
k_1 = add(k, getitem_6)
float_2 = q_1.float()
pairs = float_2.unflatten(-1, (-1, 2))
c = getitem(cos, (slice(None, None, None), None, slice(None, None, None)))
s_1 = getitem(sin, (slice(None, None, None), None, slice(None, None, None)))
getitem_9 = getitem(pairs, (Ellipsis, 0))
mul_2 = mul(getitem_9, c)
getitem_10 = getitem(pairs, (Ellipsis, 1))
mul_3 = mul(getitem_10, s_1)
real = sub(mul_2, mul_3)
getitem_11 = getitem(pairs, (Ellipsis, 1))
mul_4 = mul(getitem_11, c)
getitem_12 = getitem(pairs, (Ellipsis, 0))
mul_5 = mul(getitem_12, s_1)
imag = add(mul_4, mul_5)
stack = torch.stack([real, imag], dim=-1)
flatten = stack.flatten(-2)
q_2 = flatten.to(torch.float32)
float_3 = k_1.float()
pairs_1 = float_3.unflatten(-1, (-1, 2))
c_1 = getitem(cos, (slice(None, None, None), None, slice(None, None, None)))
s_2 = getitem(sin, (slice(None, None, None), None, slice(None, None, None)))
getitem_15 = getitem(pairs_1, (Ellipsis, 0))
mul_6 = mul(getitem_15, c_1)
getitem_16 = getitem(pairs_1, (Ellipsis, 1))
mul_7 = mul(getitem_16, s_2)
real_1 = sub(mul_6, mul_7)
getitem_17 = getitem(pairs_1, (Ellipsis, 1))
mul_8 = mul(getitem_17, c_1)
getitem_18 = getitem(pairs_1, (Ellipsis, 0))
mul_9 = mul(getitem_18, s_2)
imag_1 = add(mul_8, mul_9)
stack_1 = torch.stack([real_1, imag_1], dim=-1)
flatten_1 = stack_1.flatten(-2)
k_2 = flatten_1.to(torch.float32)
out = rlt.attention_torch(q_2, k_2, v, kv_caches.0, attn_slot_mapping, attn_block_tables, attn_seq_lens, attn_query_start_loc, 0.25)
reshape = out.reshape(u3, 64)
linear_2 = torch.nn.functional.linear(reshape, transformer.core_block.0.attn.proj.weight, None)
add_5 = add(linear_2, s)
xf_2 = add_5.float()
pow_2 = xf_2.pow(2)
mean_1 = pow_2.mean(-1, keepdim=True)
add_6 = add(mean_1, 1e-06)
rsqrt_1 = torch.rsqrt(add_6)
xf_3 = mul(xf_2, rsqrt_1)
to_3 = xf_3.to(torch.float32)
x = mul(transformer.core_block.0.norm_2.weight, to_3)
xf_4 = x.float()
pow_3 = xf_4.pow(2)
mean_2 = pow_3.mean(-1, keepdim=True)
add_7 = add(mean_2, 1e-06)
rsqrt_2 = torch.rsqrt(add_7)
xf_5 = mul(xf_4, rsqrt_2)
to_4 = xf_5.to(torch.float32)
mul_13 = mul(transformer.core_block.0.norm_3.weight, to_4)
linear_3 = torch.nn.functional.linear(mul_13, transformer.core_block.0.mlp.fc.weight, None)
chunk = linear_3.chunk(2, dim=-1)
gate = getitem(chunk, 0)
up = getitem(chunk, 1)
silu = torch.nn.functional.silu(gate)
mul_14 = mul(silu, up)
linear_4 = torch.nn.functional.linear(mul_14, transformer.core_block.0.mlp.proj.weight, None)
add_8 = add(linear_4, x)
xf_6 = add_8.float()
pow_4 = xf_6.pow(2)
mean_3 = pow_4.mean(-1, keepdim=True)
add_9 = add(mean_3, 1e-06)
rsqrt_3 = torch.rsqrt(add_9)
xf_7 = mul(xf_6, rsqrt_3)
to_5 = xf_7.to(torch.float32)
s_3 = mul(transformer.core_block.0.norm_4.weight, to_5)
return (s_3,)
""",
        )

    def test_huginn_cuda(self):
        self.assertExpectedInline(
            post_pass_graph("huginn", "cuda"),
            """\
# attention_swap: 1 nodes rlt.attention -> rlt.attention_triton (backend 'triton' on cuda)
# dot_precision: rlt.attention_triton on cuda: 1 nodes (float32 cache) precision='tf32'
# fuse_rmsnorm: 4 RMSNorms + 2 residual adds -> 3 fused ops (1 rlt.add_rmsnorm_rmsnorm, 1 rlt.add_rmsnorm, 1 rlt.rmsnorm)
input s_in
input e
input transformer.adapter.weight
input transformer.core_block.0.norm_1.weight
input transformer.core_block.0.attn.wqkv.weight
input transformer.core_block.0.attn.qk_bias
input cos
input u3
input sin
input kv_caches.0
input attn_slot_mapping
input attn_block_tables
input attn_seq_lens
input attn_query_start_loc
input transformer.core_block.0.attn.proj.weight
input transformer.core_block.0.norm_2.weight
input transformer.core_block.0.norm_3.weight
input transformer.core_block.0.mlp.fc.weight
input transformer.core_block.0.mlp.proj.weight
input transformer.core_block.0.norm_4.weight
cat = torch.cat([s_in, e], dim=-1)
s = torch.nn.functional.linear(cat, transformer.adapter.weight, None)
rmsnorm_default = rlt.rmsnorm(s, transformer.core_block.0.norm_1.weight, 1e-06)
linear_1 = torch.nn.functional.linear(rmsnorm_default, transformer.core_block.0.attn.wqkv.weight, None)
view = linear_1.view(u3, 3, 4, 16)
unbind = view.unbind(1)
q = getitem(unbind, 0)
k = getitem(unbind, 1)
v = getitem(unbind, 2)
getitem_5 = getitem(transformer.core_block.0.attn.qk_bias, 0)
q_1 = add(q, getitem_5)
getitem_6 = getitem(transformer.core_block.0.attn.qk_bias, 1)
k_1 = add(k, getitem_6)
float_2 = q_1.float()
pairs = float_2.unflatten(-1, (-1, 2))
c = getitem(cos, (slice(None, None, None), None, slice(None, None, None)))
s_1 = getitem(sin, (slice(None, None, None), None, slice(None, None, None)))
getitem_9 = getitem(pairs, (Ellipsis, 0))
mul_2 = mul(getitem_9, c)
getitem_10 = getitem(pairs, (Ellipsis, 1))
mul_3 = mul(getitem_10, s_1)
real = sub(mul_2, mul_3)
getitem_11 = getitem(pairs, (Ellipsis, 1))
mul_4 = mul(getitem_11, c)
getitem_12 = getitem(pairs, (Ellipsis, 0))
mul_5 = mul(getitem_12, s_1)
imag = add(mul_4, mul_5)
stack = torch.stack([real, imag], dim=-1)
flatten = stack.flatten(-2)
q_2 = flatten.to(torch.float32)
float_3 = k_1.float()
pairs_1 = float_3.unflatten(-1, (-1, 2))
c_1 = getitem(cos, (slice(None, None, None), None, slice(None, None, None)))
s_2 = getitem(sin, (slice(None, None, None), None, slice(None, None, None)))
getitem_15 = getitem(pairs_1, (Ellipsis, 0))
mul_6 = mul(getitem_15, c_1)
getitem_16 = getitem(pairs_1, (Ellipsis, 1))
mul_7 = mul(getitem_16, s_2)
real_1 = sub(mul_6, mul_7)
getitem_17 = getitem(pairs_1, (Ellipsis, 1))
mul_8 = mul(getitem_17, c_1)
getitem_18 = getitem(pairs_1, (Ellipsis, 0))
mul_9 = mul(getitem_18, s_2)
imag_1 = add(mul_8, mul_9)
stack_1 = torch.stack([real_1, imag_1], dim=-1)
flatten_1 = stack_1.flatten(-2)
k_2 = flatten_1.to(torch.float32)
out = rlt.attention_triton(q_2, k_2, v, kv_caches.0, attn_slot_mapping, attn_block_tables, attn_seq_lens, attn_query_start_loc, 0.25, 'tf32')
reshape = out.reshape(u3, 64)
linear_2 = torch.nn.functional.linear(reshape, transformer.core_block.0.attn.proj.weight, None)
add_rmsnorm_rmsnorm_default = rlt.add_rmsnorm_rmsnorm(linear_2, s, transformer.core_block.0.norm_2.weight, transformer.core_block.0.norm_3.weight, 1e-06, 1e-06)
getitem = getitem(add_rmsnorm_rmsnorm_default, 0)
getitem_19 = getitem(add_rmsnorm_rmsnorm_default, 1)
linear_3 = torch.nn.functional.linear(getitem_19, transformer.core_block.0.mlp.fc.weight, None)
chunk = linear_3.chunk(2, dim=-1)
gate = getitem(chunk, 0)
up = getitem(chunk, 1)
silu = torch.nn.functional.silu(gate)
mul_14 = mul(silu, up)
linear_4 = torch.nn.functional.linear(mul_14, transformer.core_block.0.mlp.proj.weight, None)
add_rmsnorm_default = rlt.add_rmsnorm(linear_4, getitem, transformer.core_block.0.norm_4.weight, 1e-06)
getitem_21 = getitem(add_rmsnorm_default, 1)
return (getitem_21,)
""",
        )

    def test_huginn_rocm(self):
        self.assertExpectedInline(
            post_pass_graph("huginn", "rocm"),
            """\
# attention_swap: 1 nodes rlt.attention -> rlt.attention_triton (backend 'triton' on rocm)
# dot_precision: rlt.attention_triton on rocm: 1 nodes (float32 cache) precision='ieee'
# fuse_rmsnorm: 4 RMSNorms + 2 residual adds -> 3 fused ops (1 rlt.add_rmsnorm_rmsnorm, 1 rlt.add_rmsnorm, 1 rlt.rmsnorm)
input s_in
input e
input transformer.adapter.weight
input transformer.core_block.0.norm_1.weight
input transformer.core_block.0.attn.wqkv.weight
input transformer.core_block.0.attn.qk_bias
input cos
input u3
input sin
input kv_caches.0
input attn_slot_mapping
input attn_block_tables
input attn_seq_lens
input attn_query_start_loc
input transformer.core_block.0.attn.proj.weight
input transformer.core_block.0.norm_2.weight
input transformer.core_block.0.norm_3.weight
input transformer.core_block.0.mlp.fc.weight
input transformer.core_block.0.mlp.proj.weight
input transformer.core_block.0.norm_4.weight
cat = torch.cat([s_in, e], dim=-1)
s = torch.nn.functional.linear(cat, transformer.adapter.weight, None)
rmsnorm_default = rlt.rmsnorm(s, transformer.core_block.0.norm_1.weight, 1e-06)
linear_1 = torch.nn.functional.linear(rmsnorm_default, transformer.core_block.0.attn.wqkv.weight, None)
view = linear_1.view(u3, 3, 4, 16)
unbind = view.unbind(1)
q = getitem(unbind, 0)
k = getitem(unbind, 1)
v = getitem(unbind, 2)
getitem_5 = getitem(transformer.core_block.0.attn.qk_bias, 0)
q_1 = add(q, getitem_5)
getitem_6 = getitem(transformer.core_block.0.attn.qk_bias, 1)
k_1 = add(k, getitem_6)
float_2 = q_1.float()
pairs = float_2.unflatten(-1, (-1, 2))
c = getitem(cos, (slice(None, None, None), None, slice(None, None, None)))
s_1 = getitem(sin, (slice(None, None, None), None, slice(None, None, None)))
getitem_9 = getitem(pairs, (Ellipsis, 0))
mul_2 = mul(getitem_9, c)
getitem_10 = getitem(pairs, (Ellipsis, 1))
mul_3 = mul(getitem_10, s_1)
real = sub(mul_2, mul_3)
getitem_11 = getitem(pairs, (Ellipsis, 1))
mul_4 = mul(getitem_11, c)
getitem_12 = getitem(pairs, (Ellipsis, 0))
mul_5 = mul(getitem_12, s_1)
imag = add(mul_4, mul_5)
stack = torch.stack([real, imag], dim=-1)
flatten = stack.flatten(-2)
q_2 = flatten.to(torch.float32)
float_3 = k_1.float()
pairs_1 = float_3.unflatten(-1, (-1, 2))
c_1 = getitem(cos, (slice(None, None, None), None, slice(None, None, None)))
s_2 = getitem(sin, (slice(None, None, None), None, slice(None, None, None)))
getitem_15 = getitem(pairs_1, (Ellipsis, 0))
mul_6 = mul(getitem_15, c_1)
getitem_16 = getitem(pairs_1, (Ellipsis, 1))
mul_7 = mul(getitem_16, s_2)
real_1 = sub(mul_6, mul_7)
getitem_17 = getitem(pairs_1, (Ellipsis, 1))
mul_8 = mul(getitem_17, c_1)
getitem_18 = getitem(pairs_1, (Ellipsis, 0))
mul_9 = mul(getitem_18, s_2)
imag_1 = add(mul_8, mul_9)
stack_1 = torch.stack([real_1, imag_1], dim=-1)
flatten_1 = stack_1.flatten(-2)
k_2 = flatten_1.to(torch.float32)
out = rlt.attention_triton(q_2, k_2, v, kv_caches.0, attn_slot_mapping, attn_block_tables, attn_seq_lens, attn_query_start_loc, 0.25, 'ieee')
reshape = out.reshape(u3, 64)
linear_2 = torch.nn.functional.linear(reshape, transformer.core_block.0.attn.proj.weight, None)
add_rmsnorm_rmsnorm_default = rlt.add_rmsnorm_rmsnorm(linear_2, s, transformer.core_block.0.norm_2.weight, transformer.core_block.0.norm_3.weight, 1e-06, 1e-06)
getitem = getitem(add_rmsnorm_rmsnorm_default, 0)
getitem_19 = getitem(add_rmsnorm_rmsnorm_default, 1)
linear_3 = torch.nn.functional.linear(getitem_19, transformer.core_block.0.mlp.fc.weight, None)
chunk = linear_3.chunk(2, dim=-1)
gate = getitem(chunk, 0)
up = getitem(chunk, 1)
silu = torch.nn.functional.silu(gate)
mul_14 = mul(silu, up)
linear_4 = torch.nn.functional.linear(mul_14, transformer.core_block.0.mlp.proj.weight, None)
add_rmsnorm_default = rlt.add_rmsnorm(linear_4, getitem, transformer.core_block.0.norm_4.weight, 1e-06)
getitem_21 = getitem(add_rmsnorm_default, 1)
return (getitem_21,)
""",
        )
