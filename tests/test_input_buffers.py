"""InputBuffers (engine/input_buffers.py): packed static buffers for every step input.

CPU: the staged tensors equal ``build_metadata`` and the synchronous runner's inputs for random
mixed batches; placeholders become device-gather indices; two buffer sets alternate and a
step's views survive the next step; the buffers grow when a step exceeds them; two copies per step;
UVA stays off without a GPU. GPU (``-m gpu``): the side-stream copy path, a reuse hazard check, and
UVA views (aliasing, host writes visible to torch and Triton kernels) when the platform allows.
"""

from __future__ import annotations

import random

import pytest
import torch

from rlt_compile.engine.input_buffers import PLACEHOLDER, InputBuffers, SeqChunk, uva_self_test, uva_view
from rlt_compile.kernels.metadata import build_metadata

BLOCK = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_batch(rng: random.Random, num_seqs: int, placeholders: bool = False):
    """Chunks plus the expected flat tensors (ids with placeholders already filled from ``prev``)."""
    chunks, expected_ids, prev_rows = [], [], {}
    prev = torch.arange(500, 500 + num_seqs)  # the previous step's sampled ids, one row per sequence
    for i in range(num_seqs):
        start = rng.randrange(0, 40)
        n = 1 if rng.random() < 0.5 else rng.randrange(2, 9)
        blocks = rng.sample(range(100), -(-(start + n) // BLOCK) + rng.randrange(0, 2))
        ids = [rng.randrange(3, 250) for _ in range(n)]
        gather = None
        want = list(ids)
        if placeholders and rng.random() < 0.5:
            ids[-1] = PLACEHOLDER  # the sequence's newest token is still on the device
            gather = {n - 1: i}
            want[-1] = int(prev[i])
            prev_rows[i] = i
        chunks.append(SeqChunk(ids, start, blocks, rng.random() < 0.7, gather))
        expected_ids += want
    return chunks, expected_ids, prev


def expected_tensors(chunks):
    attn = build_metadata(
        [len(c.token_ids) for c in chunks], [c.start for c in chunks], [c.block_table for c in chunks], BLOCK
    )
    positions = [p for c in chunks for p in range(c.start, c.start + len(c.token_ids))]
    logits, t = [], 0
    for c in chunks:
        t += len(c.token_ids)
        if c.sample:
            logits.append(t - 1)
    return attn, positions, logits


def check(staged, chunks, ids):
    attn, positions, logits = expected_tensors(chunks)
    assert staged.input_ids.tolist() == ids
    assert staged.positions.tolist() == positions
    assert staged.logits_indices.tolist() == logits
    for got, want in zip(staged.attn, attn):
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want), (got, want)


def apply_gather(staged, prev):
    if staged.num_gather:
        staged.input_ids.index_copy_(0, staged.gather_dst, prev.to(staged.input_ids.device)[staged.gather_src])


def test_stage_equals_build_metadata_for_random_mixed_batches():
    rng = random.Random(0)
    buffers = InputBuffers("cpu", max_tokens=256, max_seqs=16, max_blocks_per_seq=32)
    for trial in range(30):
        chunks, ids, prev = random_batch(rng, rng.randrange(1, 16), placeholders=trial % 2 == 1)
        staged = buffers.stage(chunks, BLOCK)
        apply_gather(staged, prev)
        check(staged, chunks, ids)
    assert buffers.copies == 2 * 30  # one int64 and one int32 copy per step
    assert not buffers.uva


def test_placeholders_are_zero_on_the_host_and_gathered_on_the_device():
    buffers = InputBuffers("cpu", max_tokens=64, max_seqs=4, max_blocks_per_seq=8)
    chunks = [
        SeqChunk([PLACEHOLDER], 5, [3, 7], True, {0: 2}),
        SeqChunk([11, 12, 13], 0, [1], False),
        SeqChunk([21, PLACEHOLDER], 8, [2, 4, 6], True, {1: 0}),
    ]
    staged = buffers.stage(chunks, BLOCK)
    assert staged.input_ids.tolist() == [0, 11, 12, 13, 21, 0]
    assert staged.gather_dst.tolist() == [0, 5] and staged.gather_src.tolist() == [2, 0]
    apply_gather(staged, torch.tensor([70, 71, 72]))
    assert staged.input_ids.tolist() == [72, 11, 12, 13, 21, 70]
    assert staged.attn.slot_mapping.tolist() == [7 * 4 + 1, 4, 5, 6, 6 * 4 + 0, 6 * 4 + 1]
    assert staged.attn.seq_lens.tolist() == [6, 3, 10]
    assert staged.attn.query_start_loc.tolist() == [0, 1, 4, 6]
    assert staged.logits_indices.tolist() == [0, 5]


def test_two_sets_alternate_and_a_step_survives_the_next():
    rng = random.Random(1)
    buffers = InputBuffers("cpu", max_tokens=128, max_seqs=8, max_blocks_per_seq=16)
    a_chunks, a_ids, _ = random_batch(rng, 5)
    b_chunks, b_ids, _ = random_batch(rng, 7)
    a = buffers.stage(a_chunks, BLOCK)
    b = buffers.stage(b_chunks, BLOCK)
    assert (a.set_index, b.set_index) == (0, 1)
    check(a, a_chunks, a_ids)  # step n's inputs are intact while step n+1 is staged
    check(b, b_chunks, b_ids)
    c_chunks, c_ids, _ = random_batch(rng, 3)
    c = buffers.stage(c_chunks, BLOCK)
    assert c.set_index == 0
    check(c, c_chunks, c_ids)
    # static: the views alias the buffers allocated once
    assert c.input_ids.data_ptr() == buffers.dev64[0].data_ptr() == a.input_ids.data_ptr()


def test_buffers_grow_for_a_step_larger_than_allocated():
    rng = random.Random(2)
    buffers = InputBuffers("cpu", max_tokens=4, max_seqs=2, max_blocks_per_seq=2)
    chunks = [SeqChunk(list(range(3, 40)), 0, list(range(10)), True), SeqChunk([5], 3, [11], True)]
    staged = buffers.stage(chunks, BLOCK)
    check(staged, chunks, list(range(3, 40)) + [5])
    assert buffers.cap64 >= 3 * 38 + 2
    more, ids, _ = random_batch(rng, 6)
    check(buffers.stage(more, BLOCK), more, ids)


def test_uva_stays_off_without_a_gpu(monkeypatch):
    buffers = InputBuffers("cpu", max_tokens=8, max_seqs=2, max_blocks_per_seq=2, uva=True)
    assert not buffers.uva and "cpu" in buffers.uva_reason
    monkeypatch.setenv("RLT_UVA", "1")
    assert not InputBuffers("cpu", max_tokens=8, max_seqs=2, max_blocks_per_seq=2).uva
    with pytest.raises(ValueError, match="pinned"):
        uva_view(torch.zeros(4, dtype=torch.int64), torch.device("cpu"))


# -- GPU ----------------------------------------------------------------------------------------------
no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu)")


