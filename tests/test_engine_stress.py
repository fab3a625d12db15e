"""Randomized engine stress test: the scheduler's features all at once, on tiny fp32 models of each family.

A seeded random schedule drives ``LLMEngine.step`` by hand, synchronous and with
``async_scheduling=True``: requests arrive at random steps with random prompts (many sharing common
prefixes, some repeated whole, so the prefix cache hits), priorities, ``max_tokens``, ``min_tokens``,
stop ids, eos handling, ``n`` and greedy or seeded sampling; some are aborted a few steps later
(waiting or running). Each seed draws the engine's block size, a KV pool that holds the longest
request but not many (preemption), a token budget of a few tokens (chunked prefill), the sequence
cap, the policy and prefix caching on or off; every engine serves two waves of requests (the second
one on a warm prefix cache, after the first finished). Checked:

1. every request that was not aborted finishes with the tokens of the same request run alone
   (greedy: ``greedy_generate``; seeded: a fresh engine), cut by its own stop rules, with the
   matching finish and stop reasons;
2. an aborted request's blocks are released at once, and its only output after the abort is one
   final delta without tokens (every open completion ``abort``); its tokens so far are a prefix
   of the reference;
3. after every step each block's reference count equals the block-table references of the live
   sequences (free list = unreferenced blocks); at the end the pool is entirely free and cached
   blocks are only evictable;
4. nothing is left running, waiting, pending or in flight;

and that preemption, prefix-cache hits, chunked prefills and both kinds of abort really happened.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from functools import cache

import pytest
from conftest import FAMILIES, family_options
from test_async_engine import one_thread  # noqa: F401 (autouse fixture)
from test_engine_parity import engine, models  # noqa: F401 (fixture)

from rlt_compile.engine import LLMEngine, RequestOutput, SamplingParams
from rlt_compile.engine.sequence import SequenceStatus
from rlt_compile.models.runner import greedy_generate

MAX_PROMPT = 40
MAX_TOKENS = 12
MAX_MODEL_LEN = 48  # cuts some requests short of max_tokens
NUM_REQUESTS = 14  # per wave
SAMPLED = dict(temperature=0.8, top_k=40)  # seeded requests draw from their own generator: batch invariant
SEEDS = range(4)


@dataclass
class Planned:
    rid: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrive: int  # the step before which it is added
    abort: int | None  # the step before which it is aborted

    @property
    def key(self) -> tuple:
        return tuple(self.prompt), self.params.seed, self.params.n


@pytest.fixture(scope="module")
def reference(models):  # noqa: F811
    """(family, prompt, seed, n) -> per completion, the first MAX_TOKENS tokens of the request run alone
    without stop rules: greedy (seed None) through ``greedy_generate``, seeded on a fresh engine."""

    @cache
    def tokens(family: str, prompt: tuple[int, ...], seed: int | None, n: int) -> tuple[tuple[int, ...], ...]:
        if seed is None:
            out, _ = greedy_generate(models[family], list(prompt), MAX_TOKENS, **family_options(family))
            return (tuple(out),) * n
        eng = engine(models[family], family)
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed, n=n, **SAMPLED)
        rid = eng.add_request(None, list(prompt), params)
        return tuple(tuple(c.token_ids) for c in eng.run_to_completion()[rid].outputs)

    return tokens


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 256) for _ in range(n)]


def plan_requests(rng: random.Random, name: str, shared: list[list[int]], alone) -> list[Planned]:
    plans: list[Planned] = []
    for i in range(NUM_REQUESTS):
        if plans and rng.random() < 0.1:
            prompt = list(rng.choice(plans).prompt)  # fully cached: the last block is recomputed
        else:
            head = rng.choice(shared) if rng.random() < 0.6 else []
            prompt = head + random_tokens(rng, rng.randint(0 if head else 1, MAX_PROMPT - len(head)))
        seed = rng.randrange(1000) if rng.random() < 0.3 else None
        n = 2 if rng.random() < 0.1 else 1
        stop = None
        if rng.random() < 0.4:  # one id the request really generates, one it likely does not
            stop = [rng.choice(alone(tuple(prompt), seed, n)[0]), rng.randrange(4, 256)]
        max_tokens = rng.randint(1, MAX_TOKENS)
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=rng.randint(0, max_tokens) if rng.random() < 0.2 else 0,
            stop_token_ids=stop,
            ignore_eos=rng.random() < 0.5,
            n=n,
            seed=seed,
            **(SAMPLED if seed is not None else dict(temperature=0)),
        )
        arrive = rng.randint(0, 30)
        abort = arrive + rng.randint(0, 12) if rng.random() < 0.25 else None
        plans.append(Planned(f"{name}{i}", prompt, params, rng.randint(0, 3), arrive, abort))
    return plans


def expected(p: Planned, tokens: tuple[int, ...], eos: set[int]) -> tuple[list[int], str, int | None]:
    """``tokens`` cut by the request's stop rules; the finish reason and the stop reason."""
    params, out = p.params, []
    for token in tokens[: min(params.max_tokens, MAX_MODEL_LEN - len(p.prompt))]:
        out.append(token)
        if len(out) < params.min_tokens:
            continue
        if token in (params.stop_token_ids or ()):
            return out, "stop", token
        if not params.ignore_eos and token in eos:
            return out, "stop", None
    return out, "length", None


