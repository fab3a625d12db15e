"""torch.distributed on the CPU (gloo, 2 processes): tensor parallelism and KV transfer give the
same tokens as one process."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import FAMILIES, family_options

from rlt_compile import load_model
from rlt_compile.distributed import recv_kv, send_kv, tensor_parallel
from rlt_compile.models.runner import SimpleKVCache, greedy_generate

PROMPT = [5, 17, 42, 99, 3, 7, 61, 8, 23, 11, 4, 90, 33, 12, 6, 70, 2, 9]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, world: int, port: int, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, *args, world: int = 2):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_run, args=(world, _free_port(), fn, args, results), nprocs=world, join=True)
        return [results[r] for r in range(world)]


def _tp_generate(rank, world, path, family):
    model = tensor_parallel(load_model(path, load_tokenizer=False))
    assert model.kv_layout().num_kv_heads * world == model.full_kv_layout().num_kv_heads
    tokens, logits = greedy_generate(model, PROMPT, 8, **family_options(family))
    return tokens, logits


def _disaggregated(rank, world, path, family):
    """Rank 0 prefills and sends the KV blocks; rank 1 receives them and decodes."""
    model = load_model(path, load_tokenizer=False)
    opts = family_options(family)
    cache = SimpleKVCache(model, 1, len(PROMPT) + 8)
    if rank == 0:
        meta = cache.step_metadata([len(PROMPT)], "cpu")
        logits = model(
            torch.tensor(PROMPT),
            torch.arange(len(PROMPT)),
            cache.planes,
            meta,
            logits_indices=torch.tensor([len(PROMPT) - 1]),
            **opts,
        )
        first = int(logits[0].argmax())
        send_kv(cache.planes, cache.tables[0][: -(-len(PROMPT) // cache.block_size)], dst=1)
        dist.send(torch.tensor([first]), dst=1)
        return None
    # The decode rank stores the request in different blocks than the prefill rank used.
    used = -(-len(PROMPT) // cache.block_size)
    cache.tables[0] = list(reversed(cache.tables[0]))
    recv_kv(cache.planes, cache.tables[0][:used], src=0)
    first = torch.empty(1, dtype=torch.long)
    dist.recv(first, src=0)
    cache.lengths = [len(PROMPT)]
    tokens = [int(first)]
    for _ in range(7):
        pos = cache.lengths[0]
        meta = cache.step_metadata([1], "cpu")
        logits = model(torch.tensor(tokens[-1:]), torch.tensor([pos]), cache.planes, meta, **opts)
        tokens.append(int(logits[0].argmax()))
    return tokens


def _engine_tp(rank, world, path, family):
    from rlt_compile import LLM, SamplingParams

    llm = LLM(path, tensor_parallel_size=world, num_blocks=32, model_options=family_options(family))
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT[:5]], params, use_tqdm=False)]


def _both(rank, world, paths):
    """Every family, in one pair of processes (starting processes is the slow part)."""
    return {
        family: (
            _tp_generate(rank, world, path, family),
            _disaggregated(rank, world, path, family),
            _engine_tp(rank, world, path, family),
        )
        for family, path in paths.items()
    }


@pytest.fixture(scope="module")
def two_rank_results(tiny_dirs):
    return spawn(_both, {f: str(p) for f, p in tiny_dirs.items()})


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_two_ranks_equal_one_process(tiny_dirs, two_rank_results, family):
    model = load_model(tiny_dirs[family], load_tokenizer=False)
    want, want_logits = greedy_generate(model, PROMPT, 8, **family_options(family))
    for rank_results in two_rank_results:
        tokens, logits = rank_results[family][0]
        assert tokens == want
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_decode_disaggregation_gives_identical_tokens(tiny_dirs, two_rank_results, family):
    model = load_model(tiny_dirs[family], load_tokenizer=False)
    want, _ = greedy_generate(model, PROMPT, 8, **family_options(family))
    assert two_rank_results[1][family][1] == want


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_tensor_parallel_equals_one_process(tiny_dirs, two_rank_results, family):
    from rlt_compile import LLM, SamplingParams

    llm = LLM(str(tiny_dirs[family]), num_blocks=32, model_options=family_options(family))
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT[:5]], params, use_tqdm=False)]
    assert two_rank_results[0][family][2] == want
    assert two_rank_results[1][family][2] == want


def test_kv_heads_must_divide(tiny_dirs):
    model = load_model(tiny_dirs["nanbeige"], load_tokenizer=False)  # 2 KV heads
    with pytest.raises(ValueError, match="KV heads"):
        tensor_parallel(model, rank=0, world=4)
