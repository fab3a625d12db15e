"""Asynchronous scheduling (``EngineConfig(async_scheduling=True)``, engine/async_runner.py).

CPU: the async engine produces exactly the synchronous engine's tokens (greedy and seeded sampling,
stop ids / eos / stop strings / max_tokens, n > 1, logprobs, preemption with a small pool under
both policies, chunked prefill) for all three families; the overlap really happens (the schedule
and launch of step n+1 come before the host reads step n's ids); aborts, repetition penalty
(a synchronous fallback) and the LLM API. GPU (``-m gpu``): the same on CUDA, eager and compiled
with graphs, and a UVA-forced run.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import FAMILIES, family_options

from rlt_compile import load_model
from rlt_compile.engine import LLM, LLMEngine, SamplingParams
from rlt_compile.engine.input_buffers import PLACEHOLDER


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: intra-op threads only add spin-wait contention on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {f: load_model(tiny_dirs[f]) for f in FAMILIES}


def prompts(count: int, seed: int, max_len: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 256) for _ in range(rng.randrange(1, max_len))] for _ in range(count)]


def mixed_params(i: int, max_tokens: int = 6) -> SamplingParams:
    """Greedy and seeded random rows, stop ids, top-k/top-p/min-p, logprobs, an n=2 request."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, seed=100 + i),
        dict(temperature=1.0, seed=7, top_k=20, top_p=0.9),
        dict(temperature=0.7, seed=3 * i, min_p=0.05, logprobs=2),
        dict(temperature=0.0, logprobs=0, n=2),
    ]
    return SamplingParams(max_tokens=max_tokens, stop_token_ids=[5, 9, 17, 33], **kinds[i % len(kinds)])


def run(eng: LLMEngine, reqs, streaming_check: bool = True):
    """Every completion's (tokens, finish_reason, stop_reason, text); logprobs separately."""
    ids = [eng.add_request(None, p, params) for p, params in reqs]
    merged = {}
    while eng.has_unfinished():
        for out in eng.step():
            for c in out.outputs:
                assert PLACEHOLDER not in c.token_ids, "a placeholder leaked into the outputs"
            if out.request_id in merged:
                merged[out.request_id].merge(out)
            else:
                merged[out.request_id] = out
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks, "blocks leaked"
    if eng.async_scheduler is not None:
        assert not eng.async_scheduler.pending
    tokens = [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in merged[i].outputs] for i in ids]
    logprobs = [[c.logprobs for c in merged[i].outputs] for i in ids]
    return tokens, logprobs


def both(model, family, reqs, **options):
    options.setdefault("num_blocks", 128)
    sync = LLMEngine(model, model_options=family_options(family), **options)
    fast = LLMEngine(model, model_options=family_options(family), async_scheduling=True, **options)
    assert fast.async_scheduler is not None and sync.async_scheduler is None
    a, la = run(sync, reqs)
    b, lb = run(fast, reqs)
    return (a, la, sync), (b, lb, fast)


def assert_logprobs_close(la, lb):
    """Logprob values may differ in the last bits (a row's batch differs); the ids may not."""
    for x, y in zip(la, lb):
        for cx, cy in zip(x, y):
            if cx is None:
                assert cy is None
                continue
            assert len(cx) == len(cy)
            for dx, dy in zip(cx, cy):
                assert dx.keys() == dy.keys()
                assert all(abs(dx[k] - dy[k]) < 1e-4 for k in dx)


@pytest.mark.parametrize("family", FAMILIES)
def test_async_equals_sync_greedy_and_seeded_with_stops(models, family):
    reqs = [(p, mixed_params(i)) for i, p in enumerate(prompts(10, seed=1))]
    (a, la, _), (b, lb, fast) = both(models[family], family, reqs)
    assert a == b
    assert_logprobs_close(la, lb)
    assert any(c[1] == "stop" for r in a for c in r) and any(c[1] == "length" for r in a for c in r)
    assert fast.async_scheduler.steps == fast.stats.steps


