"""Self-speculative decoding: greedy output equals plain greedy; rejection sampling keeps the target
distribution."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, family_options

from rlt_compile import load_model
from rlt_compile.models.runner import greedy_generate
from rlt_compile.models.speculative import self_speculative_generate, speculative_accept

PROMPT = [(i * 29 + 5) % 250 + 3 for i in range(23)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("num_draft", "draft_steps"), [(1, 1), (3, 2), (5, 3)])
def test_greedy_self_speculation_equals_plain_greedy(tiny_dirs, family, num_draft, draft_steps):
    model = load_model(tiny_dirs[family], load_tokenizer=False)
    opts = family_options(family)
    draft_steps = min(draft_steps, model.default_steps - 1)  # Nanbeige has 2 loops
    want, _ = greedy_generate(model, PROMPT, 20, **opts)
    got, stats = self_speculative_generate(model, PROMPT, 20, num_draft=num_draft, draft_steps=draft_steps, **opts)
    assert got == want
    assert stats.drafted == stats.rounds * num_draft and 0 <= stats.accepted <= stats.drafted


def test_forced_agreement_accepts_every_draft(tiny_dirs):
    """A draft as deep as the target (same steps via options) agrees on every token."""
    model = load_model(tiny_dirs["huginn"], load_tokenizer=False)
    # Huginn draft with 3 of 4 recurrences vs a target run at 3 recurrences: identical models.
    got, stats = self_speculative_generate(model, PROMPT, 12, num_draft=4, draft_steps=3, num_steps=3, init_scale=0.0)
    want, _ = greedy_generate(model, PROMPT, 12, num_steps=3, init_scale=0.0)
    assert got == want and stats.acceptance_rate == 1.0


def test_rejection_sampling_preserves_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    vocab, k, trials = 5, 2, 20000
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 2, -1)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 2, -1)
    first = torch.zeros(vocab)
    for _ in range(trials):
        drafts = torch.multinomial(q, 1, generator=gen).squeeze(1)
        first[speculative_accept(drafts, q, p, gen)[0]] += 1
    empirical = first / trials
    # 4 standard errors of a binomial proportion at 20k trials is below 0.015
    assert torch.allclose(empirical, p[0], atol=0.015), (empirical, p[0])


def test_rejection_sampling_keeps_the_second_token_conditional():
    """Given the first draft was accepted, the second emitted token follows p[1]."""
    gen = torch.Generator().manual_seed(1)
    vocab, trials = 4, 30000
    q = torch.softmax(torch.randn(2, vocab, generator=gen), -1)
    p = torch.softmax(torch.randn(3, vocab, generator=gen), -1)
    counts = torch.zeros(vocab)
    for _ in range(trials):
        drafts = torch.multinomial(q, 1, generator=gen).squeeze(1)
        out = speculative_accept(drafts, q, p, gen)
        if len(out) >= 2:
            counts[out[1]] += 1
    assert torch.allclose(counts / counts.sum(), p[1], atol=0.02)


def test_bad_draft_steps(tiny_dirs):
    model = load_model(tiny_dirs["ouro"], load_tokenizer=False)
    with pytest.raises(ValueError, match="draft_steps"):
        self_speculative_generate(model, PROMPT, 4, draft_steps=4)
