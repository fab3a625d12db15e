"""Engine behaviour through LLM / LLMEngine on a tiny Ouro checkpoint: priority and FCFS order,
seeded sampling, stop strings and stop ids, n > 1, logprobs, streaming deltas, abort, chat,
queue and length limits, and invalid requests that leave the others untouched."""

from __future__ import annotations

import pytest
import torch

from rlt_compile import LLM, SamplingParams, load_model
from rlt_compile.engine import LLMEngine, QueueFullError
from rlt_compile.models.runner import greedy_generate

PROMPT = "the capital of france is a city on the river"


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return load_model(tiny_dirs["ouro"])


@pytest.fixture
def llm(model):
    return LLM(model, num_blocks=96)


def greedy(max_tokens=6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def finish_order(eng: LLMEngine) -> list[str]:
    order = []
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    return order


def test_priority_request_submitted_last_finishes_first(model):
    eng = LLMEngine(model, num_blocks=96, max_num_seqs=1, scheduling_policy="priority")
    for i in range(5):
        eng.add_request(f"low{i}", [10 + i, 20, 30], greedy(3), priority=10)
    eng.add_request("high", [40, 50, 60], greedy(3), priority=0)
    assert finish_order(eng)[0] == "high"


def test_priority_preempts_running_low_priority(model):
    eng = LLMEngine(model, num_blocks=96, max_num_seqs=2, scheduling_policy="priority")
    for i in range(5):
        eng.add_request(f"low{i}", [10 + i, 20, 30], greedy(6), priority=10)
    eng.step()
    eng.step()  # low0 and low1 are decoding
    eng.add_request("high", [40, 50, 60], greedy(6), priority=0)
    order = finish_order(eng)
    assert order.index("high") <= 1  # only low0, which started first, may finish before it
    assert eng.stats.preemptions >= 1
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_fcfs_order(model):
    eng = LLMEngine(model, num_blocks=96, max_num_seqs=1)
    for i in range(4):
        eng.add_request(f"r{i}", [10 + i, 20], greedy(2), priority=-i)  # priority ignored under FCFS
    assert finish_order(eng) == ["r0", "r1", "r2", "r3"]


def test_seeded_sampling_reproducible_and_seeds_differ(llm):
    def sample(seed, batch_with_others=False):
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_tokens=8, seed=seed, ignore_eos=True)
        prompts = [PROMPT]
        plist = [params]
        if batch_with_others:
            prompts += ["hello world", "one two three"]
            plist += [SamplingParams(temperature=1.0, max_tokens=5)] * 2
        return llm.generate(prompts, plist, use_tqdm=False)[0].outputs[0].token_ids

    first = sample(1)
    assert sample(1) == first
    assert sample(1, batch_with_others=True) == first
    assert sample(2) != first


def test_greedy_generate_matches_runner_and_tokenizer(llm, model):
    out = llm.generate(PROMPT, greedy(5), use_tqdm=False)[0]
    ids = llm.tokenizer.encode(PROMPT)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == greedy_generate(model, ids, 5)[0]
    # the text continues the prompt's (vLLM's): a word-level tokenizer puts the first word's space in it
    tok, out_ids = llm.tokenizer, out.outputs[0].token_ids
    assert out.outputs[0].text.startswith(" ")
    assert tok.decode(ids) + out.outputs[0].text == tok.decode(ids + out_ids, skip_special_tokens=True)
    assert out.finished and out.outputs[0].finish_reason == "length"