@pytest.mark.gpu
@no_cuda
@pytest.mark.parametrize("side_stream", ["1", "0"])
def test_cuda_copy_path_side_stream_and_reuse_hazard(monkeypatch, side_stream):
    """Copies on the side stream (default) or, with ``RLT_COPY_STREAM=0``, on the compute stream."""
    monkeypatch.setenv("RLT_COPY_STREAM", side_stream)
    rng = random.Random(3)
    buffers = InputBuffers("cuda", max_tokens=256, max_seqs=16, max_blocks_per_seq=32, uva=False)
    assert (buffers.copy_stream is not None) == (side_stream == "1") and not buffers.uva
    assert buffers.host64[0].is_pinned() and buffers.dev64[0].is_cuda
    kept = []
    for _ in range(12):
        chunks, ids, prev = random_batch(rng, rng.randrange(1, 16), placeholders=True)
        staged = buffers.stage(chunks, BLOCK)
        apply_gather(staged, prev)
        # a consumer on the compute stream (what the model does), then the set is released
        snapshot = [staged.input_ids.clone(), *(t.clone() for t in staged.attn)]
        buffers.release(staged)
        kept.append((snapshot, chunks, ids))
    torch.cuda.synchronize()
    for snapshot, chunks, ids in kept:  # no step saw a later step's values
        attn, _, _ = expected_tensors(chunks)
        assert snapshot[0].tolist() == ids
        for got, want in zip(snapshot[1:], attn):
            assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@no_cuda
def test_cuda_uva_views_alias_pinned_memory():
    problem = uva_self_test(torch.device("cuda", torch.cuda.current_device()))
    if problem is not None:
        pytest.skip(f"UVA in-place reads unavailable here: {problem}")
    host = torch.arange(64, dtype=torch.int64).pin_memory()
    view = uva_view(host, torch.device("cuda", torch.cuda.current_device()))
    assert view.is_cuda and view.data_ptr() == host.data_ptr()
    host[5] = 1234
    torch.cuda.synchronize()
    assert int((view + 0)[5]) == 1234
    rng = random.Random(4)
    buffers = InputBuffers("cuda", max_tokens=128, max_seqs=8, max_blocks_per_seq=16, uva=True)
    assert buffers.uva and buffers.copy_stream is None
    for _ in range(6):
        chunks, ids, prev = random_batch(rng, rng.randrange(1, 8), placeholders=True)
        staged = buffers.stage(chunks, BLOCK)
        apply_gather(staged, prev)
        check(staged, chunks, ids)
        buffers.release(staged)
    assert buffers.copies == 0
