"""Graph counts: one Dynamo graph per compile unit, whatever the loop count, recurrence count, token
count, batch size or block-table width; no recompile under ``set_stance("fail_on_recompile")``.

These run the post-pass FX graphs without Inductor (``inductor=False``): graph capture and guards
are Dynamo's business, and this keeps the file fast. test_compiler.py covers Inductor.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from torch._dynamo.utils import counters

from rlt_compile.compiler import compile_model
from rlt_compile.kernels.metadata import build_metadata

BLOCK = 16


def tiny(family: str):
    return tiny_model(family, seed=2)


def step(cm, planes, qlens, ctx, **opts):
    """One forward of a batch with query lengths ``qlens`` after ``ctx`` cached tokens each."""
    tables = [[2 * i + b for b in range(-(-(q + c) // BLOCK))] for i, (q, c) in enumerate(zip(qlens, ctx))]
    meta = build_metadata(qlens, ctx, tables, BLOCK)
    ids = torch.randint(0, 256, (sum(qlens),))
    pos = torch.cat([torch.arange(c, c + q) for q, c in zip(qlens, ctx)])
    last = torch.cumsum(torch.tensor(qlens), 0) - 1
    return cm(ids, pos, planes, meta, last, **opts)


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_huginn_recurrences_change_without_recompile():
    model = tiny("huginn")
    cm = compile_model(model, "cpu", inductor=False)
    planes = model.allocate_kv_cache(8, BLOCK, max_steps=16)
    step(cm, planes, [7], [0], num_steps=4, init_scale=0.0)
    counts, graphs = cm.graph_counts(), unique_graphs()
    assert counts == {"prelude": 1, "loop_step": 1, "coda": 1}
    with torch.compiler.set_stance("fail_on_recompile"):
        for r in (1, 16, 3):
            step(cm, planes, [1], [7], num_steps=r, init_scale=0.0)
            step(cm, planes, [3, 2], [0, 0], num_steps=r, init_scale=0.0)
    assert cm.graph_counts() == counts
    assert unique_graphs() == graphs


def test_ouro_loop_count_changes_recompile_only_the_head():
    """Ouro's loop body is compiled once for any loop count. Its head takes the stacked per-step
    states [steps, rows, hidden] and builds the exit distribution over the steps, so it is compiled
    once per distinct loop count (a config constant in practice)."""
    model = tiny("ouro")
    cm = compile_model(model, "cpu", inductor=False)
    planes = model.allocate_kv_cache(8, BLOCK, max_steps=8)
    step(cm, planes, [5], [0], num_steps=4)
    for steps in (1, 2, 8):
        step(cm, planes, [1], [5], num_steps=steps)
    assert cm.graph_counts() == {"embed": 1, "loop_step": 1, "head": 4}
    with torch.compiler.set_stance("fail_on_recompile"):
        for steps in (8, 1, 4, 2):
            step(cm, planes, [1, 1], [6, 3], num_steps=steps)
    assert cm.graph_counts() == {"embed": 1, "loop_step": 1, "head": 4}


@pytest.mark.parametrize("family", ["ouro", "nanbeige", "huginn"])
def test_graph_is_the_same_for_any_loop_count(family):
    """The loop body's graph (and so its compile cost) does not depend on how many steps run."""
    texts, counts = [], []
    for steps in (1, 6):
        model = tiny(family)
        cm = compile_model(model, "cpu", inductor=False)
        planes = model.allocate_kv_cache(8, BLOCK, max_steps=6)
        opts = {"init_scale": 0.0} if family == "huginn" else {}
        step(cm, planes, [4], [0], num_steps=steps, **opts)
        texts.append(cm.graph_records("loop_step")[0].after)
        counts.append(cm.graph_counts())
    assert texts[0] == texts[1]
    assert counts[0] == counts[1] == dict.fromkeys(counts[0], 1)


def test_token_counts_batch_sizes_and_table_widths_do_not_recompile():
    model = tiny("nanbeige")
    cm = compile_model(model, "cpu", inductor=False)
    planes = model.allocate_kv_cache(16, BLOCK)
    step(cm, planes, [9, 4], [0, 0])
    counts = cm.graph_counts()
    with torch.compiler.set_stance("fail_on_recompile"):
        step(cm, planes, [1], [9])  # one token, one sequence (sizes 0/1 are not specialised)
        step(cm, planes, [1, 1], [9, 4])
        step(cm, planes, [1, 1, 1, 1], [3, 3, 3, 3])
        step(cm, planes, [33], [0])  # wider block table
        step(cm, planes, [2, 17, 1], [5, 0, 30])
    assert cm.graph_counts() == counts == {"embed": 1, "loop_step": 1, "head": 1}
    # another KV cache of another size: still no recompile (num_blocks is dynamic too)
    with torch.compiler.set_stance("fail_on_recompile"):
        step(cm, model.allocate_kv_cache(24, BLOCK), [3], [0])
    assert cm.graph_counts() == counts


def test_static_shapes_would_recompile():
    """Negative control: without the dynamic token dims every new token count is a new graph."""
    model = tiny("nanbeige")
    cm = compile_model(model, "cpu", inductor=False, dynamic="static")
    planes = model.allocate_kv_cache(8, BLOCK)
    step(cm, planes, [5], [0])
    with torch.compiler.set_stance("fail_on_recompile"), pytest.raises(Exception, match="[Rr]ecompil"):
        step(cm, planes, [1], [5])


def test_each_compiled_model_has_its_own_dynamo_cache():
    """Compiling many models (or one model with many option sets) never reaches recompile_limit (8):
    each CompiledModel traces a private copy of the unit's code. (Sharing the method's code, the
    9th compile_model of the same class would raise: fullgraph=True turns the limit into an error.)"""
    limit = torch._dynamo.config.recompile_limit
    model = tiny("ouro")
    planes = model.allocate_kv_cache(4, BLOCK)
    for i in range(limit + 2):
        cm = compile_model(model, "cpu", inductor=False, units=["loop_step"], passes=[] if i % 2 else None)
        step(cm, planes, [3], [0], num_steps=1)
        assert cm.graph_counts() == {"loop_step": 1}
