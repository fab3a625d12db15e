"""Engine parts without a model: SamplingParams validation, block pool and prefix cache, scheduler
policies and preemption bookkeeping, sampler transforms, incremental detokenization."""

from __future__ import annotations

import pytest
import torch

from rlt_compile.engine import EngineConfig, SamplingParams
from rlt_compile.engine.block_manager import BlockManager
from rlt_compile.engine.detokenizer import detokenize_step
from rlt_compile.engine.outputs import CompletionOutput, RequestOutput
from rlt_compile.engine.sampler import Sampler, adjust_logits, filter_top_k_top_p
from rlt_compile.engine.scheduler import Scheduler
from rlt_compile.engine.sequence import Sequence, SequenceStatus

# -- SamplingParams ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("n", 0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.1),
        ("frequency_penalty", -2.1),
        ("frequency_penalty", True),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: -100.5}),
        ("logit_bias", [1.0]),
        ("logprobs", -1),
        ("stop", [""]),
        ("stop_token_ids", [-3]),
    ],
)
def test_sampling_params_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**{field: value})


def test_sampling_params_defaults_and_clone():
    p = SamplingParams(stop="x", temperature=0)
    assert p.greedy and p.stop_strings == ["x"] and p.max_tokens == 16
    q = p.clone(max_tokens=3)
    assert q.max_tokens == 3 and q.stop_strings == ["x"] and p.max_tokens == 16
    with pytest.raises(ValueError, match="^scheduling_policy:"):
        EngineConfig(scheduling_policy="lifo")


# -- block manager -------------------------------------------------------------------------------


def _seq(tokens, arrival=0, priority=0, params=None, index=0, parent=None) -> Sequence:
    return Sequence(
        f"r{arrival}", index, list(tokens), params or SamplingParams(temperature=0), priority, arrival, parent
    )


def test_block_pool_refcount_and_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq(range(10))
    assert bm.can_admit(a, [], 10)
    bm.admit(a, [])
    bm.grow(a, 10)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    assert not bm.can_grow(a, 4 * 9)
    bm.free_seq(a)
    assert bm.num_free_blocks == 8 and a.block_table == [] and a.num_computed_tokens == 0


def test_prefix_cache_chained_hashes_hits_and_backoff():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq(range(10))
    bm.admit(a, [])
    bm.grow(a, 10)
    a.num_computed_tokens = 10
    bm.commit(a)  # blocks 0..1 are full and computed
    assert len(a.block_hashes) == 2
    # a sequence sharing the first 9 tokens matches the two full blocks
    b = _seq([*range(9), 99])
    assert bm.match_prefix(b.token_ids) == a.block_table[:2]
    # same second block content after a different first block: the chain does not match
    assert bm.match_prefix([7, 7, 7, 7, 4, 5, 6, 7, 1]) == []
    # a fully cached sequence keeps one block to recompute
    assert bm.match_prefix(list(range(8))) == a.block_table[:1]
    bm.admit(b, bm.match_prefix(b.token_ids))
    assert b.num_computed_tokens == 8 and bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.stats.hits == 2 and bm.stats.misses == 2  # a: 2 misses, b: 2 hits
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_free_blocks == 8
    # freed blocks stay cached until reused ...
    assert bm.match_prefix(b.token_ids) != []
    # ... and are evicted when the pool hands them out again
    c = _seq(range(100, 132))
    bm.admit(c, [])
    bm.grow(c, 32)
    assert bm.match_prefix(b.token_ids) == []


def test_prefix_cache_disabled():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = _seq(range(8))
    bm.admit(a, [])
    bm.grow(a, 8)
    a.num_computed_tokens = 8
    bm.commit(a)
    assert bm.match_prefix(list(range(9))) == [] and bm.stats.queries == 0


# -- scheduler -----------------------------------------------------------------------------------


def _scheduler(num_blocks=64, block_size=4, **options) -> Scheduler:
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, **options)
    return Scheduler(config, BlockManager(num_blocks, block_size, config.enable_prefix_caching))


def _run_step(sched: Scheduler, batch) -> None:
    """What the engine does after a step: count computed tokens, append a token when sampled."""
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed_tokens += n
        sched.bm.commit(seq)
        if seq.num_computed_tokens == len(seq):
            seq.token_ids.append(1)


def test_scheduler_token_budget_chunks_prefill_and_mixes_decodes():
    sched = _scheduler(max_num_batched_tokens=8)
    a, b = _seq(range(3), arrival=0), _seq(range(20), arrival=1)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.num_tokens == [3, 5]
    _run_step(sched, batch)
    batch = sched.schedule()  # a decodes (1 token), b continues its prefill with the rest of the budget
    assert [s.arrival for s in batch.seqs] == [0, 1] and batch.num_tokens == [1, 7]


