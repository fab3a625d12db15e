"""The engine's continuous depth batching (``EngineConfig(depth_batching=True)``, Ouro and Huginn):
decode tokens advance one loop step per engine step and exit at their own step. Batched == alone ==
the model-level last-exited reference (fp32, greedy), fewer steps for shallow exits, no block leak
under preemption and abort, seeded sampling reproducible, unsupported combinations rejected."""

from __future__ import annotations

import pytest
import torch
from depth_references import huginn_alone, ouro_last_exited

from rlt_compile import LLM, SamplingParams
from rlt_compile.engine import EngineConfig, LLMEngine
from rlt_compile.models.loader import load_model

PROMPTS = [[(i * 11 + j * 5) % 250 + 3 for j in range(n)] for i, n in enumerate((6, 19, 11, 33, 4, 25, 14, 9))]
N = 6
# (SamplingParams depth options, the model-level reference's forward options)
POLICIES = [
    ({"exit_policy": "fixed", "exit_step": 0}, {"exit_at_step": 0}),
    ({"exit_policy": "fixed", "exit_step": 2}, {"exit_at_step": 2}),
    ({"exit_policy": "threshold", "exit_threshold": 0.5}, {"exit_threshold": 0.5}),
    ({"exit_policy": "full"}, {"exit_at_step": 3}),
]


def greedy(n=N, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def assert_no_leak(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.depth.rows


def run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leak(llm.engine)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def ouro(tiny_dirs):
    return load_model(tiny_dirs["ouro"], load_tokenizer=False)


@pytest.fixture(scope="module")
def depth_llm(ouro):
    return LLM(ouro, num_blocks=64, depth_batching=True)


def test_mixed_policies_batched_equal_alone_and_the_reference(ouro, depth_llm):
    params = [greedy(**POLICIES[i % 4][0]) for i in range(len(PROMPTS))]
    batched = run(depth_llm, PROMPTS, params)
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        want = ouro_last_exited(ouro, prompt, N, **POLICIES[i % 4][1])
        assert batched[i] == want, f"request {i} ({POLICIES[i % 4][0]})"
        assert run(depth_llm, [prompt], p) == [want]
    assert depth_llm.engine.stats.depth_passes > 0


def test_engine_wide_exit_option(ouro):
    llm = LLM(ouro, num_blocks=64, depth_batching=True, model_options={"exit_at_step": 1})
    assert run(llm, PROMPTS[:3], greedy()) == [ouro_last_exited(ouro, p, N, exit_at_step=1) for p in PROMPTS[:3]]


def test_fixed_exit_zero_takes_fewer_engine_steps_than_full_depth(depth_llm):
    n = 5

    def steps(policy):
        before = depth_llm.engine.stats.steps
        run(depth_llm, PROMPTS[:4], greedy(n, **policy))
        return depth_llm.engine.stats.steps - before

    shallow, deep = steps(POLICIES[0][0]), steps(POLICIES[3][0])
    # one prefill step, then one step per token at depth 1 and four at depth 4
    assert shallow == 1 + (n - 1) and deep == 1 + 4 * (n - 1)


def test_preemption_with_a_small_pool_leaves_no_leak(ouro, depth_llm):
    full = greedy(**POLICIES[3][0])
    want = run(depth_llm, PROMPTS, full)
    small = LLM(ouro, num_blocks=12, block_size=4, depth_batching=True, enable_prefix_caching=False)
    depth, dropped = small.engine.depth, []
    remove = depth.remove
    depth.remove = lambda seq_id: (dropped.append(seq_id) if depth.has(seq_id) else None, remove(seq_id))
    # full depth skips no step, so a recompute prefill rebuilds exactly the decoded K/V
    assert run(small, PROMPTS, full) == want
    assert small.engine.stats.preemptions > 0
    before = small.engine.stats.preemptions
    mixed = [greedy(**POLICIES[i % 4][0]) for i in range(len(PROMPTS))]
    assert all(len(t) == N for t in run(small, PROMPTS, mixed))
    assert small.engine.stats.preemptions > before
    assert dropped  # some preempted sequence had a token in flight


def test_abort_drops_in_flight_rows_and_frees_blocks(ouro):
    engine = LLMEngine(ouro, num_blocks=32, depth_batching=True)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, greedy(**POLICIES[3][0]))
    first = [out for _ in range(3) for out in engine.step()]  # prefill, then two loop steps of decode
    assert [len(out.outputs[0].token_ids) for out in first] == [1] * 4
    assert len(engine.depth.rows) == 4 and all(r.step == 2 for r in engine.depth.rows)
    assert engine.abort_request("1") and engine.abort_request("3")
    assert len(engine.depth.rows) == 2
    done = engine.run_to_completion()
    assert done["1"].finished and done["1"].outputs[0].finish_reason == "abort"
    assert len(done["0"].outputs[0].token_ids) == N - 1 and done["0"].outputs[0].finish_reason == "length"
    assert_no_leak(engine)
    engine.add_request("x", PROMPTS[0], greedy())
    engine.step()
    engine.step()
    assert engine.abort_request("x")
    engine.run_to_completion()
    assert_no_leak(engine)


def test_seeded_sampling_is_reproducible(depth_llm):
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=N, ignore_eos=True, seed=40 + i, **POLICIES[i % 4][0])
        for i in range(4)
    ]
    first = run(depth_llm, PROMPTS[:4], params)
    assert run(depth_llm, PROMPTS[:4], params) == first
    assert [run(depth_llm, [p], q)[0] for p, q in zip(PROMPTS[:4], params)] == first


