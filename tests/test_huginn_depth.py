"""Continuous depth batching for Huginn: per-request recurrences and adaptive exits in shared passes
give each sequence the tokens of the model's own per-token path (exact, fp32)."""

from __future__ import annotations

import pytest
from depth_references import huginn_alone

from rlt_compile import load_model
from rlt_compile.models.huginn_depth import HuginnDepthBatcher

PROMPTS = [[(i * 13 + j * 7) % 250 + 3 for j in range(n)] for i, n in enumerate((5, 18, 9, 27))]


@pytest.fixture(scope="module")
def huginn(tiny_dirs):
    return load_model(tiny_dirs["huginn"], load_tokenizer=False)


def run(model, prompts, options, n, stagger=False):
    blocks = 4
    planes = model.allocate_kv_cache(blocks * len(prompts), 16, max_steps=4, fold_steps=True)
    batcher = HuginnDepthBatcher(model, planes, 16)
    out, pending = {}, list(enumerate(zip(prompts, options)))
    while pending and not stagger:
        i, (p, o) = pending.pop(0)
        out[i] = [batcher.add(i, p, list(range(i * blocks, (i + 1) * blocks)), **o)]
    while pending or any(len(v) < n for v in out.values()):
        if pending:
            i, (p, o) = pending.pop(0)
            out[i] = [batcher.add(i, p, list(range(i * blocks, (i + 1) * blocks)), **o)]
        for seq, token in batcher.step():
            if len(out[seq]) < n:
                out[seq].append(token)
            if len(out[seq]) >= n:
                batcher.remove(seq)
    return [out[i] for i in range(len(prompts))], batcher


OPTIONS = [
    {"num_steps": 2},
    {"num_steps": 4},
    {"num_steps": 4, "exit_threshold": 0.65, "min_steps": 2},
    {"num_steps": 3},
]


@pytest.mark.parametrize("stagger", [False, True])
def test_mixed_recurrences_and_adaptive_exits_equal_each_sequence_alone(huginn, stagger):
    got, batcher = run(huginn, PROMPTS, OPTIONS, 5, stagger=stagger)
    assert batcher.early_exits > 0  # the adaptive request really stopped early
    for prompt, opts, tokens in zip(PROMPTS, OPTIONS, got):
        assert tokens == huginn_alone(huginn, prompt, 5, **opts)


def test_fewer_recurrences_take_fewer_passes(huginn):
    _, two = run(huginn, PROMPTS, [{"num_steps": 2}] * 4, 5)
    _, four = run(huginn, PROMPTS, [{"num_steps": 4}] * 4, 5)
    assert two.passes == 2 * 4 and four.passes == 4 * 4  # passes per token = recurrences


def test_rejects_more_recurrences_than_the_cache_holds(huginn):
    planes = huginn.allocate_kv_cache(4, 16, max_steps=2, fold_steps=True)
    with pytest.raises(ValueError, match="num_steps"):
        HuginnDepthBatcher(huginn, planes, 16).add(0, PROMPTS[0], [0, 1, 2, 3], num_steps=3)