def test_scheduler_without_chunking_takes_whole_prompts():
    sched = _scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a, b = _seq(range(6), arrival=0), _seq(range(20), arrival=1)
    sched.add(a)
    sched.add(b)
    assert sched.schedule().num_tokens == [6]  # b does not fit beside a
    sched2 = _scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    sched2.add(_seq(range(20)))
    assert sched2.schedule().num_tokens == [20]  # alone it runs even over budget


def test_scheduler_max_num_seqs_and_priority_order():
    sched = _scheduler(max_num_seqs=2, scheduling_policy="priority")
    seqs = [_seq(range(4), arrival=i, priority=p) for i, p in enumerate([5, 5, 0, 1])]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert [s.priority for s in batch.seqs] == [0, 1]
    assert all(s.status is SequenceStatus.RUNNING for s in batch.seqs)


def test_admission_batch_waits_for_enough_free_slots():
    sched = _scheduler(max_num_seqs=4, admission_batch=2)
    seqs = [_seq(range(3), arrival=i) for i in range(7)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    assert [s.arrival for s in first.seqs] == [0, 1, 2, 3]
    _run_step(sched, first)
    sched.finish(seqs[0])  # one slot free: waiting requests stay waiting
    assert [s.arrival for s in sched.schedule().seqs] == [1, 2, 3]
    sched.finish(seqs[1])  # two free: both admitted in one step
    assert [s.arrival for s in sched.schedule().seqs] == [2, 3, 4, 5]
    for s in seqs[2:6]:
        sched.finish(s)
    assert [s.arrival for s in sched.schedule().seqs] == [6]  # fewer waiting than the batch: admitted


def test_admission_batch_default_and_validation():
    assert _scheduler(max_num_seqs=32).admission_batch == 1
    assert _scheduler(max_num_seqs=32, depth_batching=True).admission_batch == 8
    with pytest.raises(ValueError, match="admission_batch"):
        EngineConfig(max_num_seqs=4, admission_batch=5)


def test_scheduler_preempts_least_urgent_when_blocks_run_out():
    sched = _scheduler(num_blocks=4, block_size=4)
    a, b = _seq(range(7), arrival=0), _seq(range(7), arrival=1)
    b.token_ids[0] = 9  # no shared prefix
    sched.add(a)
    sched.add(b)
    _run_step(sched, sched.schedule())  # both prefilled (7 tokens + 1 sampled): 2 blocks each, pool full
    a.token_ids += [1]  # a now needs a third block
    batch = sched.schedule()
    assert b in batch.preempted and b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0 and b.block_table == [] and len(b) == 8  # keeps its tokens
    assert batch.seqs == [a]


def test_priority_waiting_request_preempts_lower_priority_running():
    sched = _scheduler(max_num_seqs=1, scheduling_policy="priority")
    low = _seq(range(4), arrival=0, priority=10)
    sched.add(low)
    _run_step(sched, sched.schedule())
    high = _seq(range(4), arrival=1, priority=0)
    sched.add(high)
    batch = sched.schedule()
    assert batch.seqs == [high] and low in batch.preempted and low in sched.waiting


# -- sampler -------------------------------------------------------------------------------------


def test_filters_and_penalty():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_top_k_top_p(logits, [2], [1.0])[0, 2:]).all()
    out = filter_top_k_top_p(logits, [0], [0.5])
    assert torch.isfinite(out[0, 0]) and torch.isinf(out[0, 1:]).all()
    seq = _seq([0, 1], params=SamplingParams(temperature=0, repetition_penalty=2.0))
    assert adjust_logits(torch.tensor([2.0, -2.0, 1.0]), seq).tolist() == [1.0, -4.0, 1.0]


def test_presence_frequency_penalties_count_output_tokens_and_bias_adds():
    params = SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={4: 3.0, 0: -1.0})
    seq = _seq([0, 1], params=params)
    seq.token_ids += [2, 2, 3]  # the output: token 2 twice, 3 once; prompt tokens 0 and 1 are not penalized
    row = torch.zeros(5)
    assert adjust_logits(row, seq).tolist() == [-1.0, 0.0, -2.0, -1.5, 3.0]
    assert row.tolist() == [0.0] * 5  # a new tensor
    assert params.needs_history and params.adjusts_logits
    bias_only = SamplingParams(logit_bias={1: 1.0})
    assert not bias_only.needs_history and bias_only.adjusts_logits  # no token history: no sync step
    assert not SamplingParams().adjusts_logits


