"""Self-speculative decoding inside LLMEngine (``speculative_num_draft`` / ``speculative_draft_steps``):
greedy tokens equal plain decoding for every family, stop rules cut inside accepted runs, no block
leaks, forced agreement accepts every draft in fewer steps, seeded sampling is reproducible."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import FAMILIES, family_options

from rlt_compile import load_model
from rlt_compile.engine import EngineConfig, LLMEngine, SamplingParams
from rlt_compile.server.metrics import ServerMetrics

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {f: load_model(tiny_dirs[f]) for f in FAMILIES}


@pytest.fixture(scope="module")
def forced(tiny_dirs):
    """Ouro whose loop steps all give the same state (attention / MLP outputs zeroed, unit final
    norm): every draft equals the full-depth token."""
    model = load_model(tiny_dirs["ouro"])
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    return model


def mixed_prompts(count: int = 8, seed: int = 0, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 256) for _ in range(rng.randrange(1, max_len))] for _ in range(count)]


def engine(model, family: str = "ouro", **options) -> LLMEngine:
    options.setdefault("num_blocks", 128)
    options.setdefault("model_options", family_options(family))
    return LLMEngine(model, **options)


def run(eng: LLMEngine, prompts, params=GREEDY):
    """Completions (merged outputs) in prompt order; asserts the pool ends fully free."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    done = eng.run_to_completion()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks, "blocks leaked"
    assert not eng.scheduler.has_unfinished()
    return [done[i].outputs[0] for i in ids]


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("num_draft", "draft_steps"), [(1, 1), (3, 2), (5, 3)])
def test_greedy_speculation_equals_plain(models, family, num_draft, draft_steps):
    model = models[family]
    draft_steps = min(draft_steps, model.default_steps - 1)  # Nanbeige has 2 loops
    prompts = mixed_prompts(8, seed=3)
    want = tokens(run(engine(model, family), prompts))
    eng = engine(model, family, speculative_num_draft=num_draft, speculative_draft_steps=draft_steps)
    got = tokens(run(eng, prompts))
    assert got == want
    assert all(len(t) == GREEDY.max_tokens for t in got)
    s = eng.stats
    assert s.spec_steps > 0 and s.spec_drafted > 0 and 0 <= s.spec_accepted <= s.spec_drafted
    assert 0.0 <= s.spec_acceptance_rate <= 1.0


def test_forced_agreement_accepts_every_draft_in_fewer_steps(forced):
    prompts = mixed_prompts(8, seed=4)
    plain = engine(forced)
    want = tokens(run(plain, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))
    eng = engine(forced, speculative_num_draft=4, speculative_draft_steps=1)
    got = tokens(run(eng, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))
    assert got == want
    assert eng.stats.spec_drafted > 0 and eng.stats.spec_acceptance_rate == 1.0
    # 1 prefill step + 15 tokens at 5 per step = 4 steps, instead of 16
    assert eng.stats.steps == 4 and plain.stats.steps == 16


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_draft_passes_replay_graphs_captured_with_their_options(models, family):
    """With ``use_cuda_graphs`` (static buffers on the CPU) the draft passes run a second set of
    decode graphs captured with the engine with the draft options, and the verify passes graphs
    with a logits row per token (up to 8 sequences: 32 tokens); the tokens are plain decoding's."""
    model = models[family]
    prompts = mixed_prompts(6, seed=5)
    want = tokens(run(engine(model, family), prompts))
    eng = engine(model, family, speculative_num_draft=3, speculative_draft_steps=1, use_cuda_graphs=True,
                 max_num_seqs=8)  # fmt: skip
    verify = eng.runner.verify_graph_runner
    assert verify.token_buckets == [2, 4, 8, 16, 32] and verify.seq_buckets == [1, 2, 4, 8]
    (drafts,) = eng.runner._option_graph_runners.values()  # captured with the engine, before serving
    assert tokens(run(eng, prompts)) == want
    assert len(eng.runner._option_graph_runners) == 1
    assert drafts.step_options == {**family_options(family), **eng.draft_options}
    # one to three draft passes per speculative step (fewer near max_tokens), none run without the graphs
    assert 0 < eng.stats.spec_steps <= drafts.replays <= 3 * eng.stats.spec_steps and drafts.fallbacks == 0
    assert verify.replays == eng.stats.spec_steps  # every verify pass


def test_forced_agreement_huginn_draft_as_deep_as_target(models):
    """Huginn run at 3 recurrences with 3-recurrence drafts: draft and target are the same model."""
    opts = {"init_scale": 0.0, "num_steps": 3}
    prompts = mixed_prompts(4, seed=5)
    want = tokens(run(engine(models["huginn"], model_options=opts), prompts))
    eng = engine(models["huginn"], model_options=opts, speculative_num_draft=3, speculative_draft_steps=3)
    assert tokens(run(eng, prompts)) == want
    assert eng.stats.spec_acceptance_rate == 1.0


