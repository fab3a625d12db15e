"""GPU: compile_model + CUDA graphs against the eager model, on tiny checkpoints (``pytest -m gpu``).

* compiled (Triton attention, Inductor) and compiled + CUDA graphs equal eager in bf16 within
  tolerance, for every family, for prefill and decode steps;
* exact greedy tokens (fp32, tf32 off) with prefill compiled and every decode step a graph replay;
* the Inductor code hands the KV planes to the Triton attention op without copying them;
* one graph replay covers all loop steps (Huginn at 32 recurrences) and padding rows do not
  change real rows;
* prefill / mixed-batch graphs (``PrefillGraphRunner``) equal the compiled step.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from conftest import FAMILIES, family_options
from test_compiler import split_top_level

from rlt_compile import load_model
from rlt_compile.compiler import compile_model
from rlt_compile.graphs import CudaGraphRunner
from rlt_compile.kernels import triton_attention
from rlt_compile.kernels.metadata import build_metadata
from rlt_compile.models.runner import greedy_generate
from rlt_compile.prefill_graphs import PrefillGraphRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU (run with -m gpu on the device)"),
]

BLOCK = 16
BF16_TOL = {"rtol": 3e-2, "atol": 6e-2}


def load(tiny_dirs, family, dtype):
    return load_model(tiny_dirs[family], dtype=dtype, device="cuda", load_tokenizer=False)


def prompts_and_tables(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lens = [3 + 7 * i for i in range(n)]
    prompts = [torch.randint(0, 256, (ln,), generator=gen).tolist() for ln in lens]
    tables = [[4 * i + b for b in range(4)] for i in range(n)]
    return prompts, tables


def run_prefill(fn, planes, prompts, tables, opts):
    meta = build_metadata([len(p) for p in prompts], [0] * len(prompts), tables, BLOCK, device="cuda")
    ids = torch.tensor([t for p in prompts for t in p], device="cuda")
    pos = torch.cat([torch.arange(len(p)) for p in prompts]).cuda()
    last = torch.cumsum(torch.tensor([len(p) for p in prompts]), 0).cuda() - 1
    with torch.no_grad():
        return fn(ids, pos, planes, meta, last, **opts)


def decode_inputs(lengths, tables, tokens):
    n = len(lengths)
    meta = build_metadata([1] * n, lengths, tables, BLOCK, device="cuda")
    return (
        torch.tensor(tokens, device="cuda"),
        torch.tensor(lengths, device="cuda"),
        meta,
        torch.arange(n, device="cuda"),
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_and_graphs_equal_eager_bf16(tiny_dirs, family):
    opts = family_options(family)
    model, ref = load(tiny_dirs, family, torch.bfloat16), load(tiny_dirs, family, torch.bfloat16)
    cm = compile_model(model, platform="cuda")
    assert cm.attention_backend == "triton"
    planes, ref_planes = model.allocate_kv_cache(16, BLOCK), ref.allocate_kv_cache(16, BLOCK)
    prompts, tables = prompts_and_tables(3, seed=1)
    got = run_prefill(cm, planes, prompts, tables, opts)
    want = run_prefill(ref, ref_planes, prompts, tables, opts)
    torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)
    runner = CudaGraphRunner(cm.run_compiled, planes, max_num_seqs=4, max_blocks_per_seq=4, step_options=opts)
    runner.capture()
    assert sorted(runner.graphs) == [(1, None), (2, None), (4, None)]  # 64-position tables: no short graphs
    lengths = [len(p) for p in prompts]
    tokens = want.argmax(-1).tolist()
    for _ in range(4):
        ids, pos, meta, rows = decode_inputs(lengths, tables, tokens)
        got = runner(ids, pos, meta, rows)  # 3 sequences in the 4-row bucket
        with torch.no_grad():
            want = ref(ids, pos, ref_planes, meta, rows, **opts)
        torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)
        lengths = [n + 1 for n in lengths]
        tokens = want.argmax(-1).tolist()
    assert runner.replays == 4 and runner.fallbacks == 0
    assert cm.graph_counts() == dict.fromkeys(model.compile_units, 1)


def test_inductor_code_writes_kv_planes_in_place_on_gpu(tiny_dirs):
    model = load(tiny_dirs, "nanbeige", torch.bfloat16)
    cm = compile_model(model, platform="cuda")
    planes = model.allocate_kv_cache(16, BLOCK)
    prompts, tables = prompts_and_tables(2, seed=2)
    run_prefill(cm, planes, prompts, tables, {})
    code = "\n".join(cm.graph_records("loop_step")[0].output_code)
    calls = re.findall(r"torch\.ops\.rlt\.attention_triton\.default\((.*)\)", code)
    assert len(calls) == model.config.num_hidden_layers
    for call in calls:
        args = split_top_level(call)
        assert re.fullmatch(r"arg\d+_1", args[3].strip()), call  # the KV plane: a graph input, as is
        assert args[-1].strip() in ("'ieee'", "precision='ieee'")  # bf16 caches
    assert ".copy_(" not in code and "aten.copy" not in code


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_greedy_tokens_exact_with_graphs_fp32(tiny_dirs, family):
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        opts = family_options(family)
        model, ref = load(tiny_dirs, family, torch.float32), load(tiny_dirs, family, torch.float32)
        prompt = [5, 17, 42, 99, 3, 7, 61, 8, 23, 11, 4, 90, 33, 12, 6, 70, 2]
        want, _ = greedy_generate(ref, prompt, 24, **opts)
        cm = compile_model(model, platform="cuda")
        planes = model.allocate_kv_cache(4, BLOCK)
        table = [[0, 1, 2, 3]]
        runner = CudaGraphRunner(cm.run_compiled, planes, 2, 4, step_options=opts).capture()
        logits = run_prefill(cm, planes, [prompt], table, opts)
        tokens = [int(logits[0].argmax())]
        length = len(prompt)
        while len(tokens) < 24:
            ids, pos, meta, rows = decode_inputs([length], table, tokens[-1:])
            tokens.append(int(runner(ids, pos, meta, rows)[0].argmax()))
            length += 1
        assert tokens == want
        assert runner.replays == 23
    finally:
        torch.set_float32_matmul_precision(old)


def test_huginn_32_recurrences_in_one_graph(tiny_dirs):
    model, ref = load(tiny_dirs, "huginn", torch.bfloat16), load(tiny_dirs, "huginn", torch.bfloat16)
    opts = {"init_scale": 0.0, "num_steps": 32}
    cm = compile_model(model, platform="cuda", cuda_graphs=True, graph_max_num_seqs=2)
    planes = model.allocate_kv_cache(8, BLOCK, max_steps=32)
    ref_planes = ref.allocate_kv_cache(8, BLOCK, max_steps=32)
    prompts, tables = prompts_and_tables(2, seed=3)
    run_prefill(cm, planes, prompts, tables, opts)  # prefill: not decode-only, no graph
    run_prefill(ref, ref_planes, prompts, tables, opts)
    assert not cm.graph_runners
    ids, pos, meta, rows = decode_inputs([len(p) for p in prompts], tables, [1, 2])
    got = cm(ids, pos, planes, meta, rows, **opts)  # captures, then replays
    with torch.no_grad():
        want = ref(ids, pos, ref_planes, meta, rows, **opts)
    torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)
    (runner,) = cm.graph_runners.values()
    assert runner.replays == 1
    assert cm.graph_counts() == {"prelude": 1, "loop_step": 1, "coda": 1}


def test_short_context_graph_takes_16_key_tiles_and_matches_eager(tiny_dirs, monkeypatch):
    """A 384-position table: batch buckets 1 and 2 get a graph for contexts up to 256 positions (16-key
    decode tiles) besides the full-width one (64-key tiles). A 20-token sequence replays batch bucket
    1's first, a 300-token one its second; both equal eager."""
    tiles = []
    real_kernel_for = triton_attention.kernel_for

    def recording_kernel_for(fn, interpret):
        launcher = real_kernel_for(fn, interpret)

        class Recorder:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    if "BLOCK_N" in kwargs and fn.__name__ == "_paged_attention_decode_kernel":
                        tiles.append(kwargs["BLOCK_N"])
                    return launcher[grid](*args, **kwargs)

                return launch

        return Recorder()

    monkeypatch.setattr(triton_attention, "kernel_for", recording_kernel_for)
    model, ref = load(tiny_dirs, "ouro", torch.bfloat16), load(tiny_dirs, "ouro", torch.bfloat16)
    opts = family_options("ouro")
    cm = compile_model(model, platform="cuda")
    planes, ref_planes = model.allocate_kv_cache(48, BLOCK), ref.allocate_kv_cache(48, BLOCK)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (20, 300)]
    tables = [[0, 1], list(range(2, 22))]
    runner = CudaGraphRunner(cm.run_compiled, planes, max_num_seqs=2, max_blocks_per_seq=24, step_options=opts)
    tiles.clear()
    runner.capture()
    assert sorted(runner.graphs, key=str) == [(1, 256), (1, None), (2, 256), (2, None)]
    assert set(tiles) == {16, 64}
    for prompt, table, context in zip(prompts, tables, (256, None)):
        run_prefill(cm, planes, [prompt], [table], opts)
        run_prefill(ref, ref_planes, [prompt], [table], opts)
        assert runner.context_for(1, len(table)) == context
        ids, pos, meta, rows = decode_inputs([len(prompt)], [table], [3])
        got = runner(ids, pos, meta, rows)
        with torch.no_grad():
            want = ref(ids, pos, ref_planes, meta, rows, **opts)
        torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)
    assert runner.replays == 2 and runner.fallbacks == 0


