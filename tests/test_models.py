"""Model behaviour on tiny checkpoints: cached decode, batching, loop structure, exit selection."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, family_options

from rlt_compile import load_model
from rlt_compile.kernels.metadata import build_metadata
from rlt_compile.kernels.reference import attention_reference
from rlt_compile.models.ouro import exit_distribution, threshold_exit_steps
from rlt_compile.models.runner import forward_sequences, greedy_generate


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decode_equals_recompute(tiny_dirs, family):
    model = load_model(tiny_dirs[family])
    prompt = [5, 17, 42, 99, 3, 7, 61, 8, 23, 11, 4, 90, 33, 12, 6, 70, 2]  # crosses a 16-token block
    opts = family_options(family)
    cached, cached_logits = greedy_generate(model, prompt, 10, **opts)
    fresh, fresh_logits = greedy_generate(model, prompt, 10, use_cache=False, **opts)
    assert cached == fresh
    torch.testing.assert_close(cached_logits, fresh_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_forward_equals_each_sequence_alone(tiny_dirs, family):
    model = load_model(tiny_dirs[family])
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 19, 1, 33)]
    batched, _ = forward_sequences(model, seqs, **family_options(family))
    for seq, logits in zip(seqs, batched):
        (alone,), _ = forward_sequences(model, [seq], **family_options(family))
        torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5)


def shared_slot(model, slot: int) -> int:
    """The slot a model would use if every loop step re-used the first step's KV planes."""
    first_step = model.kv_layout(1).num_slots
    if model.family == "huginn":
        c = model.config
        fixed = c.n_layers_in_prelude + c.n_layers_in_coda
        return slot if slot < fixed else fixed + (slot - fixed) % c.n_layers_in_recurrent_block
    return slot % first_step


@pytest.mark.parametrize("family", FAMILIES)
def test_every_loop_step_has_its_own_kv_slots(tiny_dirs, family):
    """Negative control: sharing one KV plane across loop steps changes a decode step's output.

    (A one-shot prefill cannot tell: each step rewrites the plane before reading it.)"""
    model = load_model(tiny_dirs[family])
    prompt = list(range(10, 30))
    opts = family_options(family)

    def prefill_then_decode(planes):
        meta = build_metadata([len(prompt) - 1], [0], [[0, 1]], 16)
        model(torch.tensor(prompt[:-1]), torch.arange(len(prompt) - 1), planes, meta, **opts)
        meta = build_metadata([1], [len(prompt) - 1], [[0, 1]], 16)
        return model(torch.tensor(prompt[-1:]), torch.tensor([len(prompt) - 1]), planes, meta, **opts)

    planes = model.allocate_kv_cache(4, 16)
    good = prefill_then_decode(planes)
    planes = model.allocate_kv_cache(4, 16)
    bad = prefill_then_decode([planes[shared_slot(model, i)] for i in range(len(planes))])
    (full,), _ = forward_sequences(model, [prompt], **opts)
    torch.testing.assert_close(good[0], full[-1], rtol=1e-4, atol=1e-4)
    assert (good - bad).abs().max() > 1e-3


def test_huginn_recurrence_count_is_per_call(tiny_dirs):
    model = load_model(tiny_dirs["huginn"])
    prompt = list(range(40, 52))
    (r2,), _ = forward_sequences(model, [prompt], max_steps=8, num_steps=2, init_scale=0.0)
    (r8,), _ = forward_sequences(model, [prompt], max_steps=8, num_steps=8, init_scale=0.0)
    assert (r2 - r8).abs().max() > 1e-4
    with pytest.raises(ValueError, match="KV slots"):
        forward_sequences(model, [prompt], max_steps=2, num_steps=3, init_scale=0.0)


def test_ouro_exit_distribution_matches_definition():
    gates = torch.randn(4, 7)
    pdf = exit_distribution(gates)
    lam = torch.sigmoid(gates)
    expected = [lam[0], lam[1] * (1 - lam[0]), lam[2] * (1 - lam[0]) * (1 - lam[1])]
    expected.append(1 - sum(expected))
    torch.testing.assert_close(pdf, torch.stack(expected), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pdf.sum(0), torch.ones(7))


def test_ouro_threshold_exit_picks_first_step_reaching_threshold():
    pdf = torch.tensor([[0.5, 0.125, 0.0], [0.25, 0.125, 0.25], [0.25, 0.5, 0.25], [0.0, 0.25, 0.5]])
    assert threshold_exit_steps(pdf, 0.5).tolist() == [0, 2, 2]
    assert threshold_exit_steps(pdf, 0.75).tolist() == [1, 2, 3]
    assert threshold_exit_steps(pdf, 2.0).tolist() == [3, 3, 3]  # never reached -> last step


def test_ouro_exit_options_select_per_step_logits(tiny_dirs):
    model = load_model(tiny_dirs["ouro"])
    prompt = list(range(3, 15))
    (full,), details = forward_sequences(model, [prompt], return_details=True)
    per_step = details["logits_per_step"]
    assert per_step.shape[0] == 4
    torch.testing.assert_close(full, per_step[-1])  # threshold 1.0: fp32 cdf reaches 1 only at the end
    for k in range(4):
        (at_k,), _ = forward_sequences(model, [prompt], exit_at_step=k)
        torch.testing.assert_close(at_k, per_step[k])
    (thr,), d = forward_sequences(model, [prompt], exit_threshold=0.5, return_details=True)
    rows = torch.arange(len(prompt))
    torch.testing.assert_close(thr, per_step[d["exit_steps"], rows])
    want = threshold_exit_steps(d["exit_pdf"], 0.5)
    assert torch.equal(d["exit_steps"], want)


def test_attention_reference_matches_sdpa_on_contiguous_cache():
    torch.manual_seed(0)
    heads, kv_heads, dim, n = 4, 2, 16, 21
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    cache = torch.zeros(2, 4, 8, kv_heads, dim)
    meta = build_metadata([n], [0], [[2, 0, 3]], 8)
    out = attention_reference(q, k, v, cache, *meta, scale=dim**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
