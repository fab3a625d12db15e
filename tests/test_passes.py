"""FX passes on Dynamo graphs of tiny models: attention swap per platform, dot precision, the manager."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import fx

from rlt_compile.compiler import capture_unit_graph, run_passes
from rlt_compile.kernels.metadata import build_metadata
from rlt_compile.models.registry import build_model
from rlt_compile.passes import AttentionSwapPass, DotPrecisionPass, PassContext, PassManager, build_passes
from rlt_compile.passes.manager import format_graph, is_op, short_name
from rlt_compile.platform import Platform
from rlt_compile.tiny import random_state_dict, tiny_config

ATTN = torch.ops.rlt.attention.default
TORCH_OP = torch.ops.rlt.attention_torch.default
TRITON_OP = torch.ops.rlt.attention_triton.default


def tiny_model(family: str, dtype=torch.float32, **overrides):
    raw = tiny_config(family, **overrides)
    model = build_model(raw)
    model.load_state_dict(random_state_dict(raw, seed=0), strict=False)
    model.tie_weights()
    return model.to(dtype).eval().requires_grad_(False)


def loop_step_inputs(model, num_tokens=3, dtype=torch.float32):
    """Arguments of ``model.loop_step`` for one prefill of ``num_tokens`` tokens."""
    hidden = model.config.n_embd if model.family == "huginn" else model.config.hidden_size
    half = model.rope_params()[0] // 2
    h = torch.randn(num_tokens, hidden, dtype=dtype)
    cos, sin = torch.ones(num_tokens, half), torch.zeros(num_tokens, half)
    planes = model.allocate_kv_cache(2, 16, max_steps=1)
    if model.family == "huginn":  # loop_step gets the core block's planes
        planes = planes[-model.config.n_layers_in_recurrent_block :]
    attn = build_metadata([num_tokens], [0], [[0, 1]], 16)
    if model.family == "huginn":
        return (h, torch.randn_like(h), cos, sin, planes, attn)
    return (h, cos, sin, planes, attn)


@pytest.fixture(scope="module")
def graphs():
    """Pre-pass Dynamo graphs of loop_step, per family (fp32) plus a bf16 Ouro one."""
    out = {}
    for family in ("ouro", "nanbeige", "huginn"):
        model = tiny_model(family)
        out[family] = capture_unit_graph(model, "loop_step", *loop_step_inputs(model))
    model = tiny_model("ouro", torch.bfloat16)
    out["ouro-bf16"] = capture_unit_graph(model, "loop_step", *loop_step_inputs(model, dtype=torch.bfloat16))
    return out


def attention_nodes(gm: fx.GraphModule, op) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_op(n, op)]


EXPECTED_NODES = {"ouro": 2, "nanbeige": 3, "huginn": 2}  # layers per loop step in the tiny configs


@pytest.mark.parametrize("family", ["ouro", "nanbeige", "huginn"])
def test_dynamo_graph_has_one_generic_attention_node_per_layer(graphs, family):
    assert len(attention_nodes(graphs[family], ATTN)) == EXPECTED_NODES[family]


@pytest.mark.parametrize(
    ("kind", "op", "nargs"),
    [("cpu", TORCH_OP, 9), ("cuda", TRITON_OP, 10), ("rocm", TRITON_OP, 10)],
)
@pytest.mark.parametrize("family", ["ouro", "nanbeige", "huginn"])
def test_attention_swap_per_platform(graphs, family, kind, op, nargs, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("RLT_ATTENTION_BACKEND", raising=False)
    gm = copy.deepcopy(graphs[family])
    records = run_passes(gm, Platform.mock(kind), unit="loop_step")
    assert not attention_nodes(gm, ATTN)
    swapped = attention_nodes(gm, op)
    assert len(swapped) == EXPECTED_NODES[family]
    assert all(len(n.args) == nargs and not n.kwargs for n in swapped)
    assert records[0].pass_name == "attention_swap"
    target = "rlt.attention_triton" if op is TRITON_OP else "rlt.attention_torch"
    assert records[0].message.startswith(f"{EXPECTED_NODES[family]} nodes rlt.attention -> {target}")


def test_attention_swap_on_cpu_under_triton_interpret(graphs, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gm = copy.deepcopy(graphs["ouro"])
    run_passes(gm, Platform.mock("cpu"))
    assert len(attention_nodes(gm, TRITON_OP)) == 2
    assert all(n.args[-1] == "ieee" for n in attention_nodes(gm, TRITON_OP))


def test_attention_swap_honours_requested_backend(graphs, monkeypatch):
    monkeypatch.delenv("RLT_ATTENTION_BACKEND", raising=False)
    gm = copy.deepcopy(graphs["ouro"])
    run_passes(gm, Platform.mock("cuda"), attention_backend="torch")
    assert len(attention_nodes(gm, TORCH_OP)) == 2
    monkeypatch.setenv("RLT_ATTENTION_BACKEND", "torch")
    gm = copy.deepcopy(graphs["ouro"])
    run_passes(gm, Platform.mock("rocm"))
    assert len(attention_nodes(gm, TORCH_OP)) == 2


def test_attention_swap_keeps_users_and_meta(graphs):
    gm = copy.deepcopy(graphs["nanbeige"])
    before = [(n.name, len(n.users), n.meta.get("example_value").shape) for n in attention_nodes(gm, ATTN)]
    run_passes(gm, Platform.mock("cuda"))
    after = [(n.name, len(n.users), n.meta.get("example_value").shape) for n in attention_nodes(gm, TRITON_OP)]
    assert before == after


@pytest.mark.parametrize(
    ("kind", "graph", "matmul_precision", "expected"),
    [
        ("cuda", "ouro", "high", "tf32"),  # fp32 caches, tf32 allowed
        ("cuda", "ouro", "highest", "ieee"),  # fp32 caches, tf32 not allowed
        ("cuda", "ouro-bf16", "high", "ieee"),  # bf16: tf32 is meaningless
        ("rocm", "ouro", "high", "ieee"),  # ROCm: always ieee
        ("rocm", "ouro", "highest", "ieee"),
        ("rocm", "ouro-bf16", "high", "ieee"),
    ],
)
def test_dot_precision(graphs, kind, graph, matmul_precision, expected):
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul_precision)
    try:
        gm = copy.deepcopy(graphs[graph])
        records = run_passes(gm, Platform.mock(kind))
    finally:
        torch.set_float32_matmul_precision(old)
    nodes = attention_nodes(gm, TRITON_OP)
    assert [n.args[-1] for n in nodes] == [expected] * 2
    gemv = ["gemv_swap", "fuse_rope_gemv"] if graph.endswith("bf16") and Platform.mock(kind).supports_pdl else []
    assert [r.pass_name for r in records] == ["attention_swap", "dot_precision", "fuse_rmsnorm", *gemv]
    assert f"precision={expected!r}" in records[1].message
    assert kind in records[1].message


def test_dot_precision_alone_ignores_graphs_without_triton_nodes(graphs):
    gm = copy.deepcopy(graphs["ouro"])
    assert run_passes(gm, Platform.mock("rocm"), passes=["dot_precision"]) == []
    assert len(attention_nodes(gm, ATTN)) == 2


def test_no_passes_leaves_the_graph_alone(graphs):
    gm = copy.deepcopy(graphs["huginn"])
    text = format_graph(gm)
    assert run_passes(gm, Platform.mock("cuda"), passes=[]) == []
    assert format_graph(gm) == text


def test_manager_logs_each_change(graphs, caplog):
    gm = copy.deepcopy(graphs["nanbeige"])
    manager = PassManager(build_passes())
    with caplog.at_level(logging.INFO, logger="rlt_compile.passes"):
        manager.run(gm, PassContext(Platform.mock("rocm"), unit="loop_step"))
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("[loop_step] attention_swap: 3 nodes rlt.attention -> rlt.attention_triton")
    assert messages[1].startswith("[loop_step] dot_precision: rlt.attention_triton on rocm: 3 nodes")
    assert messages[2].startswith("[loop_step] fuse_rmsnorm: 7 RMSNorms")
    assert [r.pass_name for r in manager.history] == ["attention_swap", "dot_precision", "fuse_rmsnorm"]


def test_custom_pass_objects_run_in_order(graphs):
    seen = []

    class Probe:
        def __init__(self, name):
            self.name = name

        def run(self, gm, ctx):
            seen.append((self.name, len(attention_nodes(gm, TRITON_OP))))
            return None

    gm = copy.deepcopy(graphs["ouro"])
    run_passes(gm, Platform.mock("cuda"), passes=[Probe("first"), AttentionSwapPass(), Probe("second")])
    assert seen == [("first", 0), ("second", 2)]
    assert isinstance(build_passes(["dot_precision"])[0], DotPrecisionPass)


def test_unknown_pass_names_are_errors():
    with pytest.raises(ValueError, match="unknown pass 'fuse_everything'.*attention_swap"):
        build_passes(["fuse_everything"])
    with pytest.raises(TypeError, match="a pass must be"):
        build_passes([42])


def test_short_names():
    assert (
        short_name("L_self_modules_model_modules_layers_modules_0_modules_mlp_modules_up_proj_parameters_weight_")
        == "model.layers.0.mlp.up_proj.weight"
    )
    assert short_name("L_kv_caches_1_") == "kv_caches.1"
    assert short_name("L_h_") == "h"
    assert short_name("L_attn_slot_mapping") == "attn_slot_mapping"
