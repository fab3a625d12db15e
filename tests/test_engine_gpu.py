"""The engine on CUDA in bf16 with tiny models (``pytest -m gpu``; skipped without a GPU).

bf16 GEMMs may pick different kernels for different batch shapes, so batched and alone are
compared by agreement (the first token everywhere, most sequences entirely) rather than bit
equality; fp32 on the GPU must agree exactly on tokens.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from conftest import FAMILIES, family_options

from rlt_compile import load_model
from rlt_compile.engine import LLMEngine, SamplingParams
from rlt_compile.models.runner import greedy_generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu on the device)"),
]

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompts(count=16, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(4, 256) for _ in range(rng.randrange(1, 48))] for _ in range(count)]


def _run(eng: LLMEngine, prompts) -> list[list[int]]:
    ids = [eng.add_request(None, p, PARAMS) for p in prompts]
    done = eng.run_to_completion()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return [done[i].outputs[0].token_ids for i in ids]


def _agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    first = sum(x[0] == y[0] for x, y in zip(a, b)) / len(a)
    whole = sum(x == y for x, y in zip(a, b)) / len(a)
    return first, whole


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_bf16_batched_vs_alone(tiny_dirs, family):
    model = load_model(tiny_dirs[family], dtype=torch.bfloat16, device="cuda")
    prompts = _prompts()
    opts = family_options(family)
    batched = _run(LLMEngine(model, num_blocks=256, model_options=opts), prompts)
    alone_engine = LLMEngine(model, num_blocks=256, model_options=opts)
    alone = [_run(alone_engine, [p])[0] for p in prompts]
    first, whole = _agreement(batched, alone)
    assert first >= 0.9 and whole >= 0.75, (first, whole)


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_fp32_batched_equals_runner(tiny_dirs, family):
    model = load_model(tiny_dirs[family], dtype=torch.float32, device="cuda")
    prompts = _prompts(8, seed=1)
    opts = family_options(family)
    batched = _run(LLMEngine(model, num_blocks=256, model_options=opts, max_num_batched_tokens=64), prompts)
    runner = [greedy_generate(model, p, PARAMS.max_tokens, **opts)[0] for p in prompts]
    first, whole = _agreement(batched, runner)
    assert first == 1.0 and whole >= 0.9, (first, whole)


@pytest.mark.skipif(
    importlib.util.find_spec("rlt_compile.graphs") is None or importlib.util.find_spec("rlt_compile.compiler") is None,
    reason="rlt_compile.graphs / rlt_compile.compiler not available",
)
def test_cuda_compiled_graphs_match_eager(tiny_dirs):
    model = load_model(tiny_dirs["ouro"], dtype=torch.bfloat16, device="cuda")
    prompts = _prompts(12, seed=2)
    eager = _run(LLMEngine(model, num_blocks=256), prompts)
    fast = LLMEngine(model, num_blocks=256, compile=True, use_cuda_graphs=True, max_num_seqs=16)
    assert fast.runner.graph_runner is not None
    first, whole = _agreement(_run(fast, prompts), eager)
    assert first >= 0.9 and whole >= 0.75, (first, whole)


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_prefill_graphs_give_the_compiled_engines_tokens(tiny_dirs, family):
    """``cuda_graph_prefill_tokens`` (fp32, highest matmul precision): prompts, chunks and mixed steps
    replayed from prefill graphs give the tokens of the same compiled engine without them."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        model = load_model(tiny_dirs[family], dtype=torch.float32, device="cuda")
        prompts = _prompts(10, seed=5)
        kw = dict(num_blocks=256, model_options=family_options(family), compile=True, use_cuda_graphs=True,
                  max_num_seqs=8, max_num_batched_tokens=64)  # fmt: skip
        want = _run(LLMEngine(model, **kw), prompts)
        eng = LLMEngine(model, cuda_graph_prefill_tokens=[16, 32, 64], **kw)
        assert _run(eng, prompts) == want
        assert eng.runner.prefill_graph_runner.replays > 0
    finally:
        torch.set_float32_matmul_precision(old)


