"""The engine's wavefront chunked prefill (``EngineConfig(wavefront_prefill_chunk=C)``): greedy tokens
equal the plain engine's exactly for every family (fp32, CPU), with mixed-length prompts, prefills
sharing a step with decodes, chunked continuations and prefix-cache hits (``start`` > 0), preemption
without block leaks; unusable settings raise."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, family_options

from rlt_compile import LLM, SamplingParams
from rlt_compile.engine import EngineConfig, LLMEngine
from rlt_compile.models.loader import load_model
from rlt_compile.models.runner import forward_sequences
from rlt_compile.models.wavefront import wavefront_prefill

C = 8
LENGTHS = (5, 40, 12, 27, 8, 33, 17, 9)
PROMPTS = [[(i * 13 + j * 7) % 250 + 3 for j in range(n)] for i, n in enumerate(LENGTHS)]
N = 5


def greedy(n=N, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {f: load_model(tiny_dirs[f], load_tokenizer=False) for f in FAMILIES}


def make(model, family, chunk, **kw) -> LLM:
    kw.setdefault("num_blocks", 64)
    return LLM(model, model_options=family_options(family), wavefront_prefill_chunk=chunk, **kw)


def run(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # no leak
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_wavefront_engine_equals_plain_engine(models, family):
    model = models[family]
    want = run(make(model, family, 0), PROMPTS, greedy())
    on = make(model, family, C)
    calls = []
    original = model.loop_step
    model.loop_step = lambda h, *a: calls.append(h.shape[0]) or original(h, *a)
    try:
        got = run(on, PROMPTS, greedy())
    finally:
        del model.loop_step
    assert got == want
    stats = on.engine.stats
    longer = [n for n in LENGTHS if n > C]
    assert stats.wavefront_prefills == len(longer) and stats.wavefront_tokens == sum(longer)
    assert max(calls) > C  # wavefront passes hold rows of several chunks at different loop steps
    # A small token budget: chunked prefills (the last chunk a wavefront from ``start`` > 0) share
    # steps with decodes; still the same tokens.
    small = make(model, family, C, max_num_batched_tokens=24)
    assert run(small, PROMPTS, greedy()) == want
    assert small.engine.stats.wavefront_prefills > 0


def test_wavefront_prefill_from_a_start_offset(models):
    """Model level: the tokens after ``start`` on top of a cache holding the first ``start``."""
    for family in FAMILIES:
        model, opts = models[family], family_options(family)
        prompt = PROMPTS[1]
        (plain,), _ = forward_sequences(model, [prompt], **opts)
        planes = model.allocate_kv_cache(4, 16, fold_steps=True)
        wavefront_prefill(model, planes, prompt[:16], [2, 0, 3], 5, **opts)
        logits = wavefront_prefill(model, planes, prompt, [2, 0, 3], 5, start=16, **opts)
        torch.testing.assert_close(logits, plain[-1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="start"):
        wavefront_prefill(model, planes, prompt, [2, 0, 3], 5, start=len(prompt), **opts)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_prefix_cache_hits_run_the_rest_as_a_wavefront(models, family):
    model = models[family]
    first = PROMPTS[1]  # 40 tokens: two full blocks of 16 get cached
    second = first[:32] + [(j * 3) % 250 + 3 for j in range(11)]
    off = make(model, family, 0)
    want = [run(off, [first], greedy()), run(off, [second], greedy())]
    on = make(model, family, C)
    assert run(on, [first], greedy()) == want[0]
    hits = on.engine.block_manager.stats.hits
    before = on.engine.stats.wavefront_tokens
    assert run(on, [second], greedy()) == want[1]
    assert on.engine.block_manager.stats.hits == hits + 2
    assert on.engine.stats.wavefront_tokens == before + 11  # the 11 tokens after the cached 32


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_with_a_small_pool(models, family):
    model = models[family]
    want = run(make(model, family, 0), PROMPTS, greedy(12))
    small = make(model, family, C, num_blocks=8)
    assert run(small, PROMPTS, greedy(12)) == want
    assert small.engine.stats.preemptions > 0
    assert small.engine.stats.wavefront_prefills > len([n for n in LENGTHS if n > C])  # recomputes too


def test_ouro_per_request_exit_policies(models):
    model = models["ouro"]
    params = [
        greedy(exit_policy="fixed", exit_step=i % 4) if i % 2 else greedy(exit_policy="threshold", exit_threshold=0.5)
        for i in range(len(PROMPTS))
    ]
    assert run(make(model, "ouro", C), PROMPTS, params) == run(make(model, "ouro", 0), PROMPTS, params)


def test_huginn_per_request_recurrences(models):
    model = models["huginn"]
    params = [greedy(num_steps=1 + i % 4) for i in range(len(PROMPTS))]
    assert run(make(model, "huginn", C), PROMPTS, params) == run(make(model, "huginn", 0), PROMPTS, params)


@pytest.mark.parametrize("bad", [-1, 2.5, "8", True])
def test_bad_chunk_values_raise(bad):
    with pytest.raises(ValueError, match="wavefront_prefill_chunk"):
        EngineConfig(wavefront_prefill_chunk=bad)


@pytest.mark.parametrize("other", [{"async_scheduling": True}, {"speculative_num_draft": 2}, {"depth_batching": True}])
def test_incompatible_options_raise(other):
    with pytest.raises(ValueError, match="wavefront_prefill_chunk"):
        EngineConfig(wavefront_prefill_chunk=C, **other)
    EngineConfig(wavefront_prefill_chunk=0, **other)  # off: fine


def test_shared_kv_layout_raises(models):
    with pytest.raises(ValueError, match="wavefront_prefill_chunk"):
        LLMEngine(models["ouro"], num_blocks=8, wavefront_prefill_chunk=C, model_options={"kv_layout": "shared"})


def test_default_is_off(models):
    engine = LLMEngine(models["nanbeige"], num_blocks=8)
    assert engine.config.wavefront_prefill_chunk is None and engine.wavefront_chunk == 0
    assert engine.runner.kv_caches[0]._base is None  # not step-folded


def test_static_buffer_decode_on_the_folded_cache(models):
    """``use_cuda_graphs=True`` (on the CPU: the graph runner's static buffers) serves the decodes
    on the step-folded cache."""
    want = run(make(models["ouro"], "ouro", 0), PROMPTS[:4], greedy())
    on = make(models["ouro"], "ouro", C, use_cuda_graphs=True)
    assert on.engine.runner.graph_runner is not None
    assert run(on, PROMPTS[:4], greedy()) == want
    assert on.engine.stats.wavefront_prefills == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu on the device)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_wavefront_engine_tokens(tiny_dirs, family, dtype):
    """On the GPU (Triton attention): fp32 greedy tokens equal the plain engine's exactly. bf16
    GEMMs may pick other kernels for a wavefront pass's rows (several chunks x loop steps) than for
    one chunk's, so bf16 is compared by agreement: every first token, and most whole sequences."""
    model = load_model(tiny_dirs[family], load_tokenizer=False, dtype=dtype, device="cuda")
    want = run(make(model, family, 0), PROMPTS, greedy())
    on = make(model, family, C)
    got = run(on, PROMPTS, greedy())
    assert on.engine.stats.wavefront_prefills == sum(n > C for n in LENGTHS)
    if dtype == torch.float32:
        assert got == want
    else:
        first = sum(g[0] == w[0] for g, w in zip(got, want)) / len(want)
        whole = sum(g == w for g, w in zip(got, want)) / len(want)
        assert first == 1.0 and whole >= 0.75, (first, whole)
