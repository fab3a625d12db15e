"""Asynchronous token pipeline (batch-1 self-speculation with the decisions on the device), for every
family: the tokens of plain greedy decoding, exactly (fp32), whatever the drafts (Huginn: with its
random initial states too); a token per pass when every draft is right; one CUDA graph replayed with
no host read per pass on the GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, family_options

from rlt_compile import load_model
from rlt_compile.models.async_pipeline import AsyncTokenPipeline
from rlt_compile.models.runner import forward_sequences, greedy_generate
from rlt_compile.tiny import write_tiny_checkpoint

PROMPTS = [[(i * 11 + j * 5) % 250 + 3 for j in range(n)] for i, n in enumerate((6, 19, 33))]
BLOCKS = 4
# (model, pipeline / forward options): Nanbeige also with 3 loops and the norm only at the end,
# Huginn with zero and random initial states and with fewer recurrences than its cache holds
CASES = [
    ("ouro", {}),
    ("nanbeige", {}),
    ("nanbeige-3-loops", {}),
    ("huginn", {"init_scale": 0.0}),
    ("huginn", {"init_scale": 1.0}),
    ("huginn", {"init_scale": 1.0, "num_steps": 3}),
]


@pytest.fixture(scope="module")
def models(tiny_dirs, tmp_path_factory):
    out = {f: load_model(tiny_dirs[f], load_tokenizer=False) for f in FAMILIES}
    path = write_tiny_checkpoint(
        "nanbeige", tmp_path_factory.mktemp("nanbeige3"), seed=2, num_loops=3, skip_loop_final_norm=True
    )
    out["nanbeige-3-loops"] = load_model(path, load_tokenizer=False)
    return out


@pytest.fixture(scope="module")
def ouro(models):
    return models["ouro"]


def pipeline(model, n, **kw):
    planes = model.allocate_kv_cache(BLOCKS, 16, fold_steps=True)
    return AsyncTokenPipeline(model, planes, 16, list(range(BLOCKS)), n, **kw)


def forced_agreement(model):
    """Every loop step returns the same state, so every 1-step draft is the full-depth token.
    Ouro / Nanbeige: attention and MLP outputs zeroed, unit final norm (each step returns the
    normalised embedding). Huginn: the adapter ignores the state, so every recurrence computes the
    core block of the same injected prelude output."""
    with torch.no_grad():
        if model.family == "huginn":
            model.transformer.adapter.weight[:, : model.config.n_embd].zero_()
            return model
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    return model


def expected_passes(steps: int, n: int, corrupted) -> tuple[int, int]:
    """(passes, accepted drafts) of the pipeline on a forced-agreement model whose draft of pass
    ``p`` is corrupted when ``corrupted(p)``: a host model of the device bookkeeping."""
    wrong = [False]  # per row from step 0: is its token a wrong draft (row 0: the prefill's token)
    passes = emitted = accepted = 0
    while emitted < n - 1:
        if len(wrong) == steps:  # full: row T-1's final token verifies its child's draft
            emitted += 1
            if wrong[-2]:
                wrong = [False]  # the final token restarts alone
                passes += 1
                continue
            accepted += 1
            wrong = wrong[:-1]
        wrong = [corrupted(passes), *wrong]
        passes += 1
    return passes, accepted


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize(("name", "opts"), CASES)
def test_tokens_equal_plain_greedy_decoding(models, name, opts, prompt):
    model, n = models[name], 10
    torch.manual_seed(7)  # Huginn's random initial states: the pipeline draws what plain decoding draws
    want, _ = greedy_generate(model, prompt, n, **opts)
    torch.manual_seed(7)
    got, stats = pipeline(model, n, **opts).generate(prompt, n)
    assert got == want
    assert stats["verified"] == n - 1 and 0 <= stats["accepted"] <= n - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_a_token_per_pass_when_every_draft_is_right(tiny_dirs, family):
    model = forced_agreement(load_model(tiny_dirs[family], load_tokenizer=False))
    n, steps = 12, model.default_steps
    want, _ = greedy_generate(model, PROMPTS[1], n)
    got, stats = pipeline(model, n).generate(PROMPTS[1], n)
    assert got == want
    assert stats["accepted"] == n - 1
    assert stats["passes"] == (n - 1) + steps - 1  # fill the pipeline once, then one token per pass


@pytest.mark.parametrize("family", FAMILIES)
def test_wrong_drafts_are_rejected_and_restart(tiny_dirs, family):
    """Every third draft corrupted on the device: the output is unchanged, the acceptance drops
    and each rejection costs a refill of the pipeline (``T - 1`` passes)."""
    model = forced_agreement(load_model(tiny_dirs[family], load_tokenizer=False))
    n, steps, vocab = 12, model.default_steps, model.vocab_size

    def corrupt(draft, passes):
        return torch.where(passes % 3 == 0, (draft + 1) % vocab, draft)

    want, _ = greedy_generate(model, PROMPTS[2], n)
    got, stats = pipeline(model, n, draft_transform=corrupt).generate(PROMPTS[2], n)
    assert got == want
    rejected = stats["verified"] - stats["accepted"]
    assert 0 < stats["accepted"] < n - 1 and rejected > 0
    assert (stats["passes"], stats["accepted"]) == expected_passes(steps, n, lambda p: p % 3 == 0)
    # each rejection but a last one costs T - 1 passes of refill
    assert stats["passes"] - (n - 1) - (steps - 1) in ((steps - 1) * rejected, (steps - 1) * (rejected - 1))


@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
def test_sampled_pipeline_accepts_every_draft_that_equals_the_target(tiny_dirs, family):
    """Forced agreement: the 1-step distribution is the full-depth one, so every draft is accepted
    (one token per pass once full), whatever was drawn."""
    model = forced_agreement(load_model(tiny_dirs[family], load_tokenizer=False))
    n, steps = 12, model.default_steps
    torch.manual_seed(0)
    got, stats = pipeline(model, n, temperature=0.8).generate(PROMPTS[1], n)
    assert len(got) == n and all(0 <= t < model.vocab_size for t in got)
    assert stats["accepted"] == n - 1 and stats["passes"] == (n - 1) + steps - 1


def test_sampled_pipeline_tokens_follow_the_full_depth_distribution(ouro):
    """Random weights: most 1-step drafts differ from the full-depth distribution, so tokens come
    from accepted drafts and residual draws alike. Over many runs the counts of the second token
    match the sum of its exact conditional distributions ``p(. | prompt, first token)`` (computed at
    full depth without the pipeline) within 5 standard deviations: every token expected 5 times or
    more, and the rest pooled."""
    prompt, temperature, runs = PROMPTS[0], 0.25, 600
    pipe = pipeline(ouro, 2, temperature=temperature)
    torch.manual_seed(1)
    pairs, accepted = [], 0
    for _ in range(runs):
        tokens, stats = pipe.generate(prompt, 2)
        pairs.append(tuple(tokens))
        accepted += stats["accepted"]
    assert 0.05 * runs < accepted < 0.95 * runs  # both branches: accepted drafts and residual draws
    firsts = sorted({a for a, _ in pairs})
    logits, _ = forward_sequences(ouro, [prompt + [a] for a in firsts])
    conditional = {a: torch.softmax(row[-1].double() / temperature, -1) for a, row in zip(firsts, logits)}
    expected = sum(conditional[a] for a, _ in pairs)
    variance = sum(conditional[a] * (1 - conditional[a]) for a, _ in pairs)
    observed = torch.zeros_like(expected)
    for _, b in pairs:
        observed[b] += 1
    common = expected >= 5  # rare tokens pooled into one cell (a normal approximation needs counts)
    cells = [(observed[common], expected[common], variance[common])]
    cells.append((observed[~common].sum()[None], expected[~common].sum()[None], variance[~common].sum()[None]))
    z = torch.cat([(o - e).abs() / v.sqrt() for o, e, v in cells])
    assert z.max() < 5, (z.max(), observed.topk(5), expected.topk(5))
    assert expected.max() > 60  # the test has power: some tokens are likely
    # the first token comes from the prefill's distribution
    first = torch.softmax(forward_sequences(ouro, [prompt])[0][0][-1].double() / temperature, -1)
    counts = torch.bincount(torch.tensor([a for a, _ in pairs]), minlength=first.numel()).double()
    likely = runs * first >= 5
    assert ((counts - runs * first)[likely].abs() / (runs * first * (1 - first))[likely].sqrt()).max() < 5


def test_sampled_pipeline_rejects_bad_options(ouro):
    with pytest.raises(ValueError, match="temperature"):
        pipeline(ouro, 4, temperature=-1.0)
    with pytest.raises(ValueError, match="draft_transform"):
        pipeline(ouro, 4, temperature=1.0, draft_transform=lambda d, i: d)


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


def test_options_and_compiled_model_for_graphs(models, ouro):
    huginn = models["huginn"]
    with pytest.raises(ValueError, match="Huginn options"):
        pipeline(ouro, 4, init_scale=0.0)
    with pytest.raises(ValueError, match="recurrences the cache holds"):
        pipeline(huginn, 4, num_steps=5)
    with pytest.raises(ValueError, match="at least 2"):
        pipeline(huginn, 4, num_steps=1)
    with pytest.raises(ValueError, match="compiled model"):
        pipeline(ouro, 4, use_graphs=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_passes_of_a_compiled_model_compile_nothing(tiny_dirs, family):
    """After a compiled plain decode and one warm-up ``generate``, further passes (another prompt and
    length) run the units' existing Dynamo graphs: none is compiled again (a recompile per pass
    would put Dynamo in the loop of the uncaptured pipeline)."""
    from torch._dynamo.utils import counters

    from rlt_compile.compiler import compile_model

    model = load_model(tiny_dirs[family], load_tokenizer=False)
    cm = compile_model(model, "cpu", inductor=False)  # Dynamo's guards and graphs without Inductor
    opts = family_options(family)
    greedy_generate(model, PROMPTS[0], 3, **opts)  # the plain step's cache first, as spec_bench does
    runner = pipeline(model, 12, **opts)
    runner.generate(PROMPTS[1], 12)
    graphs = cm.graph_counts()
    counters.clear()
    _, stats = runner.generate(PROMPTS[2], 10)
    assert stats["passes"] >= 9
    assert cm.graph_counts() == graphs
    assert counters["stats"]["unique_graphs"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_pipeline_equals_plain_decoding(tiny_dirs, family, dtype):
    """The captured pipeline (compiled model) gives the compiled model's plain greedy tokens, in
    fp32 also the eager model's; Huginn with random initial states drawn from the same seed."""
    from rlt_compile.compiler import compile_model

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = load_model(tiny_dirs[family], dtype=dtype, device="cuda", load_tokenizer=False)
    n = 16
    opts = {"init_scale": 1.0} if family == "huginn" else {}
    torch.manual_seed(0)
    want, _ = greedy_generate(model, PROMPTS[1], n, **opts)
    compile_model(model, "cuda")
    runner = pipeline(model, n, **opts)
    assert runner.graph is None and runner.use_graphs
    torch.manual_seed(0)
    got, stats = runner.generate(PROMPTS[1], n)
    assert runner.graph is not None
    torch.manual_seed(0)
    plain, _ = greedy_generate(model, PROMPTS[1], n, **opts)  # compiled, no graphs
    assert got == plain
    if dtype == torch.float32:
        assert got == want
    assert stats["verified"] == n - 1


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
def test_cuda_graph_sampled_pipeline(tiny_dirs, family):
    """Sampled inside the captured pass (the draws advance the default CUDA generator's graph-safe
    state): a forced-agreement model accepts every draft; after the capture, runs with one seed
    repeat the tokens, another seed changes them."""
    from rlt_compile.compiler import compile_model

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = forced_agreement(load_model(tiny_dirs[family], device="cuda", load_tokenizer=False))
    compile_model(model, "cuda")
    n, steps = 24, model.default_steps
    runner = pipeline(model, n, temperature=1.0)
    runner.generate(PROMPTS[1], n)  # captures (its warm-up passes draw from the generator too)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        tokens, stats = runner.generate(PROMPTS[1], n)
        assert stats["accepted"] == n - 1 and stats["passes"] == (n - 1) + steps - 1
        runs.append(tokens)
    assert runner.graph is not None
    assert runs[0] == runs[1] and runs[0] != runs[2]