def check_pool(eng: LLMEngine) -> None:
    """Reference counts are exactly the live sequences' block-table entries; free = unreferenced."""
    bm, sched = eng.block_manager, eng.scheduler
    refs = Counter(b for seq in sched.running + sched.waiting for b in seq.block_table)
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id], block
        assert (block.ref_count == 0) == (block.block_id in bm.free), block
    for h, block_id in bm.cached.items():
        assert bm.blocks[block_id].hash == h


@dataclass
class Coverage:
    preemptions: int = 0
    prefix_hits: int = 0
    chunked_prefills: int = 0
    aborted_waiting: int = 0
    aborted_running: int = 0


def count_chunks(eng: LLMEngine, coverage: Coverage) -> None:
    """Wrap the scheduler to count prefill chunks that stop short of their sequence's end."""
    schedule = eng.scheduler.schedule

    def spy():
        batch = schedule()
        for seq, n in zip(batch.seqs, batch.num_tokens):
            coverage.chunked_prefills += seq.num_computed_tokens + n < len(seq)
        return batch

    eng.scheduler.schedule = spy


def abort(eng: LLMEngine, rid: str, coverage: Coverage) -> bool:
    """Abort ``rid`` if it is still in flight; its sequences must be gone from everywhere at once."""
    request = eng.requests.get(rid)
    if request is None:  # already finished
        return False
    running = any(s.status is SequenceStatus.RUNNING for s in request.seqs)
    assert eng.abort_request(rid)
    sched = eng.scheduler
    for seq in request.seqs:
        assert seq.is_finished and not seq.block_table
        assert seq not in sched.running and seq not in sched.waiting
        if eng.async_scheduler is not None:
            assert seq not in eng.async_scheduler.pending
    if running:
        coverage.aborted_running += 1
    else:
        coverage.aborted_waiting += 1
    return True


def drive(eng: LLMEngine, plans: list[Planned], coverage: Coverage) -> tuple[dict[str, RequestOutput], set[str]]:
    """Run the schedule; every request's merged output, and the ids really aborted."""
    arrivals, aborts = {}, {}
    for p in plans:
        arrivals.setdefault(p.arrive, []).append(p)
        if p.abort is not None:
            aborts.setdefault(p.abort, []).append(p)
    last_event = max([*arrivals, *aborts])
    merged: dict[str, RequestOutput] = {}
    aborted: set[str] = set()
    step = 0
    while step <= last_event or eng.has_unfinished():
        assert step < 1000, "the engine stopped making progress"
        for p in arrivals.get(step, []):
            eng.add_request(p.rid, p.prompt, p.params, priority=p.priority)
        for p in aborts.get(step, []):
            if abort(eng, p.rid, coverage):
                aborted.add(p.rid)
        for out in eng.step():
            rid = out.request_id
            assert not (rid in merged and merged[rid].finished), f"{rid}: output after its final one"
            if rid in aborted:  # the only output after an abort: no tokens, every open completion aborted
                assert out.finished and all(c.token_ids == [] and c.finish_reason == "abort" for c in out.outputs), out
            if rid in merged:
                merged[rid].merge(out)
            else:
                merged[rid] = out
        check_pool(eng)
        step += 1
    return merged, aborted