@pytest.mark.parametrize("family", FAMILIES)
def test_async_equals_sync_preemption_small_pool(models, family):
    reqs = [(p, mixed_params(i, max_tokens=5)) for i, p in enumerate(prompts(8, seed=3))]
    for options in (
        dict(enable_prefix_caching=True),
        dict(enable_prefix_caching=False),
        dict(scheduling_policy="priority"),
    ):
        # 10 blocks of 4 tokens: any single request fits, all of them together do not
        (a, _, sync), (b, _, fast) = both(models[family], family, reqs, block_size=4, num_blocks=10, **options)
        assert a == b, options
        assert sync.stats.preemptions > 0 and fast.stats.preemptions > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_async_equals_sync_chunked_prefill(models, family):
    reqs = [(p, mixed_params(i)) for i, p in enumerate(prompts(6, seed=2, max_len=60))]
    (a, _, sync), (b, _, fast) = both(models[family], family, reqs, max_num_batched_tokens=7)
    assert a == b
    assert fast.stats.steps > len(reqs) + 6  # prompts really were split
    one_shot, _ = run(LLMEngine(models[family], num_blocks=128, model_options=family_options(family)), reqs)
    assert b == one_shot


def test_overlap_schedule_of_next_step_precedes_reading_tokens(models):
    """Event order: schedule(n+1) and launch(n+1) happen before the host reads step n's ids."""
    eng = LLMEngine(models["ouro"], num_blocks=128, async_scheduling=True)
    trace = eng.async_scheduler.trace = []
    reqs = [(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for p in prompts(4, seed=5)]
    run(eng, reqs)
    position = {event: i for i, event in enumerate(trace)}
    launched = sorted(n for what, n in trace if what == "launch")
    assert launched == list(range(eng.stats.steps))
    reads = [n for what, n in trace if what == "read"]
    assert sorted(reads) == launched  # every step's ids are read exactly once
    overlapped = 0
    for n in launched[:-1]:
        if ("launch", n + 1) in position:
            assert position[("schedule", n + 1)] < position[("launch", n + 1)] < position[("read", n)]
            overlapped += 1
    assert overlapped == len(launched) - 1  # every step but the last overlapped the next one
    # the host never waits on the step it just launched, except for the final drain
    for i, (what, n) in enumerate(trace):
        if what == "read" and n != launched[-1]:
            later = [w for w, m in trace[:i] if w == "launch" and m == n + 1]
            assert later, f"step {n} was read before step {n + 1} was launched"
    assert eng.async_scheduler.sync_steps == 0


def test_max_tokens_known_in_advance_costs_no_speculative_step(models):
    reqs = [(p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)) for p in prompts(6, seed=6)]
    (a, _, sync), (b, _, fast) = both(models["nanbeige"], "nanbeige", reqs)
    assert a == b
    assert fast.async_scheduler.speculative_rows == 0
    assert fast.stats.steps == sync.stats.steps and fast.stats.generated_tokens == sync.stats.generated_tokens


def test_context_limit_eos_min_tokens_and_engine_reuse(models):
    model = models["huginn"]
    opts = family_options("huginn")
    # max_model_len: sequences stop at the context limit (known in advance: frozen, not speculative)
    reqs = [(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) for p in prompts(5, seed=14, max_len=18)]
    (a, _, _), (b, _, fast) = both(model, "huginn", reqs, max_model_len=24)
    assert a == b and all(len(p) + len(r[0][0]) == 24 for (p, _), r in zip(reqs, a))
    assert fast.async_scheduler.speculative_rows == 0
    # eos (the first greedy token of one prompt, so it really occurs) and min_tokens
    probe, _ = run(LLMEngine(model, num_blocks=64, model_options=opts), reqs[:1])
    eos = probe[0][0][0][0]
    engines = []
    for async_scheduling in (False, True):
        eng = LLMEngine(model, num_blocks=64, model_options=opts, async_scheduling=async_scheduling)
        eng.eos_token_ids = {eos}
        engines.append(eng)
    reqs = [
        (p, SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=8, min_tokens=i % 3))
        for i, p in enumerate(prompts(6, seed=14, max_len=18))
    ]
    first = [run(eng, reqs)[0] for eng in engines]
    assert first[0] == first[1] and any(c[1] == "stop" and c[2] is None for r in first[0] for c in r)
    again = [run(eng, reqs[::-1])[0] for eng in engines]  # the same engines, a second workload
    assert again[0] == again[1] == first[0][::-1]