def test_sampler_greedy_limits_and_seeds():
    sampler = Sampler("cpu", seed=0)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1).tolist()
    seqs = [
        _seq([1], params=SamplingParams(temperature=0)),
        _seq([1], params=SamplingParams(temperature=1.0, top_k=1)),
        _seq([1], params=SamplingParams(temperature=1.0, top_p=1e-6)),
        _seq([1], params=SamplingParams(temperature=1.0, min_p=1.0)),
    ]
    assert sampler(logits.clone(), seqs).token_ids == best

    def draws(seed, others):
        seq = _seq([1], params=SamplingParams(temperature=1.0, seed=seed))
        batch = [seq] + [_seq([1], params=SamplingParams(temperature=1.0)) for _ in range(others)]
        flat = torch.zeros(1 + others, 50)
        return [sampler(flat, batch).token_ids[0] for _ in range(20)]

    assert draws(7, 0) == draws(7, 3)  # independent of the rest of the batch
    assert draws(7, 0) != draws(8, 0)


def test_prompt_logprobs_recorded_in_chunks_equal_one_pass():
    from rlt_compile.engine.llm_engine import LLMEngine

    logits = torch.randn(7, 20, generator=torch.Generator().manual_seed(3))
    recorded = []
    for chunk in (512, 2):
        a = _seq([3, 9, 4, 11, 2], params=SamplingParams(prompt_logprobs=2))
        b = _seq([5, 6, 7, 8], params=SamplingParams(prompt_logprobs=0))
        rows = [(a, 0), (a, 1), (a, 2), (a, 3), (b, 0), (b, 1), (b, 2)]
        LLMEngine._record_prompt_logprobs(logits, rows, chunk=chunk)
        recorded.append((a.prompt_logprobs, b.prompt_logprobs))
    assert recorded[0] == recorded[1]
    (a_lps, b_lps) = recorded[0]
    ref = torch.log_softmax(logits, -1)
    assert a_lps[0] is None and len(a_lps) == 5 and len(a_lps[2]) in (2, 3)  # the token and the top 2
    assert a_lps[2][4] == pytest.approx(ref[1, 4].item()) and b_lps[3] == pytest.approx({8: ref[6, 8].item()})


def test_sampler_logprobs():
    sampler = Sampler("cpu")
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = sampler(logits, [_seq([1], params=SamplingParams(temperature=0, logprobs=2))])
    ref = torch.log_softmax(logits, -1)[0]
    assert out.token_ids == [1]
    assert out.logprobs[0] == pytest.approx({1: ref[1].item(), 2: ref[2].item()})


# -- outputs -------------------------------------------------------------------------------------


def test_request_output_merge():
    full = RequestOutput("a", None, [1], [CompletionOutput(0, "x", [5])])
    full.merge(RequestOutput("a", None, [1], [CompletionOutput(0, " y", [6], finish_reason="stop")], finished=True))
    assert full.outputs[0].text == "x y" and full.outputs[0].token_ids == [5, 6] and full.finished


# -- incremental detokenization ------------------------------------------------------------------


def _byte_tokenizer():
    """One token per UTF-8 byte (byte-level BPE without merges): characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


def _detokenize(tokenizer, prompt: list[int], output: list[int]) -> list[str]:
    """The text each output token adds, one token at a time, as the engine feeds them."""
    seq = _seq(prompt, params=SamplingParams(max_tokens=len(output)))
    pieces = []
    for token in output:
        seq.token_ids.append(token)
        pieces.append(detokenize_step(tokenizer, seq))
    assert "".join(pieces) == seq.text
    return pieces


def test_detokenized_text_continues_the_prompt():
    # the word-level tiny tokenizer drops a text's first space, as SentencePiece does
    from rlt_compile.tiny import build_tokenizer

    tok = build_tokenizer(256)
    prompt, output = tok.encode("one two three"), tok.encode("four five")
    assert tok.decode(output) == "four five"
    pieces = _detokenize(tok, prompt, output)
    assert pieces == [" four", " five"]
    assert tok.decode(prompt) + "".join(pieces) == tok.decode(prompt + output)


def test_detokenizer_holds_back_split_characters():
    tok = _byte_tokenizer()
    prompt, output = tok.encode("naïve "), tok.encode("é ü!")
    pieces = _detokenize(tok, prompt, output)
    assert len(output) == 6 and "".join(pieces) == "é ü!"
    assert pieces == ["", "é", " ", "", "ü", "!"]  # nothing is sent until a character is whole


def test_detokenizer_completes_a_character_the_prompt_splits():
    # a prompt given as token ids may stop inside a character: the output's text starts with it whole
    tok = _byte_tokenizer()
    ids = tok.encode("naïve é ok")
    prompt, output = ids[:8], ids[8:]  # "naïve " (7 bytes) and é's first byte
    assert tok.decode(prompt).endswith("\ufffd")
    assert "".join(_detokenize(tok, prompt, output)) == "é ok"