def test_vllm_dict_prompts(llm):
    ids = llm.tokenizer.encode(PROMPT)
    want = llm.generate([PROMPT, ids], greedy(3), use_tqdm=False)
    got = llm.generate([{"prompt": PROMPT}, {"prompt_token_ids": ids}], greedy(3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.generate({"prompt_token_ids": ids}, greedy(3), use_tqdm=False)[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="^prompt: a dict prompt"):
        llm.generate([{"prompt": PROMPT, "multi_modal_data": {}}], greedy(3), use_tqdm=False)


def test_stop_token_ids_and_stop_strings(llm):
    base = llm.generate(PROMPT, greedy(8), use_tqdm=False)[0].outputs[0]
    tokens, words = base.token_ids, base.text.split(" ")
    stop_id = tokens[2]
    out = llm.generate(PROMPT, greedy(8, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id

    stop = words[3]
    cut = base.text.index(stop)
    out = llm.generate(PROMPT, greedy(8, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate(PROMPT, greedy(8, stop=stop, include_stop_str_in_output=True), use_tqdm=False)[0]
    assert out.outputs[0].text == base.text[: cut + len(stop)]


def _adjusted(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """The logits after ``params``' penalties and bias, written out token by token (the reference)."""
    logits = logits.clone()
    for t in set(prompt + output):
        r = params.repetition_penalty
        logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
    for t in set(output):
        logits[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    for t, bias in (params.logit_bias or {}).items():
        logits[t] += bias
    return logits


@pytest.mark.parametrize(
    "adjust",
    [
        dict(presence_penalty=1.5),
        dict(frequency_penalty=-0.7),
        dict(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1.2),
        dict(logit_bias={40: 3.0, 41: -100.0}),
    ],
)
def test_penalties_and_logit_bias_match_a_reference_loop(model, adjust):
    prompt, n = [5, 6, 7, 8, 9, 40, 41], 8
    params = greedy(n, **adjust)
    eng = LLMEngine(model, num_blocks=96)
    eng.add_request("a", prompt, params)
    got = eng.run_to_completion()["a"].outputs[0].token_ids
    output: list[int] = []
    for _ in range(n):
        logits = greedy_generate(model, prompt + output, 1)[1][0].float()
        output.append(int(_adjusted(logits, prompt, output, params).argmax()))
    assert got == output
    assert got != greedy_generate(model, prompt, n)[0]  # the adjustment changed what is generated


def _reference_prompt_logprobs(model, prompt: list[int], **options) -> list[torch.Tensor]:
    """log-softmax of the logits that predict each prompt token after the first, one plain forward
    per prefix (no engine, no cache reuse)."""
    return [
        torch.log_softmax(greedy_generate(model, prompt[:n], 1, **options)[1][0].float(), -1)
        for n in range(1, len(prompt))
    ]


def _check_prompt_logprobs(got, prompt: list[int], reference: list[torch.Tensor], k: int) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for token, entry, ref in zip(prompt[1:], got[1:], reference):
        top = ref.topk(k).indices.tolist()
        assert set(entry) == {token, *top}
        assert entry == pytest.approx({t: ref[t].item() for t in entry}, abs=1e-5)


def test_prompt_logprobs_match_the_model_in_chunks_and_with_n(model):
    """vLLM's prompt_logprobs: every prompt token after the first gets its logprob and the top k,
    also when the prompt is prefilled in chunks, and once per request with n > 1."""
    prompt = [5, 17, 9, 33, 2, 61, 40, 41, 7, 12, 90, 3, 25]
    reference = _reference_prompt_logprobs(model, prompt)
    for budget in (64, 5):  # one prefill, then chunks of 5
        eng = LLMEngine(model, num_blocks=96, max_num_batched_tokens=budget)
        eng.add_request("a", prompt, greedy(3, prompt_logprobs=2, n=2))
        eng.add_request("b", prompt[:4], greedy(3))  # no prompt logprobs asked for
        out = eng.run_to_completion()
        _check_prompt_logprobs(out["a"].prompt_logprobs, prompt, reference, 2)
        assert out["b"].prompt_logprobs is None
        assert out["a"].outputs[0].token_ids == greedy_generate(model, prompt, 3)[0]


def test_prompt_logprobs_bypass_the_prefix_cache_and_survive_preemption(model):
    prompt = list(range(20, 58))  # 38 tokens: two full 16-token blocks to cache
    reference = _reference_prompt_logprobs(model, prompt)
    eng = LLMEngine(model, num_blocks=96)
    eng.add_request("warm", prompt, greedy(2))
    eng.run_to_completion()
    eng.add_request("a", prompt, greedy(2, prompt_logprobs=0))
    _check_prompt_logprobs(eng.run_to_completion()["a"].prompt_logprobs, prompt, reference, 0)
    eng.add_request("b", prompt, greedy(2))
    assert eng.run_to_completion()["b"].num_cached_tokens == 32  # the cache still serves the others

    # a pool that cannot hold every request at once: preempted ones recompute, entries stay in order
    eng = LLMEngine(model, num_blocks=9, block_size=8, max_num_batched_tokens=16)
    for i in range(4):
        eng.add_request(str(i), prompt[i:], greedy(6, prompt_logprobs=1))
    out = eng.run_to_completion()
    assert eng.stats.preemptions > 0
    for i in range(4):
        _check_prompt_logprobs(
            out[str(i)].prompt_logprobs, prompt[i:], _reference_prompt_logprobs(model, prompt[i:]), 1
        )


def test_prompt_logprobs_with_a_per_request_exit_step(model):
    """Ouro's per-request exit options are per logits row: prompt rows take their request's."""
    prompt = [5, 17, 9, 33, 2, 61]
    eng = LLMEngine(model, num_blocks=96)
    eng.add_request("a", prompt, greedy(2, prompt_logprobs=1, exit_policy="fixed", exit_step=0))
    eng.add_request("b", [8, 9, 10], greedy(2))
    got = eng.run_to_completion()["a"].prompt_logprobs
    _check_prompt_logprobs(got, prompt, _reference_prompt_logprobs(model, prompt, exit_at_step=0), 1)
    full = _reference_prompt_logprobs(model, prompt)
    assert any(got[i + 1][t] != pytest.approx(full[i][t].item(), abs=1e-5) for i, t in enumerate(prompt[1:]))


def test_prompt_logprobs_rejected_where_unsupported(model):
    with pytest.raises(ValueError, match="^prompt_logprobs:"):
        SamplingParams(prompt_logprobs=-1)
    eng = LLMEngine(model, num_blocks=96)
    with pytest.raises(ValueError, match="^prompt_logprobs: 1000 exceeds"):
        eng.add_request("a", [5, 6], greedy(2, prompt_logprobs=1000))
    eng = LLMEngine(model, num_blocks=96, wavefront_prefill_chunk=8)
    with pytest.raises(ValueError, match="^prompt_logprobs: not supported with wavefront_prefill_chunk"):
        eng.add_request("a", [5, 6], greedy(2, prompt_logprobs=1))


def test_generation_config_sets_the_sampling_defaults(tiny_dirs, tmp_path, caplog):
    """As vLLM's ``--generation-config auto``: what a request leaves unset comes from the checkpoint's
    generation_config.json (max_new_tokens as max_tokens); "vllm" ignores it; a bad value is ignored
    with a warning rather than breaking every request."""
    import shutil

    folder = tmp_path / "ouro"
    shutil.copytree(tiny_dirs["ouro"], folder)
    (folder / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 3, "top_k": 5}')
    llm = LLM(str(folder), num_blocks=96)
    assert llm.engine.sampling_defaults == {"temperature": 0.0, "top_k": 5, "max_tokens": 3}
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_generate(llm.engine.model, [5, 6, 7], 3)[0]
    explicit = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert len(explicit.outputs[0].token_ids) == 5  # a request's own values win
    plain = LLM(str(folder), num_blocks=96, generation_config="vllm")
    assert plain.engine.sampling_defaults == {} and plain.engine.default_sampling_params() == SamplingParams()
    (folder / "generation_config.json").write_text('{"temperature": -1}')
    assert LLM(str(folder), num_blocks=96).engine.sampling_defaults == {}
    assert "ignored" in caplog.text
    with pytest.raises(ValueError, match="^generation_config:"):
        LLM(str(folder), num_blocks=96, generation_config="model")


def test_eos_stops_unless_ignored(model):
    eng = LLMEngine(model, num_blocks=96)
    ids = [5, 6, 7]
    first = greedy_generate(model, ids, 1)[0][0]
    eng.eos_token_ids = {first}  # pretend the model's first token is its eos
    eng.add_request("a", ids, SamplingParams(temperature=0, max_tokens=5))
    eng.add_request("b", ids, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    done = eng.run_to_completion()
    assert done["a"].outputs[0].token_ids == [first] and done["a"].outputs[0].finish_reason == "stop"
    assert len(done["b"].outputs[0].token_ids) == 5


def test_n_completions_share_prompt_blocks(llm):
    prompt = list(range(10, 50))  # 40 tokens: two full blocks shared
    single = llm.generate(prompt, greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    bm = llm.engine.block_manager
    hits = bm.stats.hits
    out = llm.generate(prompt, greedy(4, n=3), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == single for c in out.outputs)
    assert bm.stats.hits - hits >= 2 * 2 + 2  # first completion hits the earlier run; siblings hit it
    sampled = llm.generate(
        prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    assert bm.num_free_blocks == bm.num_blocks


def test_logprobs_match_model(llm, model):
    ids = [3, 9, 27, 81]
    out = llm.generate(ids, greedy(4, logprobs=3), use_tqdm=False)[0].outputs[0]
    tokens, logits = greedy_generate(model, ids, 4)
    ref = torch.log_softmax(logits, -1)
    assert out.token_ids == tokens and len(out.logprobs) == 4
    for step, (tok, entry) in enumerate(zip(tokens, out.logprobs)):
        assert len(entry) == 3 and tok in entry  # greedy token is in the top 3
        for tid, lp in entry.items():
            assert lp == pytest.approx(ref[step, tid].item(), abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(tokens, out.logprobs)))


def test_streaming_deltas_add_up(model):
    eng = LLMEngine(model, num_blocks=96, max_num_batched_tokens=4)
    rid = eng.add_request(None, [4, 5, 6, 7, 8, 9, 10], greedy(5))
    deltas = []
    while eng.has_unfinished():
        deltas += [o for o in eng.step() if o.request_id == rid]
    assert all(len(d.outputs[0].token_ids) == 1 for d in deltas)  # one new token each step
    assert [t for d in deltas for t in d.outputs[0].token_ids] == greedy_generate(model, [4, 5, 6, 7, 8, 9, 10], 5)[0]
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])


def test_abort_frees_blocks_and_others_continue(model):
    eng = LLMEngine(model, num_blocks=96)
    eng.add_request("keep", [5, 6, 7], greedy(5))
    eng.add_request("drop", list(range(4, 40)), greedy(5))
    outs = {o.request_id: o for o in eng.step()}
    assert eng.abort_request("drop") and not eng.abort_request("drop")
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id in outs:
                outs[o.request_id].merge(o)
            else:
                outs[o.request_id] = o
    assert outs["drop"].finished and outs["drop"].outputs[0].finish_reason == "abort"
    assert outs["keep"].outputs[0].token_ids == greedy_generate(model, [5, 6, 7], 5)[0]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_chat_uses_template(llm):
    messages = [{"role": "user", "content": "hello world"}]
    out = llm.chat(messages, greedy(3), use_tqdm=False)[0]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 3
    two = llm.chat([messages, [{"role": "user", "content": "one two"}]], greedy(2), use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids[:2]


def test_chat_template_errors_name_the_messages(llm, monkeypatch):
    from rlt_compile.engine.llm import chat_prompt_ids

    with pytest.raises(ValueError, match="^messages: this model has no chat template"):
        chat_prompt_ids(None, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="^messages: cannot apply the chat template"):
        llm.chat(
            [{"role": "user", "content": "hi"}], greedy(2), chat_template_kwargs={"tokenize": True}, use_tqdm=False
        )
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="^messages: this model has no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False)


def test_max_model_len_and_queue_limit(model):
    eng = LLMEngine(model, num_blocks=96, max_model_len=10, max_queue_size=2)
    eng.add_request("a", [1, 2, 3, 4, 5, 6, 7, 8], greedy(20))
    eng.add_request("b", [9, 10], greedy(2))
    with pytest.raises(QueueFullError, match="max_queue_size"):
        eng.add_request("c", [1], greedy(2))
    done = eng.run_to_completion()
    assert len(done["a"].outputs[0].token_ids) == 2 and done["a"].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", None, "prompt"),
        ([], None, "prompt"),
        ([5, -1], None, "prompt_token_ids"),
        ([5, 256], None, "prompt_token_ids"),
        (list(range(4, 80)), None, "prompt"),  # longer than max_model_len=64
        ([5], dict(max_tokens=0), "max_tokens"),
        ([5], dict(temperature=-1.0), "temperature"),
        ([5], dict(top_p=0.0), "top_p"),
        ([5], dict(top_p=1.2), "top_p"),
        ([5], dict(logprobs=1000), "logprobs"),
        ([5], dict(presence_penalty=2.5), "presence_penalty"),
        ([5], dict(frequency_penalty=-3), "frequency_penalty"),
        ([5], dict(logit_bias={3: 101.0}), "logit_bias"),
        ([5], dict(logit_bias={"3": 1.0}), "logit_bias"),
        ([5], dict(logit_bias={256: 1.0}), "logit_bias"),  # outside the vocabulary: add_request
    ],
)
def test_invalid_requests_raise_and_leave_others_unaffected(model, prompt, params, field):
    checked_by_engine = params in (dict(logprobs=1000), dict(logit_bias={256: 1.0}))  # need the vocabulary

    def fresh():
        eng = LLMEngine(model, num_blocks=96, max_model_len=64)
        eng.add_request("x", [5, 6, 7, 8], greedy(4))
        eng.add_request("y", [9, 10, 11], greedy(4))
        return eng

    clean = fresh().run_to_completion()
    eng = fresh()
    first = {o.request_id: o for o in eng.step()}
    with pytest.raises(ValueError, match=rf"^{field}:"):
        if params is not None and not checked_by_engine:
            SamplingParams(**params)  # caught at construction already ...
            raise AssertionError("SamplingParams accepted an invalid value")
        sp = SamplingParams(max_tokens=2, **(params or {}))
        eng.add_request("bad", prompt, sp)
    assert "bad" not in eng.requests
    if params is not None and not checked_by_engine:  # ... and again if mutated before add_request
        sp = greedy(2)
        setattr(sp, next(iter(params)), next(iter(params.values())))
        with pytest.raises(ValueError, match=rf"^{field}:"):
            eng.add_request("bad", [5], sp)
    for rid, out in eng.run_to_completion().items():
        first[rid].merge(out)
    assert {k: v.outputs[0].token_ids for k, v in first.items()} == {
        k: v.outputs[0].token_ids for k, v in clean.items()
    }