def test_stop_token_costs_one_discarded_speculative_row(models):
    model = models["nanbeige"]
    prompt = prompts(1, seed=7)[0]
    base, _ = run(LLMEngine(model, num_blocks=64), [(prompt, SamplingParams(temperature=0, max_tokens=6))])
    tokens = base[0][0][0]
    stop = tokens[2]
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop])
    (a, _, sync), (b, _, fast) = both(model, "nanbeige", [(prompt, params)], num_blocks=64)
    assert a == b and b[0][0][0] == tokens[: tokens.index(stop) + 1] and b[0][0][1] == "stop"
    assert fast.stats.steps == sync.stats.steps + 1  # the step after the stop token was already launched
    assert fast.async_scheduler.drain() == [] and fast.async_scheduler.speculative_rows == 1


def test_stop_strings_and_text_equal(tiny_dirs):
    model = load_model(tiny_dirs["ouro"])
    tok = model.tokenizer
    text = "the capital of france is"
    base, _ = run(LLMEngine(model, num_blocks=64), [(text, SamplingParams(temperature=0, max_tokens=8))])
    words = base[0][0][3].split()
    assert len(words) >= 4
    params = [
        SamplingParams(temperature=0, max_tokens=8, stop=[words[2]]),
        SamplingParams(temperature=0, max_tokens=8, stop=words[3], include_stop_str_in_output=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=8, stop=["river", "sea"]),
    ]
    reqs = [(text, p) for p in params] + [(tok.decode(p), params[2]) for p in prompts(3, seed=8)]
    (a, _, _), (b, _, _) = both(model, "ouro", reqs, num_blocks=64)
    assert a == b
    assert a[0][0][1] == "stop" and a[0][0][2] == words[2]


@pytest.mark.parametrize(
    "adjust, needs_history",
    [
        (dict(repetition_penalty=1.3), True),
        (dict(presence_penalty=1.5), True),
        (dict(frequency_penalty=0.8), True),
        (dict(logit_bias={7: 4.0, 9: -100.0}), False),
    ],
)
def test_penalties_fall_back_to_a_synchronous_step(models, adjust, needs_history):
    reqs = [
        (p, SamplingParams(temperature=0, max_tokens=6, **(adjust if i % 2 else {})))
        for i, p in enumerate(prompts(4, seed=9))
    ]
    (a, _, _), (b, _, fast) = both(models["ouro"], "ouro", reqs)
    assert a == b
    assert (fast.async_scheduler.sync_steps > 0) == needs_history


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_async_equal_sync_in_chunks_and_preemption(models, family):
    """The prompt rows of an async step are recorded at launch (prompt tokens are never
    placeholders): the same entries as the synchronous engine, with chunked prefill and a pool
    small enough to preempt."""
    reqs = [
        (p, SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=i % 3))
        for i, p in enumerate(prompts(6, seed=5, max_len=30))
    ]
    outs = []
    for async_scheduling in (False, True):
        eng = LLMEngine(
            models[family],
            model_options=family_options(family),
            async_scheduling=async_scheduling,
            block_size=4,
            num_blocks=10,
            max_num_batched_tokens=9,
        )
        ids = [eng.add_request(None, p, params) for p, params in reqs]
        done = eng.run_to_completion()
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        outs.append(([done[i].prompt_logprobs for i in ids], [done[i].outputs[0].token_ids for i in ids], eng))
    (want, want_tokens, sync), (got, got_tokens, fast) = outs
    assert got_tokens == want_tokens and sync.stats.preemptions > 0 and fast.stats.preemptions > 0
    for g, w, (p, _) in zip(got, want, reqs):
        assert len(g) == len(w) == len(p) and g[0] is None and w[0] is None
        for eg, ew in zip(g[1:], w[1:]):
            assert eg.keys() == ew.keys() and all(abs(eg[t] - ew[t]) < 1e-4 for t in eg)


