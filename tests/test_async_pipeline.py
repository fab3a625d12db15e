"""Asynchronous token pipeline (batch-1 self-speculation with the decisions on the device): the
tokens of plain greedy decoding, exactly (fp32), whatever the drafts; a token per pass when every
draft is right; one CUDA graph replayed with no host read per pass on the GPU."""

from __future__ import annotations

import pytest
import torch

from rlt_compile import load_model
from rlt_compile.models.async_pipeline import AsyncTokenPipeline
from rlt_compile.models.runner import greedy_generate

PROMPTS = [[(i * 11 + j * 5) % 250 + 3 for j in range(n)] for i, n in enumerate((6, 19, 33))]
BLOCKS = 4


@pytest.fixture(scope="module")
def ouro(tiny_dirs):
    return load_model(tiny_dirs["ouro"], load_tokenizer=False)


def pipeline(model, n, **kw):
    planes = model.allocate_kv_cache(BLOCKS, 16, fold_steps=True)
    return AsyncTokenPipeline(model, planes, 16, list(range(BLOCKS)), n, **kw)


def forced_agreement(model):
    """Attention and MLP outputs zeroed, unit final norm: every loop step returns the same
    normalised state, so every 1-step draft is the full-depth token."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    return model


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tokens_equal_plain_greedy_decoding(ouro, prompt):
    n = 10
    want, _ = greedy_generate(ouro, prompt, n)
    got, stats = pipeline(ouro, n).generate(prompt, n)
    assert got == want
    assert stats["verified"] == n - 1 and 0 <= stats["accepted"] <= n - 1


def test_a_token_per_pass_when_every_draft_is_right(tiny_dirs):
    model = forced_agreement(load_model(tiny_dirs["ouro"], load_tokenizer=False))
    n, steps = 12, model.config.total_ut_steps
    want, _ = greedy_generate(model, PROMPTS[1], n)
    got, stats = pipeline(model, n).generate(PROMPTS[1], n)
    assert got == want
    assert stats["accepted"] == n - 1
    assert stats["passes"] == (n - 1) + steps - 1  # fill the pipeline once, then one token per pass


def test_wrong_drafts_are_rejected_and_restart(tiny_dirs):
    """Every third draft corrupted on the device: the output is unchanged, the acceptance drops
    and each rejection costs a refill of the pipeline."""
    model = forced_agreement(load_model(tiny_dirs["ouro"], load_tokenizer=False))
    n, steps, vocab = 12, model.config.total_ut_steps, model.vocab_size

    def corrupt(draft, passes):
        return torch.where(passes % 3 == 0, (draft + 1) % vocab, draft)

    want, _ = greedy_generate(model, PROMPTS[2], n)
    got, stats = pipeline(model, n, draft_transform=corrupt).generate(PROMPTS[2], n)
    assert got == want
    rejected = stats["verified"] - stats["accepted"]
    assert 0 < stats["accepted"] < n - 1 and rejected > 0
    assert stats["passes"] == (n - 1) + (steps - 1) * (1 + rejected)


def test_generate_can_run_twice_and_checks_sizes(ouro):
    n = 6
    runner = pipeline(ouro, n)
    first, _ = runner.generate(PROMPTS[0], n)
    again, _ = runner.generate(PROMPTS[0], n)
    assert first == again
    with pytest.raises(ValueError, match="exceed"):
        runner.generate(list(range(3, 3 + 60)), n)
    with pytest.raises(ValueError, match="max_new_tokens"):
        runner.generate(PROMPTS[0], 500)


def test_needs_ouro_and_compiled_model_for_graphs(tiny_dirs, ouro):
    nanbeige = load_model(tiny_dirs["nanbeige"], load_tokenizer=False)
    with pytest.raises(ValueError, match="Ouro"):
        AsyncTokenPipeline(nanbeige, nanbeige.allocate_kv_cache(4, 16, fold_steps=True), 16, [0, 1, 2, 3], 4)
    with pytest.raises(ValueError, match="compiled model"):
        pipeline(ouro, 4, use_graphs=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_pipeline_equals_plain_decoding(tiny_dirs, dtype):
    from rlt_compile.compiler import compile_model

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = load_model(tiny_dirs["ouro"], dtype=dtype, device="cuda", load_tokenizer=False)
    n = 16
    want, _ = greedy_generate(model, PROMPTS[1], n)
    compile_model(model, "cuda")
    runner = pipeline(model, n)
    assert runner.graph is None and runner.use_graphs
    got, stats = runner.generate(PROMPTS[1], n)
    assert runner.graph is not None
    plain, _ = greedy_generate(model, PROMPTS[1], n)  # compiled, no graphs
    assert got == plain
    if dtype == torch.float32:
        assert got == want
    assert stats["verified"] == n - 1
