"""CudaGraphRunner logic that needs no GPU: buckets, padding math, static buffers, fallback.

On the CPU the runner runs with ``use_graphs=False``: same static buffers and padding, the step is
called instead of replayed. The GPU tests (graph capture and replay) are in test_graphs_gpu.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model

from rlt_compile.compiler import compile_model
from rlt_compile.graphs import CudaGraphRunner, default_buckets, normalize_buckets, padded_decode_metadata, pick_bucket
from rlt_compile.kernels.attention_config import current_decode_context_limit
from rlt_compile.kernels.metadata import build_metadata

BLOCK = 16


def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(8) == [1, 2, 4, 8]
    assert default_buckets(6) == [1, 2, 4, 6]
    assert default_buckets(256)[-3:] == [64, 128, 256]
    with pytest.raises(ValueError):
        default_buckets(0)


def test_custom_buckets_and_picking():
    buckets = normalize_buckets([8, 3, 3, 1], max_num_seqs=8)
    assert buckets == [1, 3, 8]
    assert [pick_bucket(buckets, n) for n in (1, 2, 3, 4, 8, 9)] == [1, 3, 3, 8, 8, None]
    with pytest.raises(ValueError):
        normalize_buckets([0, 2], 4)
    with pytest.raises(ValueError):
        normalize_buckets([], 4)


def test_padded_decode_metadata():
    attn = build_metadata([1, 1, 1], [4, 20, 0], [[3], [5, 6], [7]], BLOCK)
    padded, n = padded_decode_metadata(attn, 4, max_blocks_per_seq=3)
    assert n == 3
    assert padded.slot_mapping.tolist() == [3 * 16 + 4, 6 * 16 + 4, 7 * 16, -1]
    assert padded.seq_lens.tolist() == [5, 21, 1, 0]
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 3]  # the padding sequence has no query
    assert padded.block_tables.tolist() == [[3, 0, 0], [5, 6, 0], [7, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="decode-only"):
        padded_decode_metadata(build_metadata([2], [0], [[0]], BLOCK), 4, 3)
    with pytest.raises(ValueError, match="do not fit"):
        padded_decode_metadata(attn, 2, 3)
    with pytest.raises(ValueError, match="wide"):
        padded_decode_metadata(attn, 4, 1)


def tiny(family: str):
    return tiny_model(family, seed=5)


def prefill(model, planes, prompts, tables, opts):
    meta = build_metadata([len(p) for p in prompts], [0] * len(prompts), tables, BLOCK)
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        model(ids, pos, planes, meta, **opts)


def decode_batch(lengths, tables, seed):
    gen = torch.Generator().manual_seed(seed)
    n = len(lengths)
    meta = build_metadata([1] * n, lengths, tables, BLOCK)
    return torch.randint(0, 256, (n,), generator=gen), torch.tensor(lengths), meta, torch.arange(n)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_padding_rows_never_change_real_rows(family):
    """3 sequences decoded in the 4-row bucket (and 5 in the 8-row one) give the eager unpadded
    logits, and the KV planes end up exactly as after the unpadded step (padding writes nothing)."""
    model = tiny(family)
    opts = {"init_scale": 0.0} if family == "huginn" else {}
    prompts = [[5, 6, 7], [8] * 20, [9, 10], [11] * 7, [12]]
    tables = [[2 * i, 2 * i + 1] for i in range(len(prompts))]
    planes = model.allocate_kv_cache(12, BLOCK)
    prefill(model, planes, prompts, tables, opts)
    runner = CudaGraphRunner(model, planes, max_num_seqs=8, max_blocks_per_seq=4, step_options=opts)
    assert runner.buckets == [1, 2, 4, 8] and not runner.use_graphs
    runner.capture()  # warm-up steps on all-padding batches must leave the cache alone
    ref_planes = [p.clone() for p in planes]
    for n, bucket in ((3, 4), (5, 8), (1, 1)):
        lengths = [len(p) for p in prompts[:n]]
        ids, pos, meta, rows = decode_batch(lengths, tables[:n], seed=n)
        assert runner.can_run(n, n) and runner.bucket_for(n) == bucket
        got = runner(ids, pos, meta, rows)
        with torch.no_grad():
            want = model(ids, pos, ref_planes, copy.deepcopy(meta), rows, **opts)
        assert got.shape == want.shape == (n, model.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for p, r in zip(planes, ref_planes):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-5)
            assert torch.equal(p != 0, r != 0)  # the same slots written, no others
        # the static buffers hold the padded batch
        assert runner.slot_mapping[n:bucket].eq(-1).all()
        assert runner.seq_lens[n:bucket].eq(0).all()
        assert runner.query_start_loc[n : bucket + 1].eq(n).all()
    assert runner.replays == 3 and runner.fallbacks == 0


def _static_buffers(runner):
    return [t.clone() for t in (runner.input_ids, runner.positions, runner.slot_mapping, runner.block_tables,
                                runner.seq_lens, runner.query_start_loc, runner.logits_indices,
                                *runner.row_buffers.values())]  # fmt: skip


def test_grouped_fill_matches_a_copy_per_buffer(monkeypatch):
    """``fill`` writes the static buffers exactly as one ``copy_`` per buffer would, padding, narrow
    block tables and per-row options included, and stale values of a wider, larger batch are
    overwritten. At one row with full-width tables it takes one multi-tensor copy per dtype."""
    import rlt_compile.graphs as graphs

    planes = [torch.zeros(2, 10, BLOCK, 1, 4)]
    rows = {"exit_at_step": (torch.long, -1), "threshold": (torch.float32, 2.0)}
    runners = [CudaGraphRunner(lambda *a, **k: None, planes, 8, 4, use_graphs=False, row_options=rows) for _ in "ab"]
    gen = torch.Generator().manual_seed(0)
    batches = [(6, 4), (3, 2), (1, 4), (5, 1), (8, 3)]  # (sequences, block table width), stale rows in between
    for n, width in batches:
        lengths = torch.randint(0, width * BLOCK, (n,), generator=gen).tolist()
        tables = torch.randint(0, 10, (n, width), generator=gen).tolist()
        ids, pos, meta, logits_rows = decode_batch(lengths, tables, seed=n)
        values = {"exit_at_step": torch.randint(0, 4, (n,), generator=gen), "threshold": torch.rand(n, generator=gen)}
        bucket = runners[0].bucket_for(n)
        for runner, grouped in zip(runners, (True, False)):
            monkeypatch.setattr(graphs, "FOREACH_FILL", grouped)
            runner.fill(bucket, ids, pos, meta, logits_rows, values)
        for got, want in zip(_static_buffers(runners[0]), _static_buffers(runners[1])):
            assert torch.equal(got, want)
        assert runners[0].block_tables[:n, width:].eq(0).all() and runners[0].block_tables[n:bucket].eq(0).all()
        assert runners[0].block_tables[:n, :width].tolist() == tables
        assert runners[0].row_buffers["threshold"][n:bucket].eq(2.0).all()
    monkeypatch.setattr(graphs, "FOREACH_FILL", True)
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s, **k: (calls.append(len(d)), real(d, s, **k)))
    plain = CudaGraphRunner(lambda *a, **k: None, planes, 8, 4, use_graphs=False)
    ids, pos, meta, logits_rows = decode_batch([5], [[1, 2, 3, 4]], seed=1)
    plain.fill(1, ids, pos, meta, logits_rows)
    assert sorted(calls) == [3, 4]  # int32: seq_lens, query_start_loc, block table; int64: the other four


def test_fallback_above_the_largest_bucket_and_for_prefill():
    model = tiny("nanbeige")
    planes = model.allocate_kv_cache(12, BLOCK)
    prompts = [[1, 2, 3]] * 5
    tables = [[i] for i in range(5)]
    prefill(model, planes, prompts, tables, {})
    runner = CudaGraphRunner(model, planes, max_num_seqs=4, max_blocks_per_seq=2, buckets=[2, 4]).capture()
    assert runner.can_run(4, 4) and not runner.can_run(5, 5) and not runner.can_run(6, 3)
    ref_planes = [p.clone() for p in planes]
    ids, pos, meta, rows = decode_batch([3] * 5, tables, seed=1)
    got = runner(ids, pos, meta, rows)  # 5 > 4: eager fallback
    with torch.no_grad():
        want = model(ids, pos, ref_planes, meta, rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert runner.fallbacks == 1 and runner.replays == 0


def test_block_tables_wider_than_the_static_buffer_are_an_error():
    model = tiny("nanbeige")
    planes = model.allocate_kv_cache(8, BLOCK)
    runner = CudaGraphRunner(model, planes, max_num_seqs=2, max_blocks_per_seq=1).capture()
    ids, pos, meta, rows = decode_batch([20], [[0, 1]], seed=0)
    with pytest.raises(ValueError, match="wide"):
        runner(ids, pos, meta, rows)


def test_runner_needs_a_gpu_for_graphs():
    model = tiny("nanbeige")
    with pytest.raises(RuntimeError, match="need the KV cache on a GPU"):
        CudaGraphRunner(model, model.allocate_kv_cache(2, BLOCK), 2, 2, use_graphs=True)
    cm = compile_model(model, "cpu", inductor=False)
    with pytest.raises(RuntimeError, match="need a GPU platform"):
        cm.capture_graphs(model.allocate_kv_cache(2, BLOCK), 2, 2)


def test_short_context_graphs_serve_narrow_block_tables():
    """Small buckets get one step per context bucket, run under ``decode_context_limit``; a batch
    takes the smallest context its block tables fit, and results match the plain model."""
    model = tiny("nanbeige")
    planes = model.allocate_kv_cache(24, BLOCK)
    seen = []

    def step(*args, **kwargs):
        seen.append(current_decode_context_limit())
        return model(*args, **kwargs)

    runner = CudaGraphRunner(step, planes, max_num_seqs=4, max_blocks_per_seq=8, buckets=[1, 4],
                             context_buckets=[32, 64, 500], context_max_batch=2).capture()  # fmt: skip
    # 500 positions is not below the table's 8 x 16 = 128: the full width serves it
    assert runner.context_buckets == [32, 64]
    assert runner.contexts_for(1) == [32, 64, None] and runner.contexts_for(4) == [None]
    assert sorted(runner.outputs, key=str) == [(1, 32), (1, 64), (1, None), (4, None)]
    assert [runner.context_for(1, w) for w in (1, 2, 3, 4, 5, 8)] == [32, 32, 64, 64, None, None]
    assert runner.context_for(4, 1) is None
    prompts = [[1, 2, 3, 4, 5], list(range(40))]
    tables = [[0, 1], [2, 3, 4, 5]]
    prefill(model, planes, prompts, tables, {})
    ref_planes = [p.clone() for p in planes]
    for table, length, context in (([0, 1], 5, 32), ([2, 3, 4, 5], 40, 64)):
        seen.clear()
        ids, pos, meta, rows = decode_batch([length], [table], seed=length)
        got = runner(ids, pos, meta, rows)
        with torch.no_grad():
            want = model(ids, pos, ref_planes, meta, rows)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert seen == [context]
    assert current_decode_context_limit() is None
    with pytest.raises(ValueError, match="positive"):
        CudaGraphRunner(model, planes, 2, 2, context_buckets=[0])
    # on the CPU no context graphs unless asked for
    assert CudaGraphRunner(model, planes, 2, 8).context_buckets == []