def test_abort_while_a_step_is_in_flight(models):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    keep, drop = prompts(2, seed=10)
    eng = LLMEngine(models["ouro"], num_blocks=64, async_scheduling=True)
    eng.add_request("keep", keep, params)
    eng.add_request("drop", drop, params)
    merged = {}

    def collect(outs):
        for out in outs:
            assert all(PLACEHOLDER not in c.token_ids for c in out.outputs)
            if out.request_id in merged:
                merged[out.request_id].merge(out)
            else:
                merged[out.request_id] = out

    for _ in range(4):
        collect(eng.step())
    assert eng.async_scheduler.inflight is not None  # "drop" has a token in flight
    assert eng.abort_request("drop")
    while eng.has_unfinished():
        collect(eng.step())
    assert merged["drop"].finished and merged["drop"].outputs[0].finish_reason == "abort"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    sync = LLMEngine(models["ouro"], num_blocks=64)
    sync.add_request("keep", keep, params)
    assert merged["keep"].outputs[0].token_ids == sync.run_to_completion()["keep"].outputs[0].token_ids


def test_per_request_depth_options_async_equals_sync(models):
    ouro = [
        SamplingParams(temperature=0, max_tokens=5, exit_policy="fixed", exit_step=1),
        SamplingParams(temperature=0.8, seed=2, max_tokens=5, exit_policy="threshold", exit_threshold=0.5),
        SamplingParams(temperature=0, max_tokens=5),
    ]
    reqs = [(p, ouro[i % 3]) for i, p in enumerate(prompts(6, seed=15))]
    (a, _, _), (b, _, _) = both(models["ouro"], "ouro", reqs)
    assert a == b
    huginn = [SamplingParams(temperature=0, max_tokens=5, num_steps=r) for r in (1, 2, 4)]
    reqs = [(p, huginn[i % 3]) for i, p in enumerate(prompts(6, seed=16))]
    (a, _, _), (b, _, _) = both(models["huginn"], "huginn", reqs)
    assert a == b