def varlen_batch(parts):
    """A step of ``(tokens, cached positions, block table)`` parts: ids, positions, metadata, and the
    last token's row of each part."""
    meta = build_metadata([len(t) for t, _, _ in parts], [c for _, c, _ in parts], [b for _, _, b in parts], BLOCK,
                          device="cuda")  # fmt: skip
    ids = torch.tensor([x for t, _, _ in parts for x in t], device="cuda")
    pos = torch.cat([torch.arange(c, c + len(t)) for t, c, _ in parts]).cuda()
    rows = torch.cumsum(torch.tensor([len(t) for t, _, _ in parts]), 0).cuda() - 1
    return ids, pos, meta, rows


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_graphs_equal_the_compiled_step_bf16(tiny_dirs, family):
    """A fresh 40-token prompt (graph (64, 1): the TMA prefill's shape where the GPU has TMA), then two
    mixed batches (decode rows, a fresh prompt, a prompt in two chunks), each replayed from a prefill
    graph, give the compiled step's logits, and the K/V planes end up the same."""
    opts = family_options(family)
    model = load(tiny_dirs, family, torch.bfloat16)
    cm = compile_model(model, platform="cuda")
    planes = model.allocate_kv_cache(16, BLOCK)
    ref_planes = [p.clone() for p in planes]
    runner = PrefillGraphRunner(cm.run_compiled, planes, max_blocks_per_seq=4, token_buckets=[32, 64], max_num_seqs=4,
                                step_options=opts).capture()  # fmt: skip
    assert sorted(runner.graphs) == [(32, 1), (32, 2), (32, 4), (64, 1), (64, 2), (64, 4)]
    assert len({out.data_ptr() for out in runner.outputs.values()}) == 1  # one shared logits buffer
    gen = torch.Generator().manual_seed(11)
    a, b, c = (torch.randint(0, 256, (n,), generator=gen).tolist() for n in (40, 20, 30))
    ta, tb, tc = [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]
    steps = [
        [(a, 0, ta)],
        [(a[-1:], 40, ta), (b, 0, tb), (c[:10], 0, tc)],
        [(c[10:], 10, tc), (a[:1], 41, ta), (b[-1:], 20, tb)],
    ]
    assert [runner.bucket_for(sum(len(t) for t, _, _ in s), len(s)) for s in steps] == [(64, 1), (32, 4), (32, 4)]
    for parts in steps:
        ids, pos, meta, rows = varlen_batch(parts)
        got = runner(ids, pos, meta, rows)
        with torch.no_grad():
            want = cm(ids, pos, ref_planes, meta, rows, **opts)
        torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)
    for p, r in zip(planes, ref_planes):
        torch.testing.assert_close(p.float(), r.float(), **BF16_TOL)
    assert runner.replays == 3


