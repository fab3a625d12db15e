"""PrefillGraphRunner logic that needs no GPU: buckets, padding, static buffers, engine use.

On the CPU the runner runs with ``use_graphs=False``: the same static buffers and padding, the step
called instead of replayed. Capture and replay on a GPU are in test_graphs_gpu.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import FAMILIES, family_options, tiny_model

from rlt_compile.engine import EngineConfig, LLMEngine, SamplingParams
from rlt_compile.kernels.metadata import build_metadata
from rlt_compile.prefill_graphs import PrefillGraphRunner

BLOCK = 16


def tiny(family: str):
    return tiny_model(family, seed=3)


def runner_for(model, planes, **kw) -> PrefillGraphRunner:
    kw.setdefault("token_buckets", [16, 64])
    return PrefillGraphRunner(model, planes, max_blocks_per_seq=6, **kw)


def test_shapes_and_bucket_picking():
    planes = [torch.zeros(2, 4, BLOCK, 1, 4)]
    runner = runner_for(lambda *a, **k: None, planes, token_buckets=[64, 16], max_num_seqs=8)
    assert runner.token_buckets == [16, 64] and runner.seq_buckets == [1, 2, 4, 8]
    assert runner.shapes() == [(16, 1), (16, 2), (16, 4), (16, 8), (64, 1), (64, 2), (64, 4), (64, 8)]
    assert runner.bucket_for(10, 1) == (16, 1)
    assert runner.bucket_for(16, 3) == (16, 4)
    assert runner.bucket_for(17, 3) == (64, 4)
    assert runner.bucket_for(5, 2, rows=5) == (16, 8)  # more logits rows than sequences
    assert runner.bucket_for(65, 1) is None and runner.bucket_for(30, 9) is None
    few = runner_for(lambda *a, **k: None, planes, token_buckets=[4], seq_buckets=[2, 8])
    assert few.shapes() == [(4, 2)]  # no more sequences than tokens
    assert not few.can_run(2, 1)  # nothing captured yet
    with pytest.raises(ValueError, match="positive"):
        runner_for(lambda *a, **k: None, planes, token_buckets=[])


def test_dropped_shapes_are_skipped_for_the_step_or_a_larger_bucket():
    """Shapes ``_drop_slow_graphs`` dropped are never picked: a batch goes to the next shape that is
    kept, or to the step where none is."""
    planes = [torch.zeros(2, 4, BLOCK, 1, 4)]
    runner = runner_for(lambda *a, **k: None, planes, token_buckets=[16, 64], max_num_seqs=4)
    runner.dropped = {(16, 2)}
    assert runner.bucket_for(10, 2) == (16, 4) and runner.bucket_for(10, 1) == (16, 1)
    runner.dropped = {(64, s) for s in runner.seq_buckets}
    assert runner.bucket_for(17, 1) is None and runner.bucket_for(16, 1) == (16, 1)


def mixed_batch(model, planes, seed: int):
    """Three prompts prefilled (two fully, one half), then a batch mixing a fresh prompt, the second
    half of the chunked one and decode rows of the other two."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(4, 256, (n,), generator=gen)

    first = [ids(9), ids(20), ids(30)]
    tables = [[0, 1], [2, 3], [4, 5, 6], [7, 8]]
    meta = build_metadata([9, 20, 15], [0, 0, 0], tables[:3], BLOCK)
    with torch.no_grad():
        model(torch.cat([first[0], first[1], first[2][:15]]),
              torch.cat([torch.arange(9), torch.arange(20), torch.arange(15)]), planes, meta)  # fmt: skip
    query_lens, context_lens = [1, 1, 15, 7], [9, 20, 15, 0]
    meta = build_metadata(query_lens, context_lens, tables, BLOCK)
    input_ids = torch.cat([ids(1), ids(1), first[2][15:], ids(7)])
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)])
    logits_indices = torch.tensor([0, 1, 16, 23])  # each sequence's last token
    return input_ids, positions, meta, logits_indices


