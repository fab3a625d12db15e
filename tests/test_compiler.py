"""compile_model on the CPU: compiled (passes + Inductor) equals eager for every family, one graph per
compile unit across prefill and decode, KV planes written in place, clear option/platform errors."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import FAMILIES, family_options

from rlt_compile import load_model
from rlt_compile.compiler import CompiledModel, PlatformMismatchError, compile_model
from rlt_compile.kernels.metadata import build_metadata
from rlt_compile.platform import Platform, current_platform

# (query lens, context lens) per step: a 2-sequence prefill, two decode steps, a mixed step
STEPS = [([5, 3], [0, 0]), ([1, 1], [5, 3]), ([1, 1], [6, 4]), ([4, 1], [7, 5])]
BLOCK = 16
TABLES = [[0, 1], [2, 3]]


def run_steps(fn, planes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for qlens, ctx in STEPS:
        meta = build_metadata(qlens, ctx, TABLES, BLOCK)
        ids = torch.randint(0, 256, (sum(qlens),), generator=gen)
        pos = torch.cat([torch.arange(c, c + q) for q, c in zip(qlens, ctx)])
        last = torch.tensor([qlens[0] - 1, sum(qlens) - 1])
        with torch.no_grad():
            outs.append(fn(ids, pos, planes, meta, last, **OPTS[fn_family(fn)]))
    return outs


OPTS = {f: family_options(f) for f in FAMILIES}


def fn_family(fn):
    model = fn.model if isinstance(fn, CompiledModel) else fn
    return model.family


@pytest.fixture(scope="module")
def compiled(tiny_dirs):
    """family -> (compiled model, eager model, compiled outputs, eager outputs, planes, planes_ref)."""
    out = {}
    for family in FAMILIES:
        model = load_model(tiny_dirs[family], load_tokenizer=False)
        ref = load_model(tiny_dirs[family], load_tokenizer=False)
        cm = compile_model(model, platform="cpu")
        planes, ref_planes = model.allocate_kv_cache(4, BLOCK), ref.allocate_kv_cache(4, BLOCK)
        out[family] = (cm, ref, run_steps(cm, planes), run_steps(ref, ref_planes), planes, ref_planes)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_equals_eager(compiled, family):
    cm, _, got, want, planes, ref_planes = compiled[family]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for p, r in zip(planes, ref_planes):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_graph_per_unit_for_prefill_and_decode(compiled, family):
    cm = compiled[family][0]
    assert cm.graph_counts() == dict.fromkeys(cm.model.compile_units, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_passes_ran_and_were_logged(compiled, family):
    cm = compiled[family][0]
    loop = cm.graph_records("loop_step")[0]
    assert "rlt.attention_torch(" in loop.after and "rlt.attention(" not in loop.after
    assert "rlt.attention(" in loop.before
    # Huginn's checkpoint already fuses q/k/v and gate/up, so fuse_linears finds nothing there
    fused = [] if family == "huginn" else ["fuse_linears"]
    assert [r.pass_name for r in loop.passes] == ["attention_swap", *fused]
    assert all(r.unit in cm.units for r in cm.pass_log)


def split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_planes_are_written_in_place(compiled, family):
    """Inductor's code hands each KV plane (a graph input ``argN_1``) straight to the attention op and
    never copies it."""
    cm = compiled[family][0]
    for record in cm.graph_records():
        code = "\n".join(record.output_code)
        calls = re.findall(r"torch\.ops\.rlt\.attention_torch\.default\((.*)\)", code)
        assert len(calls) == record.after.count("rlt.attention_torch(")
        for call in calls:
            # q, k, v may be views of buffers; the 4th argument must be an input, untouched
            args = split_top_level(call)
            assert re.fullmatch(r"arg\d+_1", args[3].strip()), call
        assert ".copy_(" not in code
        assert "aten.copy" not in code


def test_unknown_platform_is_an_error(tiny_dirs):
    model = load_model(tiny_dirs["ouro"], load_tokenizer=False)
    with pytest.raises(ValueError, match="unknown platform 'tpu'.*auto, cuda, rocm, cpu"):
        compile_model(model, platform="tpu")
    with pytest.raises(ValueError, match="platform must be"):
        compile_model(model, platform=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
@pytest.mark.parametrize("kind", ["cuda", "rocm"])
def test_platform_this_machine_lacks_is_an_error(tiny_dirs, kind):
    model = load_model(tiny_dirs["ouro"], load_tokenizer=False)
    with pytest.raises(RuntimeError, match=f"platform '{kind}' requested but this machine is cpu"):
        compile_model(model, platform=kind)


def test_model_on_the_wrong_device_is_an_error(tiny_dirs):
    model = load_model(tiny_dirs["ouro"], load_tokenizer=False)
    gpu = Platform.mock("cuda", available=True)
    with pytest.raises(PlatformMismatchError, match="model is on 'cpu'"):
        compile_model(model, platform=gpu)


def test_bad_options_are_errors(tiny_dirs):
    model = load_model(tiny_dirs["ouro"], load_tokenizer=False)
    with pytest.raises(TypeError, match="unknown option.*'fullgrahp'"):
        compile_model(model, "cpu", fullgrahp=True)
    with pytest.raises(ValueError, match="reduce-overhead.*cuda_graphs=True"):
        compile_model(model, "cpu", mode="reduce-overhead")
    with pytest.raises(ValueError, match="dynamic must be one of"):
        compile_model(model, "cpu", dynamic="sometimes")
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        compile_model(model, "cpu", attention_backend="fast")
    with pytest.raises(ValueError, match="unknown pass"):
        compile_model(model, "cpu", passes=["nope"])
    with pytest.raises(ValueError, match="no method"):
        compile_model(model, "cpu", units=["loop_stp"])
    assert "loop_step" not in model.__dict__  # nothing was installed by the failed calls


def test_auto_platform_is_this_machine(tiny_dirs):
    model = load_model(tiny_dirs["nanbeige"], load_tokenizer=False)
    if current_platform().is_gpu:
        model = model.to("cuda")
    cm = compile_model(model, platform="auto", inductor=False)
    assert cm.platform.kind == current_platform().kind
    assert cm.model is model and isinstance(model.__dict__["loop_step"], object)
    cm.uninstall()
    assert "loop_step" not in model.__dict__
