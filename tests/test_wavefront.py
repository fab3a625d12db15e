"""Mixed-step passes and wavefront chunked prefill (WCPB) give the plain prefill's tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, family_options

from rlt_compile import load_model
from rlt_compile.kernels.metadata import build_metadata
from rlt_compile.models.runner import forward_sequences, greedy_generate
from rlt_compile.models.wavefront import wavefront_prefill

PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(45)]


def decode_after(model, planes, table, first_token, length, n, opts):
    tokens = [first_token]
    for i in range(n - 1):
        pos = length + i
        meta = build_metadata([1], [pos], [table], 16)
        logits = model(torch.tensor(tokens[-1:]), torch.tensor([pos]), planes, meta, **opts)
        tokens.append(int(logits[0].argmax()))
    return tokens


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [7, 16, 64])
def test_wavefront_prefill_equals_plain_prefill(tiny_dirs, family, chunk):
    model = load_model(tiny_dirs[family], load_tokenizer=False)
    opts = family_options(family)
    (plain,), _ = forward_sequences(model, [PROMPT], **opts)
    want, _ = greedy_generate(model, PROMPT, 6, **opts)
    table = [3, 0, 2, 1]  # scattered blocks
    planes = model.allocate_kv_cache(4, 16, fold_steps=True)
    logits = wavefront_prefill(model, planes, PROMPT, table, chunk, **opts)
    torch.testing.assert_close(logits, plain[-1], rtol=1e-4, atol=1e-4)
    # The cache it leaves behind serves decoding exactly like the plain prefill's.
    assert decode_after(model, planes, table, int(logits.argmax()), len(PROMPT), 6, opts) == want


def test_wavefront_needs_a_folded_cache(tiny_dirs):
    model = load_model(tiny_dirs["ouro"], load_tokenizer=False)
    with pytest.raises(ValueError, match="fold_steps"):
        wavefront_prefill(model, model.allocate_kv_cache(4, 16), PROMPT, [0, 1, 2, 3], 8)


def test_wavefront_runs_fewer_larger_passes(tiny_dirs):
    model = load_model(tiny_dirs["ouro"], load_tokenizer=False)
    sizes = []
    original = model.loop_step
    model.loop_step = lambda h, *a: sizes.append(h.shape[0]) or original(h, *a)
    try:
        wavefront_prefill(model, model.allocate_kv_cache(4, 16, fold_steps=True), PROMPT, [0, 1, 2, 3], 15)
    finally:
        del model.loop_step
    assert len(sizes) == 3 + 4 - 1  # chunks + steps - 1 passes instead of 3 * 4
    assert sum(sizes) == 4 * len(PROMPT) and max(sizes) == 45
