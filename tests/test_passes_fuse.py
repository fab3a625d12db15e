"""fuse_linears: q/k/v and gate/up linears sharing an input become one GEMM each; results unchanged."""

from __future__ import annotations

import torch
from test_passes import tiny_model

from rlt_compile.compiler import compile_model
from rlt_compile.kernels.metadata import build_metadata

PASSES = ["attention_swap", "dot_precision", "fuse_linears"]


def run(model_or_cm, planes, qlens, ctx):
    meta = build_metadata(qlens, ctx, [[0, 1], [2, 3]][: len(qlens)], 16)
    gen = torch.Generator().manual_seed(sum(qlens) + sum(ctx))
    ids = torch.randint(0, 256, (sum(qlens),), generator=gen)
    pos = torch.cat([torch.arange(c, c + q) for q, c in zip(qlens, ctx)])
    with torch.no_grad():
        return model_or_cm(ids, pos, planes, meta, torch.cumsum(torch.tensor(qlens), 0) - 1)


def test_fuse_linears_groups_and_keeps_results():
    model, ref = tiny_model("nanbeige"), tiny_model("nanbeige")
    cm = compile_model(model, "cpu", inductor=False, passes=PASSES)
    planes, ref_planes = model.allocate_kv_cache(4, 16), ref.allocate_kv_cache(4, 16)
    for qlens, ctx in (([5, 3], [0, 0]), ([1, 1], [5, 3])):
        torch.testing.assert_close(run(cm, planes, qlens, ctx), run(ref, ref_planes, qlens, ctx), rtol=1e-5, atol=1e-5)
    (record,) = [r for r in cm.pass_log if r.pass_name == "fuse_linears"]
    layers = model.config.num_hidden_layers
    assert record.message.startswith(f"{5 * layers} linears -> {2 * layers} fused GEMMs")
    after = cm.graph_records("loop_step")[0].after
    assert after.count("torch.nn.functional.linear(") == 4 * layers  # qkv, o, gate/up, down
    assert after.count("torch.narrow(") == 5 * layers
    assert cm.graph_counts() == {"embed": 1, "loop_step": 1, "head": 1}  # re-pointing params: no recompile


def test_fuse_linears_stores_weights_once_and_eager_still_works():
    model, ref = tiny_model("ouro"), tiny_model("ouro")
    cm = compile_model(model, "cpu", inductor=False, passes=PASSES)
    planes = model.allocate_kv_cache(4, 16)
    run(cm, planes, [4], [0])
    attn = model.model.layers[0].self_attn
    storage = attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == storage
    assert attn.v_proj.weight.storage_offset() == 2 * attn.q_proj.weight.shape[0] * attn.q_proj.weight.shape[1]
    cm.uninstall()
    ref_planes = ref.allocate_kv_cache(4, 16)
    run(ref, ref_planes, [4], [0])
    torch.testing.assert_close(run(model, planes, [1], [4]), run(ref, ref_planes, [1], [4]), rtol=1e-5, atol=1e-5)


def test_fuse_linears_leaves_huginn_alone():
    """Huginn's checkpoint already fuses q/k/v (Wqkv) and gate/up (fc): nothing to group."""
    model = tiny_model("huginn")
    cm = compile_model(model, "cpu", inductor=False, passes=PASSES, units=["loop_step"])
    planes = model.allocate_kv_cache(4, 16)
    meta = build_metadata([3], [0], [[0]], 16)
    with torch.no_grad():
        cm(torch.tensor([1, 2, 3]), torch.arange(3), planes, meta, num_steps=2, init_scale=0.0)
    assert [r.pass_name for r in cm.pass_log] == ["attention_swap"]