def test_llm_api_async_scheduling_option(tiny_dirs):
    reqs = prompts(5, seed=12)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=6)
    sync = LLM(str(tiny_dirs["huginn"]), num_blocks=64, model_options={"init_scale": 0.0})
    fast = LLM(str(tiny_dirs["huginn"]), num_blocks=64, model_options={"init_scale": 0.0}, async_scheduling=True)
    a = [o.outputs[0].token_ids for o in sync.generate(reqs, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in fast.generate(reqs, params, use_tqdm=False)]
    assert a == b and fast.engine.config.async_scheduling


def test_compiled_graph_runner_path_async_equals_sync(tiny_dirs):
    """compile=True (CPU Inductor) + the CudaGraphRunner static buffers fed from the input buffers."""
    pytest.importorskip("rlt_compile.compiler")
    model = load_model(tiny_dirs["ouro"])
    reqs = [(p, SamplingParams(temperature=0, max_tokens=5)) for p in prompts(5, seed=13)]
    options = dict(compile=True, use_cuda_graphs=True, max_num_seqs=8, max_num_batched_tokens=32, num_blocks=64)
    sync = LLMEngine(model, **options)
    fast = LLMEngine(model, async_scheduling=True, **options)
    a, _ = run(sync, reqs)
    b, _ = run(fast, reqs)
    assert a == b and fast.runner.graph_runner.replays > 0


# -- the engine profile (bench --engine-profile) ------------------------------------------------------
def test_engine_profile_smoke_on_cpu(tmp_path):
    from rlt_compile import bench

    out, raw = tmp_path / "profile.md", tmp_path / "profile.json"
    argv = ["--engine-profile", "--device", "cpu", "--tiny", "--dtype", "float32", "--batches", "1,3"]
    assert bench.main([*argv, "--engine-steps", "3", "--out", str(out), "--json", str(raw)]) == 0
    import json

    rows = json.loads(raw.read_text())
    assert [(r["batch"], r["engine"]) for r in rows] == [(1, "sync"), (1, "async"), (3, "sync"), (3, "async")]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["tok_s"] > 0 and r["profiled_steps"] == 3
        assert r["ops_per_token"] > 0 and r["busy"] is None  # no device on the CPU
    assert "| 3 | async |" in out.read_text()


def test_engine_profile_compiles_with_the_passes_asked_for(tmp_path, monkeypatch):
    from rlt_compile import bench, compiler

    seen = []
    real = compiler.compile_model

    def spy(model, **options):
        seen.append(options.get("passes"))
        return real(model, **options)

    monkeypatch.setattr(compiler, "compile_model", spy)
    out = tmp_path / "profile.md"
    argv = ["--engine-profile", "--device", "cpu", "--tiny", "--dtype", "float32", "--batches", "1"]
    argv += ["--engine-mode", "compiled", "--engine-steps", "2", "--passes", "attention_swap", "--out", str(out)]
    assert bench.main(argv) == 0
    assert seen == [["attention_swap"]]
    assert "passes: attention_swap;" in out.read_text()


class _Evt:
    def __init__(self, name, start, end, cuda=False):
        self.name = name
        self.device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        self.time_range = type("R", (), {"start": start, "end": end})()


def test_engine_trace_busy_fraction_is_the_union_of_device_intervals():
    from rlt_compile.engine_profile import STEP_LABEL, analyze_engine_trace

    events = [
        _Evt(STEP_LABEL, 0, 100),
        _Evt(STEP_LABEL, 100, 200),
        _Evt(STEP_LABEL, 0, 100, cuda=True),  # the GPU-side annotation is not device work
        _Evt("cudaGraphLaunch", 10, 12),
        _Evt("cudaLaunchKernel", 110, 111),
        _Evt("gemv", 20, 60, cuda=True),
        _Evt("rmsnorm", 40, 90, cuda=True),  # overlaps the gemv (another stream): counted once
        _Evt("Memcpy HtoD (Pinned -> Device)", 150, 160, cuda=True),
        _Evt("argmax", 190, 230, cuda=True),  # runs past the last window: clipped
    ]
    out = analyze_engine_trace(events, tokens=2, device_type="cuda")
    assert out["profiled_steps"] == 2
    assert out["busy"] == pytest.approx((70 + 10 + 10) / 200)
    assert out["busy_per_step_mean"] == pytest.approx((0.7 + 0.2) / 2)
    assert out["busy_per_step_min"] == pytest.approx(0.2)
    assert out["kernels_per_token"] == pytest.approx(3 / 2)  # copies are not kernels
    assert out["launches_per_token"] == pytest.approx(2 / 2)
    # idle: [0, 20), [90, 150), [160, 190) = 110 us over 2 steps, each gap named by its neighbours
    assert out["idle_us_per_step"] == pytest.approx(110 / 2)
    assert out["gaps"] == [
        ("rmsnorm", "Memcpy HtoD (Pinned -> Device)", 1, 30.0),
        ("Memcpy HtoD (Pinned -> Device)", "argmax", 1, 15.0),
        ("(range start)", "gemv", 1, 10.0),
    ]


def test_idle_gaps_group_repeated_neighbours_and_skip_short_gaps():
    from rlt_compile.engine_profile import idle_gaps

    device = [("a", 0, 10), ("b", 12, 20), ("a", 20.2, 30), ("b", 33, 40), ("c", 38, 45)]
    idle, gaps = idle_gaps([(s, e, n) for n, s, e in device], 0, 50, min_us=0.5)
    assert idle == pytest.approx(2 + 0.2 + 3 + 5)  # the 0.2 us gap counts as idle, not as a listed gap
    assert gaps == [("a", "b", 2, 5.0)]  # the tail after c is idle but has no activity after it


# -- GPU ----------------------------------------------------------------------------------------------
def _agreement(a, b) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_async_equals_sync(tiny_dirs, family):
    """fp32 eager on CUDA: one request at a time runs the same shapes in both modes -> identical
    tokens; batched, the async batches differ in shape (speculative rows), so compare by agreement."""
    model = load_model(tiny_dirs[family], dtype=torch.float32, device="cuda")
    reqs = [(p, mixed_params(i)) for i, p in enumerate(prompts(8, seed=20))]
    for p, params in reqs[:4]:
        (a, _, _), (b, _, _) = both(model, family, [(p, params)], num_blocks=128)
        assert a == b
    (a, _, _), (b, _, _) = both(model, family, reqs, num_blocks=256)
    assert _agreement(a, b) >= 0.85


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("uva", ["0", "1"])
def test_cuda_compiled_graphs_async_equals_sync(tiny_dirs, monkeypatch, uva):
    """compile=True + CUDA graphs, bf16; RLT_UVA=1 uses in-place metadata if the self-test passes."""
    pytest.importorskip("rlt_compile.compiler")
    monkeypatch.setenv("RLT_UVA", uva)
    model = load_model(tiny_dirs["ouro"], dtype=torch.bfloat16, device="cuda")
    options = dict(num_blocks=256, compile=True, use_cuda_graphs=True, max_num_seqs=16)
    sync = LLMEngine(model, **options)
    fast = LLMEngine(model, async_scheduling=True, **options)
    assert fast.async_scheduler.buffers.uva == (
        uva == "1" and fast.async_scheduler.buffers.uva_reason == "self-test passed"
    )
    one = [(prompts(1, seed=21)[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    assert run(sync, one)[0] == run(fast, one)[0]  # same shapes every step: bit-identical
    reqs = [(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for p in prompts(12, seed=22)]
    a, _ = run(sync, reqs)
    b, _ = run(fast, reqs)
    assert _agreement(a, b) >= 0.75
    assert fast.runner.graph_runner.replays > 0


def test_critical_path_shares_are_end_to_end_gaps_keyed_by_neighbours():
    from rlt_compile.bench import critical_path

    # two tokens of "gemv > attn > gemv"; the second gemv was launched early (PDL) and waited
    events = [
        _Evt("_gemv_kernel", 0, 10, cuda=True),
        _Evt("_paged_attention_decode_kernel", 2, 14, cuda=True),
        _Evt("_gemv_kernel", 5, 20, cuda=True),
        _Evt("_gemv_kernel", 30, 40, cuda=True),
        _Evt("_paged_attention_decode_kernel", 32, 44, cuda=True),
        _Evt("_gemv_kernel", 35, 50, cuda=True),
        _Evt("cudaGraphLaunch", 0, 60),  # host events are not kernels
    ]
    text = critical_path(events, tokens=2)
    assert text.startswith("0.02 ms: ")  # 40 us from the first kernel's end to the last one's, 2 tokens
    attention = "paged_attention_decode"
    assert f"gemv > {attention} > gemv x1 4.0 us (20%)" in text  # 14 - 10 and 44 - 40
    assert f"{attention} > gemv > gemv x0.5 6.0 us (15%)" in text  # 20 - 14: its wait is not its share
    assert f"gemv > gemv > {attention} x0.5 20.0 us (50%)" in text  # the idle gap between the tokens
    assert f"{attention} > gemv > - x0.5 6.0 us (15%)" in text
