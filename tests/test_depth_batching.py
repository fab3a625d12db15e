"""Continuous depth batching: rows at different loop steps in one pass give each sequence the tokens
it gets alone (exact, fp32), with exits where the policy says and fewer passes than lockstep."""

from __future__ import annotations

import pytest
import torch
from depth_references import ouro_last_exited

from rlt_compile import load_model
from rlt_compile.models.depth_batching import DepthBatcher

PROMPTS = [[(i * 11 + j * 5) % 250 + 3 for j in range(n)] for i, n in enumerate((6, 19, 11, 33))]
POLICIES = [{"exit_at_step": 0}, {"exit_at_step": 2}, {"exit_threshold": 0.5}, {}]


@pytest.fixture(scope="module")
def ouro(tiny_dirs):
    return load_model(tiny_dirs["ouro"], load_tokenizer=False)


def run_batcher(model, prompts, policies, n, stagger=False, pipeline=None, graphs=None):
    blocks = 4
    planes = model.allocate_kv_cache(blocks * len(prompts), 16, fold_steps=True)
    batcher = DepthBatcher(model, planes, 16, pipeline_draft_step=pipeline)
    if graphs is not None:
        batcher.capture_graphs(max_rows=3, max_blocks_per_seq=blocks, buckets=[1, 2, 3], use_graphs=graphs)
    out = {}
    pending = list(enumerate(zip(prompts, policies)))
    if not stagger:
        for i, (p, pol) in pending:
            out[i] = [batcher.add(i, p, list(range(i * blocks, (i + 1) * blocks)), **pol)]
        pending = []
    while any(len(v) < n for v in out.values()) or pending:
        if pending:  # one new request joins per pass
            i, (p, pol) = pending.pop(0)
            out[i] = [batcher.add(i, p, list(range(i * blocks, (i + 1) * blocks)), **pol)]
        for seq, token in batcher.step():
            if len(out[seq]) < n:
                out[seq].append(token)
            if len(out[seq]) >= n:
                batcher.remove(seq)
    return [out[i] for i in range(len(prompts))], batcher.passes if pipeline is None and graphs is None else batcher


@pytest.mark.parametrize("stagger", [False, True])
def test_mixed_depth_batch_equals_each_sequence_alone(ouro, stagger):
    got, _ = run_batcher(ouro, PROMPTS, POLICIES, 6, stagger=stagger)
    for prompt, policy, tokens in zip(PROMPTS, POLICIES, got):
        assert tokens == ouro_last_exited(ouro, prompt, 6, **policy)
        alone, _ = run_batcher(ouro, [prompt], [policy], 6)
        assert tokens == alone[0]


def test_early_exits_take_fewer_passes(ouro):
    n = 5
    _, shallow = run_batcher(ouro, PROMPTS, [{"exit_at_step": 0}] * 4, n)
    _, deep = run_batcher(ouro, PROMPTS, [{"exit_at_step": 3}] * 4, n)
    assert shallow == n - 1 and deep == 4 * (n - 1)  # one pass per token at depth 1, four at depth 4


def test_needs_an_exit_gate_and_a_folded_cache(tiny_dirs, ouro):
    nanbeige = load_model(tiny_dirs["nanbeige"], load_tokenizer=False)
    with pytest.raises(ValueError, match="exit gate"):
        DepthBatcher(nanbeige, nanbeige.allocate_kv_cache(4, 16, fold_steps=True), 16)
    with pytest.raises(ValueError, match="fold_steps"):
        DepthBatcher(ouro, ouro.allocate_kv_cache(4, 16), 16)


@pytest.mark.parametrize(("draft_step", "depth"), [(0, None), (1, None), (2, None), (0, 2), (1, 2)])
def test_token_pipeline_gives_the_same_tokens(ouro, draft_step, depth):
    policies = [{"exit_at_step": depth}] * 2 if depth is not None else [{}, {}]
    n = 8
    want, passes = run_batcher(ouro, PROMPTS[:2], policies, n)
    got, batcher = run_batcher(ouro, PROMPTS[:2], policies, n, pipeline=draft_step)
    assert got == want
    assert batcher.drafts >= batcher.accepted >= 0 and batcher.drafts > 0
    # every accepted draft saves the passes its parent and it ran side by side
    assert batcher.passes <= passes


def test_token_pipeline_overlaps_tokens_when_drafts_are_right(tiny_dirs):
    """Forced agreement: with the attention and MLP outputs zeroed and unit norm weights every loop
    step returns the same normalised state, so each draft is right; at batch 1 a token then
    completes every pass instead of every 4 passes."""
    model = load_model(tiny_dirs["ouro"], load_tokenizer=False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    n = 8
    want, passes = run_batcher(model, PROMPTS[:1], [{}], n)
    got, batcher = run_batcher(model, PROMPTS[:1], [{}], n, pipeline=0)
    assert got == want
    assert batcher.accepted == n - 1  # every token after the prefill's came from a verified draft
    assert passes == 4 * (n - 1) and batcher.passes <= n + 3


def test_token_pipeline_rejects_threshold_policies(ouro):
    batcher = DepthBatcher(ouro, ouro.allocate_kv_cache(4, 16, fold_steps=True), 16, pipeline_draft_step=0)
    with pytest.raises(ValueError, match="fixed depth"):
        batcher.add(0, PROMPTS[0], [0, 1, 2, 3], exit_threshold=0.5)


def test_static_buffer_passes_equal_plain_passes(ouro):
    """Through the graph runner's static buffers and padded buckets (no graphs on the CPU); 4 rows
    exceed the largest bucket and run without the runner."""
    want, _ = run_batcher(ouro, PROMPTS, POLICIES, 6, stagger=True)
    got, batcher = run_batcher(ouro, PROMPTS, POLICIES, 6, stagger=True, graphs=False, pipeline=None)
    assert got == want
    assert batcher.graph_runner.replays > 0


@pytest.mark.gpu
def test_cuda_graph_passes_equal_plain_passes(tiny_dirs):
    from rlt_compile import compile_model

    model = load_model(tiny_dirs["ouro"], dtype=torch.float32, device="cuda", load_tokenizer=False)
    want, _ = run_batcher(model, PROMPTS[:3], POLICIES[:3], 6, stagger=True)
    with pytest.raises(ValueError, match="compiled model"):
        run_batcher(model, PROMPTS[:3], POLICIES[:3], 6, graphs=True)
    compile_model(model, platform="cuda")
    got, batcher = run_batcher(model, PROMPTS[:3], POLICIES[:3], 6, stagger=True, graphs=True)
    assert got == want and batcher.graph_runner.replays > 0