def test_compile_model_replays_prefill_graphs_when_asked(tiny_dirs):
    """``compile_model(cuda_graphs=True, graph_prefill_tokens=[...])``: a prefill call captures and
    replays a prefill graph (equal to eager), decode calls the decode graphs, each once per KV cache."""
    model, ref = load(tiny_dirs, "ouro", torch.bfloat16), load(tiny_dirs, "ouro", torch.bfloat16)
    cm = compile_model(model, platform="cuda", cuda_graphs=True, graph_max_num_seqs=2, graph_prefill_tokens=[64])
    planes, ref_planes = model.allocate_kv_cache(8, BLOCK), ref.allocate_kv_cache(8, BLOCK)
    prompts, tables = prompts_and_tables(2, seed=4)  # 3 + 10 tokens: the (64, 2) graph
    got = run_prefill(cm, planes, prompts, tables, {})
    want = run_prefill(ref, ref_planes, prompts, tables, {})
    torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)
    ids, pos, meta, rows = decode_inputs([len(p) for p in prompts], tables, [1, 2])
    got = cm(ids, pos, planes, meta, rows)
    with torch.no_grad():
        want = ref(ids, pos, ref_planes, meta, rows)
    torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)
    runners = sorted(cm.graph_runners.values(), key=lambda r: type(r).__name__)
    assert [type(r).__name__ for r in runners] == ["CudaGraphRunner", "PrefillGraphRunner"]
    assert [r.replays for r in runners] == [1, 1]