def check_idle(eng: LLMEngine, drain: bool) -> None:
    sched, bm = eng.scheduler, eng.block_manager
    assert not sched.running and not sched.waiting and not eng.requests and not eng.has_unfinished()
    if eng.async_scheduler is not None:
        assert not eng.async_scheduler.pending
        if drain:
            assert eng.async_scheduler.drain() == []  # at most discarded speculative rows were in flight
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert all(b in bm.free for b in bm.cached.values())  # cached blocks are only evictable


def check_outputs(plans, merged, aborted, alone, eos, context) -> None:
    for p in plans:
        out = merged[p.rid]
        assert out.finished and sorted(c.index for c in out.outputs) == list(range(p.params.n)), (context, p, out)
        for c in out.outputs:
            tokens, reason, stop_reason = expected(p, alone(*p.key)[c.index], eos)
            if p.rid in aborted and c.finish_reason == "abort":
                assert c.token_ids == tokens[: len(c.token_ids)], (context, p, c)
            else:  # n > 1: a completion that finished before the abort keeps its own finish
                assert (c.token_ids, c.finish_reason, c.stop_reason) == (tokens, reason, stop_reason), (context, p, c)
        if p.rid in aborted:
            assert any(c.finish_reason == "abort" for c in out.outputs), (context, p, out)


def engine_options(rng: random.Random) -> dict:
    block_size = rng.choice([2, 4, 8])
    return dict(
        block_size=block_size,
        # the longest request fits alone, a few together do not: preemption
        num_blocks=MAX_MODEL_LEN // block_size + rng.randint(0, 4),
        max_num_batched_tokens=rng.choice([3, 5, 8]),  # prefills are chunked
        max_num_seqs=rng.choice([2, 3, 6]),
        scheduling_policy=rng.choice(["fcfs", "priority"]),
        enable_prefix_caching=rng.random() < 0.8,
    )


def run_seed(model, family: str, seed: int, async_scheduling: bool, reference, coverage: Coverage) -> None:
    rng = random.Random(seed)
    options = engine_options(rng)
    eng = engine(model, family, max_model_len=MAX_MODEL_LEN, async_scheduling=async_scheduling, **options)
    count_chunks(eng, coverage)
    prefixes = [random_tokens(rng, rng.randint(4, 24)) for _ in range(3)]

    def alone(prompt, seed, n):
        return reference(family, prompt, seed, n)

    # the second wave reuses the engine: a warm prefix cache, and (async) a discarded step still in flight
    for wave in range(2):
        plans = plan_requests(rng, f"w{wave}r", prefixes, alone)
        merged, aborted = drive(eng, plans, coverage)
        check_idle(eng, drain=wave == 1)
        check_outputs(plans, merged, aborted, alone, eng.eos_token_ids, (seed, wave, options))
    coverage.preemptions += eng.stats.preemptions
    coverage.prefix_hits += eng.block_manager.stats.hits


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("family", FAMILIES)
def test_random_schedule_matches_alone_and_frees_everything(models, reference, family, async_scheduling):  # noqa: F811
    coverage = Coverage()
    for seed in SEEDS:
        run_seed(models[family], family, seed, async_scheduling, reference, coverage)
    assert coverage.preemptions > 0, coverage
    assert coverage.prefix_hits > 0, coverage
    assert coverage.chunked_prefills > 0, coverage
    assert coverage.aborted_waiting > 0 and coverage.aborted_running > 0, coverage