def test_stop_rules_and_logprobs(depth_llm):
    want = run(depth_llm, PROMPTS[:2], greedy(**POLICIES[1][0]))
    stop = want[0][2]
    out = depth_llm.generate(PROMPTS[:2], greedy(stop_token_ids=[stop], logprobs=2, **POLICIES[1][0]), use_tqdm=False)
    assert_no_leak(depth_llm.engine)
    first = out[0].outputs[0]
    assert first.token_ids == want[0][: want[0].index(stop) + 1] and first.finish_reason == "stop"
    assert len(first.logprobs) == len(first.token_ids)


def test_static_buffer_passes_equal_plain_passes(ouro, depth_llm):
    """use_cuda_graphs on the CPU: the batcher's graph runner with static buffers and padding."""
    params = [greedy(**POLICIES[i % 4][0]) for i in range(4)]
    llm = LLM(ouro, num_blocks=64, depth_batching=True, use_cuda_graphs=True, cuda_graph_buckets=[1, 2, 4])
    assert run(llm, PROMPTS[:4], params) == run(depth_llm, PROMPTS[:4], params)
    assert llm.engine.depth.graph_runner.replays > 0


def test_unsupported_combinations_raise(tiny_dirs, ouro):
    with pytest.raises(ValueError, match="depth_batching.*async_scheduling"):
        EngineConfig(depth_batching=True, async_scheduling=True)
    with pytest.raises(ValueError, match="depth_batching.*speculati"):
        EngineConfig(depth_batching=True, speculative_num_draft=2)
    nanbeige = load_model(tiny_dirs["nanbeige"], load_tokenizer=False)
    with pytest.raises(ValueError, match="depth_batching: needs an Ouro or Huginn model"):
        LLMEngine(nanbeige, num_blocks=8, depth_batching=True)
    huginn = load_model(tiny_dirs["huginn"], load_tokenizer=False)
    with pytest.raises(ValueError, match="latent-diff"):
        LLMEngine(
            huginn, num_blocks=8, depth_batching=True, model_options={"exit_criterion": "kl", "exit_threshold": 1}
        )
    with pytest.raises(ValueError, match="CUDA graphs"):
        LLMEngine(huginn, num_blocks=8, depth_batching=True, use_cuda_graphs=True)
    for layout in ("delayed", "shared"):
        with pytest.raises(ValueError, match="depth_batching: decode uses kv_layout"):
            LLMEngine(ouro, num_blocks=8, depth_batching=True, model_options={"kv_layout": layout})
    with pytest.raises(ValueError, match="num_steps"):
        LLMEngine(ouro, num_blocks=8, depth_batching=True, model_options={"num_steps": 2})


