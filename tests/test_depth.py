"""Depth-aware execution at the model level: Ouro exit policies, Huginn per-token recurrences and
adaptive exit, and the two KV layouts for skipped loop steps."""

from __future__ import annotations

import pytest
import torch

from rlt_compile import load_model
from rlt_compile.kernels.metadata import build_metadata
from rlt_compile.models.ouro import threshold_exit_steps
from rlt_compile.models.runner import forward_sequences


@pytest.fixture(scope="module")
def ouro(tiny_dirs):
    return load_model(tiny_dirs["ouro"])


@pytest.fixture(scope="module")
def huginn(tiny_dirs):
    return load_model(tiny_dirs["huginn"])


def prefill_then_decode_batch(model, prompts, block_size=16, max_steps=None, **decode_options):
    """Prefill each prompt[:-1] (full depth), then one decode batch of every prompt's last token."""
    blocks = -(-max(map(len, prompts)) // block_size)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(prompts))]
    planes = model.allocate_kv_cache(len(prompts) * blocks, block_size, max_steps=max_steps)
    base = {"init_scale": 0.0} if model.family == "huginn" else {}
    for p, table in zip(prompts, tables):
        meta = build_metadata([len(p) - 1], [0], [table], block_size)
        model(torch.tensor(p[:-1]), torch.arange(len(p) - 1), planes, meta, **base)
    meta = build_metadata([1] * len(prompts), [len(p) - 1 for p in prompts], tables, block_size)
    ids = torch.tensor([p[-1] for p in prompts])
    pos = torch.tensor([len(p) - 1 for p in prompts])
    logits, details = model(ids, pos, planes, meta, return_details=True, **base, **decode_options)
    return logits, details, planes, meta


PROMPTS = [list(range(5, 25)), [9, 3, 7, 1, 250, 31, 2], list(range(100, 140))]


def test_ouro_full_and_threshold_one_equal_the_plain_path(ouro):
    (plain,), details = forward_sequences(ouro, [PROMPTS[0]], return_details=True)
    (full,), _ = forward_sequences(ouro, [PROMPTS[0]], exit_at_step=3)
    (thr1,), _ = forward_sequences(ouro, [PROMPTS[0]], exit_threshold=1.0)
    assert torch.equal(full, details["logits_per_step"][-1])
    assert torch.equal(thr1, plain)


def test_ouro_threshold_exits_where_the_gate_says(ouro):
    for threshold in (0.3, 0.6, 0.9):
        (logits,), d = forward_sequences(ouro, [PROMPTS[2]], exit_threshold=threshold, return_details=True)
        want = threshold_exit_steps(d["exit_pdf"], threshold)
        assert torch.equal(d["exit_steps"], want)
        rows = torch.arange(len(PROMPTS[2]))
        assert torch.equal(logits, d["logits_per_step"][want, rows])


def test_ouro_per_row_policies_in_one_batch_equal_each_row_alone(ouro):
    fixed = torch.tensor([0, 2, -1])
    threshold = torch.tensor([float("inf"), float("inf"), 0.5])
    logits, d, _, _ = prefill_then_decode_batch(ouro, PROMPTS, exit_at_step=fixed, exit_threshold=threshold)
    for i, prompt in enumerate(PROMPTS):
        alone, da, _, _ = prefill_then_decode_batch(
            ouro, [prompt], exit_at_step=int(fixed[i]), exit_threshold=float(threshold[i])
        )
        torch.testing.assert_close(logits[i], alone[0], rtol=1e-5, atol=1e-5)
        assert d["exit_steps"][i] == da["exit_steps"][0]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_ouro_last_exited_fixed_step_stops_early_and_fills_later_slots(ouro, k):
    delayed, dd, _, _ = prefill_then_decode_batch(ouro, PROMPTS, exit_at_step=k)
    calls = []
    original = ouro.loop_step
    ouro.loop_step = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    try:
        early, de, planes, meta = prefill_then_decode_batch(ouro, PROMPTS, exit_at_step=k, kv_layout="last-exited")
    finally:
        del ouro.loop_step
    # Same output for the exiting token, with only k + 1 loop steps run for the decode batch.
    torch.testing.assert_close(early, delayed, rtol=1e-5, atol=1e-5)
    assert torch.equal(de["exit_steps"], torch.full((3,), k))
    assert len(calls) - 4 * len(PROMPTS) == k + 1
    layers = ouro.config.num_hidden_layers
    slots = meta.slot_mapping
    for t in range(k + 1, 4):
        for layer in range(layers):
            src = planes[k * layers + layer].view(2, -1, 4, 16)[:, slots]
            dst = planes[t * layers + layer].view(2, -1, 4, 16)[:, slots]
            assert torch.equal(src, dst)


def test_ouro_last_exited_threshold_matches_delayed_exit_steps(ouro):
    _, dd, _, _ = prefill_then_decode_batch(ouro, PROMPTS, exit_threshold=0.5)
    early, de, _, _ = prefill_then_decode_batch(ouro, PROMPTS, exit_threshold=0.5, kv_layout="last-exited")
    assert torch.equal(dd["exit_steps"], de["exit_steps"])


def test_last_exited_rejects_prefill_batches(ouro):
    with pytest.raises(ValueError, match="decode-only"):
        forward_sequences(ouro, [PROMPTS[0]], exit_at_step=1, kv_layout="last-exited")
    with pytest.raises(ValueError, match="kv_layout"):
        forward_sequences(ouro, [PROMPTS[0]], kv_layout="shared-everything")


def test_huginn_per_token_recurrences_equal_each_request_alone(huginn):
    steps = torch.tensor([2, 4, 3])
    logits, _, _, _ = prefill_then_decode_batch(huginn, PROMPTS, max_steps=4, num_steps=steps)
    for i, prompt in enumerate(PROMPTS):
        # alone: prefill and decode at that request's own recurrence count
        blocks = -(-len(prompt) // 16)
        planes = huginn.allocate_kv_cache(blocks, 16, max_steps=4)
        r = int(steps[i])
        meta = build_metadata([len(prompt) - 1], [0], [list(range(blocks))], 16)
        huginn(torch.tensor(prompt[:-1]), torch.arange(len(prompt) - 1), planes, meta, num_steps=4, init_scale=0.0)
        meta = build_metadata([1], [len(prompt) - 1], [list(range(blocks))], 16)
        alone = huginn(
            torch.tensor(prompt[-1:]), torch.tensor([len(prompt) - 1]), planes, meta, num_steps=r, init_scale=0.0
        )
        torch.testing.assert_close(logits[i], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("criterion", ["latent-diff", "kl"])
def test_huginn_adaptive_exit_thresholds(huginn, criterion):
    # A huge threshold exits as soon as allowed, a tiny one never exits early.
    _, d_min, _, _ = prefill_then_decode_batch(
        huginn, PROMPTS, num_steps=4, exit_criterion=criterion, exit_threshold=1e9, min_steps=2
    )
    assert torch.equal(d_min["exit_steps"], torch.full((3,), 1))
    full, d_full, _, _ = prefill_then_decode_batch(
        huginn, PROMPTS, num_steps=4, exit_criterion=criterion, exit_threshold=1e-30
    )
    assert torch.equal(d_full["exit_steps"], torch.full((3,), 3))
    plain, _, _, _ = prefill_then_decode_batch(huginn, PROMPTS, num_steps=4)
    torch.testing.assert_close(full, plain, rtol=1e-5, atol=1e-5)


def test_huginn_latent_diff_exit_matches_the_state_change(huginn):
    """A row exits at the first step whose relative state change is below the threshold."""
    changes = []
    original = huginn.loop_step

    def record(s, e, *args):
        new = original(s, e, *args)
        changes.append(((new - s).norm(dim=-1) / new.norm(dim=-1)).detach())
        return new

    huginn.loop_step = record
    try:
        prefill_then_decode_batch(huginn, PROMPTS, num_steps=4)
        observed = torch.stack(changes[-4:])  # the decode batch's 4 recurrences
    finally:
        del huginn.loop_step
    threshold = float(observed[1:].median())
    _, d, _, _ = prefill_then_decode_batch(
        huginn, PROMPTS, num_steps=4, exit_criterion="latent-diff", exit_threshold=threshold, kv_layout="delayed"
    )
    below = observed < threshold  # min_steps=1: step 0 may exit too
    want = torch.where(below.any(0), below.float().argmax(0), torch.full((3,), 3))
    assert torch.equal(d["exit_steps"], want)


@pytest.mark.parametrize("family", ["ouro", "nanbeige", "huginn"])
def test_shared_layout_needs_one_step_of_cache_and_changes_decode_outputs(tiny_dirs, family):
    model = load_model(tiny_dirs[family], load_tokenizer=False)
    opts = {"init_scale": 0.0} if family == "huginn" else {}
    prompt = PROMPTS[0]

    def prefill_decode(planes, **kw):
        meta = build_metadata([len(prompt) - 1], [0], [[0, 1]], 16)
        model(torch.tensor(prompt[:-1]), torch.arange(len(prompt) - 1), planes, meta, **opts, **kw)
        meta = build_metadata([1], [len(prompt) - 1], [[0, 1]], 16)
        return model(torch.tensor(prompt[-1:]), torch.tensor([len(prompt) - 1]), planes, meta, **opts, **kw)

    one_step = model.allocate_kv_cache(2, 16, max_steps=1)
    assert len(one_step) == model.kv_layout(1).num_slots < model.kv_layout().num_slots
    shared = prefill_decode(one_step, kv_layout="shared")
    full = prefill_decode(model.allocate_kv_cache(2, 16))
    assert (shared - full).abs().max() > 1e-3  # documented: the layout changes the model's outputs
    with pytest.raises(ValueError, match="KV slots"):
        prefill_decode(model.allocate_kv_cache(2, 16, max_steps=1))  # delayed needs every step's slots