@pytest.mark.parametrize("seqs", [4, 8])
@pytest.mark.parametrize("family", FAMILIES)
def test_padding_never_changes_real_rows(family, seqs):
    """A mixed batch (24 tokens of 4 sequences) run in the (64, 4) or (64, 8) graph's padded buffers
    (40 padding tokens; 0 or 4 padding sequences) gives the unpadded step's logits, and the KV planes
    end up exactly as after the unpadded step."""
    model = tiny(family)
    opts = family_options(family)
    planes = model.allocate_kv_cache(12, BLOCK)
    batch = mixed_batch(model, planes, seed=1)
    runner = runner_for(model, planes, seq_buckets=[seqs], step_options=opts).capture()  # warm-ups write nothing
    ref_planes = [p.clone() for p in planes]
    assert runner.bucket_for(24, 4) == (64, seqs)
    got = runner(*batch)
    input_ids, positions, meta, rows = batch
    with torch.no_grad():
        want = model(input_ids, positions, ref_planes, copy.deepcopy(meta), rows, **opts)
    assert got.shape == want.shape == (4, model.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for p, r in zip(planes, ref_planes):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-5)
        assert torch.equal(p != 0, r != 0)  # the same slots written, no others
    assert runner.replays == 1
    # the static buffers hold the padded batch
    assert runner.slot_mapping[24:64].eq(-1).all() and runner.query_start_loc[4:].eq(24).all()