# -- Huginn: recurrences per request, adaptive exit -------------------------------------------------
HUGINN_PROMPTS = PROMPTS[:6]


@pytest.fixture(scope="module")
def huginn(tiny_dirs):
    return load_model(tiny_dirs["huginn"], load_tokenizer=False)


def test_huginn_per_request_recurrences_batched_equal_alone_and_the_reference(huginn):
    llm = LLM(huginn, num_blocks=64, depth_batching=True, model_options={"init_scale": 0.0})
    counts = [2, 4, 1, 3, 4, 2]
    params = [greedy(num_steps=r) for r in counts]
    batched = run(llm, HUGINN_PROMPTS, params)
    for prompt, p, r, tokens in zip(HUGINN_PROMPTS, params, counts, batched):
        want = huginn_alone(huginn, prompt, N, num_steps=r)
        assert tokens == want
        assert run(llm, [prompt], p) == [want]


def test_huginn_adaptive_exit_equals_the_reference(huginn):
    adaptive = {"exit_criterion": "latent-diff", "exit_threshold": 0.65, "min_steps": 2}
    llm = LLM(huginn, num_blocks=64, depth_batching=True, model_options={"init_scale": 0.0, **adaptive})
    counts = [4, 3, 4, 4]
    batched = run(llm, HUGINN_PROMPTS[:4], [greedy(num_steps=r) for r in counts])
    assert llm.engine.depth.early_exits > 0
    want = [
        huginn_alone(huginn, p, N, num_steps=r, exit_threshold=0.65, min_steps=2)
        for p, r in zip(HUGINN_PROMPTS[:4], counts)
    ]
    assert batched == want


def test_huginn_fewer_recurrences_take_fewer_engine_steps(huginn):
    llm = LLM(huginn, num_blocks=64, depth_batching=True, model_options={"init_scale": 0.0})
    n = 4
    for r in (1, 4):
        before = llm.engine.stats.steps
        run(llm, HUGINN_PROMPTS[:4], greedy(n, num_steps=r))
        assert llm.engine.stats.steps - before == 1 + r * (n - 1)


def test_huginn_preemption_with_a_small_pool(huginn):
    params = greedy(num_steps=4)
    big = LLM(huginn, num_blocks=64, depth_batching=True, model_options={"init_scale": 0.0})
    small = LLM(huginn, num_blocks=12, block_size=4, depth_batching=True, enable_prefix_caching=False,
                model_options={"init_scale": 0.0})  # fmt: skip
    assert run(small, HUGINN_PROMPTS, params) == run(big, HUGINN_PROMPTS, params)
    assert small.engine.stats.preemptions > 0


@pytest.mark.gpu
def test_cuda_graph_depth_batching_equals_eager(tiny_dirs):
    model = load_model(tiny_dirs["ouro"], dtype=torch.float32, device="cuda", load_tokenizer=False)
    params = [greedy(**POLICIES[i % 4][0]) for i in range(len(PROMPTS))]
    eager = LLM(model, num_blocks=64, depth_batching=True)
    compiled = load_model(tiny_dirs["ouro"], dtype=torch.float32, device="cuda", load_tokenizer=False)
    graphs = LLM(compiled, num_blocks=64, depth_batching=True, compile=True, use_cuda_graphs=True, max_num_seqs=8)
    assert graphs.engine.depth.graph_runner is not None
    assert run(graphs, PROMPTS, params) == run(eager, PROMPTS, params)
    assert graphs.engine.depth.graph_runner.replays > 0