@pytest.mark.parametrize("model_name", ["forced", "random"])
def test_stop_rules_cut_inside_accepted_runs(models, forced, model_name):
    """stop ids, eos, max_tokens and stop strings applied per accepted token: same output, same finish."""
    model = forced if model_name == "forced" else models["ouro"]
    prompts = mixed_prompts(6, seed=6)
    reference = tokens(run(engine(model), prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))
    params = []
    for i, ref in enumerate(reference):
        kind = i % 3
        if kind == 0:  # stop at the 4th token (or earlier if it appears before)
            params.append(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[ref[3]]))
        elif kind == 1:  # max_tokens inside a 5-token run
            params.append(SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True))
        else:  # a stop string taken from the reference text
            text = model.tokenizer.decode(ref)
            stop = text[len(text) // 2 : len(text) // 2 + 2].strip() or None
            params.append(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop))
    want = run(engine(model), prompts, params)
    eng = engine(model, speculative_num_draft=4, speculative_draft_steps=2)
    got = run(eng, prompts, params)
    assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in got] == [
        (o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in want
    ]
    assert any(o.finish_reason == "stop" for o in got)
    if model_name == "forced":
        assert eng.stats.spec_acceptance_rate == 1.0


def test_eos_inside_accepted_run(forced):
    prompts = mixed_prompts(4, seed=7)
    reference = tokens(run(engine(forced), prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
    plain, spec = engine(forced), engine(forced, speculative_num_draft=5, speculative_draft_steps=1)
    for eng in (plain, spec):
        eng.eos_token_ids = {reference[0][2]}
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=1)
    want, got = run(plain, prompts, params), run(spec, prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert got[0].finish_reason == "stop"


def test_small_pool_preempts_or_falls_back_to_plain_decode(models):
    """A pool too small for every sequence's lookahead: plain decode for some, preemption, same tokens."""
    model = models["nanbeige"]
    prompts = mixed_prompts(8, seed=8, max_len=30)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = tokens(run(engine(model, "nanbeige", num_blocks=64, block_size=4), prompts, params))
    eng = engine(model, "nanbeige", num_blocks=24, block_size=4, speculative_num_draft=4)
    assert tokens(run(eng, prompts, params)) == want
    assert eng.stats.spec_steps > 0 and eng.stats.preemptions > 0


def test_logprobs_and_penalty_requests_decode_plainly_in_the_same_step(models):
    model = models["ouro"]
    prompts = mixed_prompts(10, seed=9)
    params = [
        GREEDY,
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={40: 3.0, 41: -100.0}),
    ] * 2
    want = run(engine(model), prompts, params)
    eng = engine(model, speculative_num_draft=3, speculative_draft_steps=2)
    got = run(eng, prompts, params)
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):
        assert (g.logprobs is None) == (w.logprobs is None)
        if g.logprobs is not None:
            assert [list(d) for d in g.logprobs] == [list(d) for d in w.logprobs]
            for dg, dw in zip(g.logprobs, w.logprobs):
                assert all(abs(dg[t] - dw[t]) < 1e-4 for t in dg)
    assert eng.stats.spec_steps > 0


def test_seeded_sampling_is_reproducible(models):
    model = models["huginn"]
    prompts = mixed_prompts(6, seed=10)
    params = [
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=12, ignore_eos=True, seed=i)
        for i in range(len(prompts))
    ]
    params[1] = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)  # engine generator
    params[2] = SamplingParams(temperature=0.7, min_p=0.05, max_tokens=12, ignore_eos=True, seed=5, n=2)

    def once():
        eng = engine(model, "huginn", speculative_num_draft=3, speculative_draft_steps=2, seed=1)
        outs = run(eng, prompts, params)
        assert eng.stats.spec_drafted > 0
        return tokens(outs)

    first, second = once(), once()
    assert first == second
    assert all(len(t) == 12 for t in first)