def test_cuda_graphs_capture_data_dependent_exits(tiny_dirs):
    """Engine-wide "last-exited" without a fixed exit: each row exits where the gate says; the
    captured graph runs every loop step with the exited rows masked (no host read), with the tokens
    of the plain engine; with a fixed exit step the graph runs only the steps up to it."""
    model = load_model(tiny_dirs["ouro"], dtype=torch.float32, device="cuda")
    prompts = _prompts(6, seed=2)
    opts = {"kv_layout": "last-exited"}
    want = _run(LLMEngine(model, num_blocks=256, model_options=opts), prompts)
    compiled = load_model(tiny_dirs["ouro"], dtype=torch.float32, device="cuda")
    eng = LLMEngine(compiled, num_blocks=256, model_options=opts, compile=True, use_cuda_graphs=True, max_num_seqs=8)
    assert eng.runner.graph_runner is not None
    assert _run(eng, prompts) == want
    assert eng.runner.graph_runner.replays > 0
    fixed = LLMEngine(compiled, num_blocks=256, model_options={**opts, "exit_at_step": 1}, compile=True,
                      use_cuda_graphs=True, max_num_seqs=8)  # fmt: skip
    assert fixed.runner.graph_runner is not None


def test_cuda_compiled_prompt_logprobs_and_penalties_match_eager(tiny_dirs):
    """Session 19's sampling options through the compiled step and graphs (fp32): prompt_logprobs
    rows follow the sampled rows in a compiled prefill (more logits rows than sequences), and the
    penalties / logit bias run in the sampler after graph-replayed decode steps."""
    prompts = _prompts(6, seed=4)
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={40: 3.0}),
    ] * 2

    def run(eng: LLMEngine):
        ids = [eng.add_request(None, p, q) for p, q in zip(prompts, params)]
        done = eng.run_to_completion()
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        return [done[i] for i in ids]

    model = load_model(tiny_dirs["ouro"], dtype=torch.float32, device="cuda")
    want = run(LLMEngine(model, num_blocks=256))
    fast = LLMEngine(model, num_blocks=256, compile=True, use_cuda_graphs=True, max_num_seqs=8)
    got = run(fast)
    assert fast.runner.graph_runner is not None and fast.runner.graph_runner.replays > 0
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    for g, w in zip(got, want):
        assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None)
        for eg, ew in zip(g.prompt_logprobs or [], w.prompt_logprobs or []):
            assert (eg is None and ew is None) or eg == pytest.approx(ew, abs=1e-3)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper GPU (the Gluon prefill kernel; run with -m gpu on the device)",
)
def test_cuda_compiled_prefill_graphs_with_the_gluon_kernel(monkeypatch):
    """A real head dim (128, which the tiny models lack): the compiled engine's prefill steps and
    chunks, replayed from prefill graphs, take the Gluon prefill kernel and give the tokens of the same
    engine on the TMA kernel (``gluon_prefill=0``), by agreement (bf16)."""
    from conftest import tiny_model

    from rlt_compile.kernels import prefill_gluon

    launches = []
    launch = prefill_gluon.launch_gluon_prefill
    monkeypatch.setattr(prefill_gluon, "launch_gluon_prefill", lambda *a, **k: launches.append(1) or launch(*a, **k))
    model = tiny_model("nanbeige", seed=3, head_dim=128).to(device="cuda", dtype=torch.bfloat16)
    rng = random.Random(7)
    prompts = [[rng.randrange(4, 256) for _ in range(rng.randrange(40, 200))] for _ in range(8)]
    kw = dict(num_blocks=256, compile=True, use_cuda_graphs=True, max_num_seqs=8, max_num_batched_tokens=256,
              cuda_graph_prefill_tokens=[64, 128, 256])  # fmt: skip
    engine = LLMEngine(model, **kw)
    gluon = _run(engine, prompts)
    assert launches and engine.runner.prefill_graph_runner.replays > 0
    monkeypatch.setenv("RLT_ATTENTION_CONFIG", "gluon_prefill=0")
    tma = _run(LLMEngine(model, **kw), prompts)
    first, whole = _agreement(gluon, tma)
    assert first >= 0.9 and whole >= 0.75, (first, whole)