class HostHeavyStep:
    """A step whose host time is a 20 ms sleep (which a graph does not replay) and whose GPU time is
    200 [tokens, 4096] x [4096, 4096] products: a 64-token graph replays far faster than a call, a
    4096-token one far slower. Returns each logits row's hidden state; counts its calls."""

    def __init__(self):
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.embed = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) / 64
        self.calls = 0

    def __call__(self, input_ids, positions, kv_caches, attn, logits_indices):
        self.calls += 1
        time.sleep(0.02)
        x = self.embed[input_ids] + positions[:, None]
        for _ in range(200):
            x = torch.tanh(x @ self.weight)
        return x[logits_indices].float()


def test_prefill_graphs_slower_than_the_step_are_dropped():
    """After the capture, a token bucket whose replay is slower than the step's own call (its host
    time) is dropped with every larger one: batches there run the step unpadded; smaller ones replay."""
    step = HostHeavyStep()
    planes = [torch.zeros(1, device="cuda")]
    runner = PrefillGraphRunner(step, planes, max_blocks_per_seq=300, token_buckets=[64, 4096, 8192],
                                seq_buckets=[1]).capture()  # fmt: skip
    assert runner.replay_ms[64] < runner.step_ms < runner.replay_ms[4096], (runner.step_ms, runner.replay_ms)
    assert 8192 not in runner.replay_ms  # not timed: past the first slow bucket
    assert runner.dropped == {(4096, 1), (8192, 1)} and sorted(runner.graphs) == [(64, 1)]
    gen = torch.Generator().manual_seed(1)
    for n, replayed in ((40, True), (100, False)):
        ids = torch.randint(0, 256, (n,), generator=gen).cuda()
        meta = build_metadata([n], [0], [list(range(-(-n // BLOCK)))], BLOCK, device="cuda")
        rows = torch.tensor([n - 1], device="cuda")
        calls, replays = step.calls, runner.replays
        got = runner(ids, torch.arange(n, device="cuda"), meta, rows)
        assert (runner.replays - replays, step.calls - calls) == ((1, 0) if replayed else (0, 1))
        want = step(ids, torch.arange(n, device="cuda"), planes, meta, rows)
        torch.testing.assert_close(got, want, **BF16_TOL)