def _joint_two_tokens(model, seed: int, samples: int, **options) -> dict[tuple[int, int], float]:
    """Empirical distribution of the first two sampled tokens (the second one is speculative)."""
    eng = engine(model, num_blocks=samples * 2 + 16, block_size=4, max_num_seqs=samples, **options)
    params = SamplingParams(n=samples, temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True, seed=seed)
    eng.add_request(None, [5, 6, 7], params)
    outs = eng.run_to_completion()["0"].outputs
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    counts: dict[tuple[int, int], float] = {}
    for o in outs:
        key = tuple(o.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1 / samples
    return counts, eng.stats


def test_rejection_sampling_in_the_engine_keeps_the_target_distribution(models):
    """The random tiny Ouro's draft (1 step) and target (4 steps) distributions barely overlap
    (acceptance ~0.1), so emitting draft samples would move the joint distribution of the first two
    tokens by a total variation near 0.9; rejection sampling must stay within sampling noise of
    plain decoding (expected ~0.07 at 600 samples per side)."""
    samples = 600
    plain, _ = _joint_two_tokens(models["ouro"], 0, samples)
    spec, stats = _joint_two_tokens(models["ouro"], 10_000, samples, speculative_num_draft=1)
    assert stats.spec_drafted > samples // 2 and stats.spec_acceptance_rate < 0.5
    keys = set(plain) | set(spec)
    total_variation = sum(abs(plain.get(k, 0) - spec.get(k, 0)) for k in keys) / 2
    assert total_variation < 0.2, (total_variation, plain, spec)


def test_sampled_drafts_all_accepted_when_draft_equals_target(forced):
    """Forced agreement: draft and target distributions are equal, so every sampled draft is accepted."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=6, ignore_eos=True, seed=0)
    eng = engine(forced, speculative_num_draft=3, speculative_draft_steps=2)
    out = run(eng, [[5, 6, 7]], params)[0]
    assert len(out.token_ids) == 6 and eng.stats.spec_acceptance_rate == 1.0


def test_config_errors(models):
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(speculative_num_draft=2, async_scheduling=True)
    with pytest.raises(ValueError, match="speculative_num_draft"):
        EngineConfig(speculative_num_draft=-1)
    with pytest.raises(ValueError, match="speculative_draft_steps"):
        EngineConfig(speculative_num_draft=2, speculative_draft_steps=0)
    with pytest.raises(ValueError, match="speculative_draft_steps"):
        engine(models["ouro"], speculative_num_draft=2, speculative_draft_steps=4)
    with pytest.raises(ValueError, match="speculative_draft_steps"):
        engine(models["nanbeige"], "nanbeige", speculative_num_draft=2, speculative_draft_steps=2)
    with pytest.raises(ValueError, match="kv_layout"):
        engine(models["ouro"], model_options={"kv_layout": "last-exited"}, speculative_num_draft=2)


def test_default_is_off_and_metrics_report_acceptance(forced):
    eng = engine(forced)
    run(eng, [[5, 6, 7]])
    assert eng.stats.spec_steps == 0 and eng.stats.spec_drafted == 0
    eng = engine(forced, speculative_num_draft=2)
    run(eng, [[5, 6, 7]])
    metrics = ServerMetrics("m")
    metrics.snapshot(eng)
    text = metrics.render()
    drafted = eng.stats.spec_drafted
    assert drafted > 0
    assert f'rlt_spec_draft_tokens_total{{model_name="m"}} {drafted}' in text
    assert f'rlt_spec_accepted_tokens_total{{model_name="m"}} {drafted}' in text
    assert 'rlt_spec_acceptance_rate{model_name="m"} 1' in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_graphs_speculation_equals_plain(tiny_dirs):
    """On the GPU with compile + CUDA graphs (plain decode, draft and verify passes all replay graphs):
    forced agreement in fp32 gives identical tokens and accepts every draft."""
    model = load_model(tiny_dirs["ouro"], dtype=torch.float32, device="cuda")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    prompts = mixed_prompts(8, seed=11)
    kw = {"compile": True, "use_cuda_graphs": True, "num_blocks": 128}
    want = tokens(run(LLMEngine(model, **kw), prompts))
    eng = LLMEngine(model, speculative_num_draft=4, speculative_draft_steps=2, **kw)
    assert tokens(run(eng, prompts)) == want
    assert eng.stats.spec_acceptance_rate == 1.0
    (drafts,) = eng.runner._option_graph_runners.values()
    assert drafts.replays > 0 and eng.runner.verify_graph_runner.replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_bf16_speculation_agrees_with_plain(tiny_dirs, family):
    """bf16 GEMMs may pick other kernels for the verify pass's K + 1 rows than for one decode row, so
    tokens are compared by agreement (as tests/test_engine_gpu.py does for batch shapes)."""
    model = load_model(tiny_dirs[family], dtype=torch.bfloat16, device="cuda")
    prompts = mixed_prompts(8, seed=12)
    want = tokens(run(engine(model, family), prompts))
    d = min(2, model.default_steps - 1)
    got = tokens(run(engine(model, family, speculative_num_draft=3, speculative_draft_steps=d), prompts))
    first = sum(g[0] == w[0] for g, w in zip(got, want)) / len(want)
    whole = sum(g == w for g, w in zip(got, want)) / len(want)
    assert first == 1.0 and whole >= 0.75, (first, whole)
