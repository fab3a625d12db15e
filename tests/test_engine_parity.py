"""Engine determinism on tiny fp32 models of each family (design contract 6): greedy tokens are the
same batched, alone, through the simple runner, with chunked prefill, with the prefix cache and
under preemption, and the block pool ends fully free."""

from __future__ import annotations

import random

import pytest
from conftest import FAMILIES, family_options

from rlt_compile import load_model
from rlt_compile.engine import LLMEngine, SamplingParams
from rlt_compile.models.runner import greedy_generate

MAX_TOKENS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {f: load_model(tiny_dirs[f]) for f in FAMILIES}


def mixed_prompts(count: int, seed: int = 0, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 256) for _ in range(rng.randrange(1, max_len))] for _ in range(count)]


def engine(model, family: str, **options) -> LLMEngine:
    options.setdefault("num_blocks", 128)
    return LLMEngine(model, model_options=family_options(family), **options)


def run(eng: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    ids = [eng.add_request(None, p, params) for p in prompts]
    done = eng.run_to_completion()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks, "blocks leaked"
    return [done[i].outputs[0].token_ids for i in ids]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_alone_equals_runner(models, family):
    model = models[family]
    prompts = mixed_prompts(16, seed=1, max_len=34)
    batched = run(engine(model, family), prompts)
    alone_engine = engine(model, family)
    alone = [run(alone_engine, [p])[0] for p in prompts]
    runner = [greedy_generate(model, p, MAX_TOKENS, **family_options(family))[0] for p in prompts]
    assert batched == alone == runner
    assert all(len(t) == MAX_TOKENS for t in batched)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_small_budget_matches_one_shot(models, family):
    model = models[family]
    prompts = mixed_prompts(6, seed=2, max_len=60)
    one_shot = run(engine(model, family, enable_chunked_prefill=False, max_num_batched_tokens=4096), prompts)
    eng = engine(model, family, max_num_batched_tokens=7)
    chunked = run(eng, prompts)
    assert chunked == one_shot
    assert eng.stats.steps > len(prompts) + MAX_TOKENS  # prompts really were split


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_small_pool_same_tokens_no_leak(models, family):
    model = models[family]
    prompts = mixed_prompts(8, seed=3, max_len=30)
    reference = run(engine(model, family, block_size=4), prompts)
    for caching in (True, False):
        # 10 blocks of 4 tokens: any single request fits (<= 33 tokens), all 8 together do not
        eng = engine(model, family, block_size=4, num_blocks=10, enable_prefix_caching=caching)
        assert run(eng, prompts) == reference
        assert eng.stats.preemptions > 0
        assert eng.block_manager.num_free_blocks == 10


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hit_gives_identical_tokens(models, family):
    model = models[family]
    shared = mixed_prompts(1, seed=4, max_len=60)[0] + list(range(100, 140))  # >= 40 tokens
    first, second = shared + [7, 8, 9], shared + [11, 12]
    eng = engine(model, family)
    run(eng, [first])
    hits = eng.block_manager.stats.hits
    assert run(eng, [second]) == run(engine(model, family, enable_prefix_caching=False), [second])
    assert eng.block_manager.stats.hits - hits >= len(shared) // eng.config.block_size
    # the same prompt again: everything but the last block comes from the cache
    assert run(eng, [second]) == run(engine(model, family, enable_prefix_caching=False), [second])


def test_compiled_engine_with_graph_runner_matches_eager(tiny_dirs, models):
    """compile=True (CPU Inductor) plus the CudaGraphRunner hook (static buffers, no graphs on the CPU)."""
    pytest.importorskip("rlt_compile.compiler")
    pytest.importorskip("rlt_compile.graphs")
    prompts = mixed_prompts(6, seed=5, max_len=30)
    eager = run(engine(models["ouro"], "ouro"), prompts)
    model = load_model(tiny_dirs["ouro"])  # compile_model installs compiled units on the instance
    eng = engine(model, "ouro", compile=True, use_cuda_graphs=True, max_num_seqs=8, max_num_batched_tokens=32)
    assert eng.runner.step_fn is not model and eng.runner.graph_runner is not None
    assert run(eng, prompts) == eager
    assert eng.runner.graph_runner.replays > 0


def test_short_context_decode_steps_take_their_context_bucket(models, monkeypatch):
    """``cuda_graph_context_buckets``: decode batches whose block tables fit a context bucket run its
    step (on the CPU the static-buffer step under ``decode_context_limit``), longer ones the full
    width; tokens equal the engine without graphs."""
    from rlt_compile.graphs import CudaGraphRunner

    contexts = []
    real_run_step = CudaGraphRunner._run_step

    def run_step(self, bucket, context=None):
        contexts.append(context)
        return real_run_step(self, bucket, context)

    monkeypatch.setattr(CudaGraphRunner, "_run_step", run_step)
    prompts = [[5 + i for i in range(12)], [9 + i for i in range(40)]]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = engine(models["nanbeige"], "nanbeige")
    eng = engine(models["nanbeige"], "nanbeige", use_cuda_graphs=True, cuda_graph_context_buckets=[32, 64])
    runner = eng.runner.graph_runner
    assert runner.context_buckets == [32, 64]
    contexts.clear()
    assert run(eng, prompts[:1], params) == run(plain, prompts[:1], params)
    assert set(contexts) == {32, 64}  # 12 + 30 positions cross 32
    contexts.clear()
    assert run(eng, prompts, params) == run(plain, prompts, params)
    assert set(contexts) == {64, None}  # the 40-token prompt's table: 64 positions, then 80