def test_a_logits_row_per_token():
    """``logits_rows="tokens"`` (self-speculation's verify passes): the graph computes a row per token
    bucket entry, so a batch may ask more rows than it has sequences; each equals the unpadded step's."""
    model = tiny("ouro")
    planes = model.allocate_kv_cache(12, BLOCK)
    input_ids, positions, meta, _ = mixed_batch(model, planes, seed=2)
    rows = torch.arange(24)
    runner = runner_for(model, planes, seq_buckets=[4], logits_rows="tokens").capture()
    assert runner.bucket_for(24, 4, rows=24) == (64, 4)
    assert runner_for(model, planes, seq_buckets=[4]).bucket_for(24, 4, rows=24) is None  # a row per sequence
    ref_planes = [p.clone() for p in planes]
    got = runner(input_ids, positions, meta, rows)
    with torch.no_grad():
        want = model(input_ids, positions, ref_planes, copy.deepcopy(meta), rows)
    assert got.shape == (24, model.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert runner.logits_indices[24:64].tolist() == list(range(24, 64))
    with pytest.raises(ValueError, match="logits_rows"):
        runner_for(model, planes, logits_rows="all")


def test_fill_overwrites_a_larger_batch_and_falls_back_beyond_the_buckets():
    calls = []

    def step(input_ids, positions, kv, attn, logits_indices, **options):
        calls.append((input_ids.shape[0], attn.num_seqs))
        return torch.zeros(logits_indices.shape[0], 3)

    planes = [torch.zeros(2, 10, BLOCK, 1, 4)]
    runner = runner_for(step, planes, token_buckets=[32], max_num_seqs=4).capture()
    calls.clear()
    wide = build_metadata([10, 5, 3, 1], [0, 20, 0, 40], [[1], [2, 3], [4], [5, 6, 7, 8]], BLOCK)
    runner(torch.ones(19, dtype=torch.long), torch.arange(19), wide, torch.tensor([9, 14, 17, 18]))
    narrow = build_metadata([4, 1, 1], [4, 0, 2], [[9], [0], [3]], BLOCK)  # 3 sequences: bucket (32, 4)
    runner(torch.ones(6, dtype=torch.long), torch.arange(6), narrow, torch.tensor([3, 4]))
    assert calls == [(32, 4), (32, 4)]
    assert runner.slot_mapping[6:].eq(-1).all() and runner.input_ids[6:].eq(0).all()
    assert runner.block_tables.tolist() == [[9] + [0] * 5, [0] * 6, [3] + [0] * 5, [0] * 6]
    assert runner.seq_lens.tolist() == [8, 1, 3, 0]  # the stale fourth sequence is padding now
    assert runner.query_start_loc.tolist() == [0, 4, 5, 6, 6] and runner.logits_indices[:4].tolist() == [3, 4, 2, 3]
    runner(torch.ones(33, dtype=torch.long), torch.arange(33), build_metadata([33], [0], [[0, 1, 2]], BLOCK),
           torch.tensor([32]))  # fmt: skip
    assert calls[-1] == (33, 1) and runner.replays == 2  # no bucket: the step itself
    with pytest.raises(ValueError, match="wide"):
        runner.fill((32, 1), torch.ones(1, dtype=torch.long), torch.arange(1),
                    build_metadata([1], [0], [[0] * 7], BLOCK), torch.tensor([0]))  # fmt: skip


ENGINE_MODES = {
    "plain": {},
    "async": {"async_scheduling": True},
    "depth_batching": {"depth_batching": True},
    "speculative": {"speculative_num_draft": 2},
    "wavefront": {"wavefront_prefill_chunk": 8},  # longer prompts: wavefront prefill, without the graphs
}


@pytest.mark.parametrize(
    "family, mode",
    [
        ("ouro", "plain"),
        ("huginn", "plain"),
        ("nanbeige", "async"),
        ("ouro", "depth_batching"),
        ("nanbeige", "speculative"),
        ("huginn", "wavefront"),
    ],  # fmt: skip
)
def test_engine_with_prefill_graphs_gives_the_same_tokens(tiny_dirs, family, mode):
    """An engine with ``cuda_graph_prefill_tokens`` (static buffers on the CPU) runs its prefill and
    mixed steps through the runner (chunked prefill, decode rows joining; with async scheduling, depth
    batching's prefills, self-speculation's verify passes) and generates the tokens of the same
    engine without it."""
    from rlt_compile import load_model

    model = load_model(tiny_dirs[family])
    prompts = [[5 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate((3, 40, 17, 9, 28))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(**kw):
        eng = LLMEngine(model, model_options=family_options(family), num_blocks=64, max_num_seqs=4,
                        max_num_batched_tokens=32, **ENGINE_MODES[mode], **kw)  # fmt: skip
        ids = [eng.add_request(None, p, params) for p in prompts]
        done = eng.run_to_completion()
        return eng, [done[i].outputs[0].token_ids for i in ids]

    _, plain = run()
    eng, tokens = run(use_cuda_graphs=True, cuda_graph_prefill_tokens=[128, 8, 32, 64])
    runner = eng.runner.prefill_graph_runner
    # no step holds more than max_num_batched_tokens=32 tokens: 64 and 128 would never run
    # sequence buckets: DEFAULT_PREFILL_GRAPH_SEQS below max_num_seqs=4, then 4
    assert runner is not None and runner.token_buckets == [8, 32] and runner.seq_buckets == [1, 4]
    assert tokens == plain
    assert runner.replays > 0


def test_prefill_graphs_default_on_the_gpu_and_off_on_the_cpu(tiny_dirs):
    """``cuda_graph_prefill_tokens=None`` means the default buckets where graphs can replace the step's
    host work (the GPU) and none on the CPU; ``[]`` means none anywhere."""
    from types import SimpleNamespace

    from rlt_compile import load_model
    from rlt_compile.engine.config import DEFAULT_PREFILL_GRAPH_TOKENS
    from rlt_compile.engine.model_runner import ModelRunner

    def buckets(device, tokens):
        runner = SimpleNamespace(config=EngineConfig(cuda_graph_prefill_tokens=tokens), device=torch.device(device))
        return ModelRunner._prefill_token_buckets(runner)

    assert buckets("cuda", None) == list(DEFAULT_PREFILL_GRAPH_TOKENS)
    assert buckets("cpu", None) == [] and buckets("cuda", []) == []
    assert buckets("cpu", [64, 16]) == [64, 16]
    model = load_model(tiny_dirs["ouro"])
    eng = LLMEngine(model, model_options=family_options("ouro"), num_blocks=16, max_num_seqs=2, use_cuda_graphs=True)
    assert eng.runner.graph_runner is not None and eng.runner.prefill_graph_runner is None


def test_engine_config_rejects_bad_prefill_buckets():
    with pytest.raises(ValueError, match="cuda_graph_prefill_tokens"):
        EngineConfig(cuda_graph_prefill_tokens=[0, 16])
    with pytest.raises(ValueError, match="cuda_graph_prefill_seqs"):
        EngineConfig(cuda_graph_prefill_seqs=[2.5])


def test_a_failed_capture_leaves_the_engine_on_the_compiled_step(tiny_dirs, monkeypatch, caplog):
    """Prefill / verify / draft graphs only save host time: when capturing them fails the engine warns
    and runs those steps without them, with the same tokens."""
    from rlt_compile import load_model

    def broken(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    model = load_model(tiny_dirs["nanbeige"])
    prompts = [[5, 6, 7, 8], [9] * 11]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    def run(**kw):
        eng = LLMEngine(model, num_blocks=32, max_num_seqs=4, **kw)
        ids = [eng.add_request(None, p, params) for p in prompts]
        done = eng.run_to_completion()
        return eng, [done[i].outputs[0].token_ids for i in ids]

    _, plain = run()
    monkeypatch.setattr(PrefillGraphRunner, "capture", broken)
    with caplog.at_level("WARNING"):
        eng, tokens = run(use_cuda_graphs=True, cuda_graph_prefill_tokens=[16], speculative_num_draft=2)
    assert eng.runner.prefill_graph_runner is None and eng.runner.verify_graph_runner is None
    assert "graph capture failed (RuntimeError" in caplog.text
    assert tokens == plain
