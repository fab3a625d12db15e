"""Depth options through the engine: Ouro exit policies per request, Huginn recurrences per request,
the "last-exited" KV layout for decode tokens; batched == alone and no block leak."""

from __future__ import annotations

import pytest
from depth_references import ouro_last_exited

from rlt_compile import LLM, SamplingParams
from rlt_compile.models.runner import greedy_generate

PROMPTS = [[(i * 7 + j * 13) % 250 + 3 for j in range(n)] for i, n in enumerate((5, 17, 9, 30))]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **kw)


def run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks  # no leak
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def ouro_llm(tiny_dirs):
    return LLM(str(tiny_dirs["ouro"]), num_blocks=64)


def test_ouro_per_request_exit_policies_equal_each_request_alone(ouro_llm):
    model = ouro_llm.model
    policies = [
        greedy(exit_policy="fixed", exit_step=0),
        greedy(exit_policy="full"),
        greedy(exit_policy="threshold", exit_threshold=0.5),
        greedy(),
    ]
    batched = run(ouro_llm, PROMPTS, policies)
    expected = [
        greedy_generate(model, PROMPTS[0], 6, exit_at_step=0)[0],
        greedy_generate(model, PROMPTS[1], 6, exit_at_step=3)[0],
        greedy_generate(model, PROMPTS[2], 6, exit_threshold=0.5)[0],
        greedy_generate(model, PROMPTS[3], 6)[0],
    ]
    assert batched == expected
    for prompt, params, want in zip(PROMPTS, policies, expected):
        assert run(ouro_llm, [prompt], params) == [want]


def test_ouro_full_and_threshold_one_equal_the_plain_engine(ouro_llm):
    plain = run(ouro_llm, PROMPTS, greedy())
    assert run(ouro_llm, PROMPTS, greedy(exit_policy="threshold", exit_threshold=1.0)) == plain
    model = ouro_llm.model
    assert run(ouro_llm, PROMPTS, greedy(exit_policy="full")) == [
        greedy_generate(model, p, 6, exit_at_step=3)[0] for p in PROMPTS
    ]


def test_engine_last_exited_layout_matches_the_model_level_reference(tiny_dirs):
    llm = LLM(str(tiny_dirs["ouro"]), num_blocks=64, model_options={"exit_at_step": 1, "kv_layout": "last-exited"})
    got = run(llm, PROMPTS, greedy())
    assert got == [ouro_last_exited(llm.model, p, 6, exit_at_step=1) for p in PROMPTS]
    delayed = run(LLM(str(tiny_dirs["ouro"]), num_blocks=64, model_options={"exit_at_step": 1}), PROMPTS, greedy())
    assert [g[0] for g in got] == [d[0] for d in delayed]  # the first token comes from the full-depth prefill


def test_huginn_per_request_recurrences(tiny_dirs):
    llm = LLM(str(tiny_dirs["huginn"]), num_blocks=64, model_options={"init_scale": 0.0, "num_steps": 4})
    model = llm.model
    steps = [2, 4, 3, 1]
    batched = run(llm, PROMPTS, [greedy(num_steps=r) for r in steps])
    for prompt, r, got in zip(PROMPTS, steps, batched):
        want, _ = greedy_generate(model, prompt, 6, max_steps=4, num_steps=r, init_scale=0.0)
        assert got == want


def test_depth_options_are_validated(tiny_dirs, ouro_llm):
    with pytest.raises(ValueError, match="exit_policy"):
        SamplingParams(exit_policy="sometimes")
    with pytest.raises(ValueError, match="exit_step"):
        SamplingParams(exit_policy="fixed")
    with pytest.raises(ValueError, match="exit_threshold"):
        SamplingParams(exit_policy="threshold", exit_threshold=1.5)
    with pytest.raises(ValueError, match="exit_step"):
        ouro_llm.generate([PROMPTS[0]], greedy(exit_policy="fixed", exit_step=4), use_tqdm=False)
    with pytest.raises(ValueError, match="num_steps"):
        ouro_llm.generate([PROMPTS[0]], greedy(num_steps=2), use_tqdm=False)
    huginn = LLM(str(tiny_dirs["huginn"]), num_blocks=16, model_options={"init_scale": 0.0})
    with pytest.raises(ValueError, match="exit_policy"):
        huginn.generate([PROMPTS[0]], greedy(exit_policy="full"), use_tqdm=False)
    with pytest.raises(ValueError, match="num_steps"):
        huginn.generate([PROMPTS[0]], greedy(num_steps=5), use_tqdm=False)


@pytest.mark.parametrize(
    "model_options", [{}, {"kv_layout": "last-exited"}, {"kv_layout": "last-exited", "exit_at_step": 2}]
)
def test_per_request_exits_replay_static_buffer_steps_with_the_same_tokens(tiny_dirs, model_options):
    """Per-request exits run through the per-row-option graph runner (static buffers on the CPU),
    engine-wide "last-exited" without a fixed exit through the masked path: same tokens as plain."""
    policies = [
        greedy(exit_policy="fixed", exit_step=0),
        greedy(exit_policy="full"),
        greedy(exit_policy="threshold", exit_threshold=0.5),
        greedy(),
    ]
    kw = {"num_blocks": 64, "model_options": model_options}
    plain = LLM(str(tiny_dirs["ouro"]), **kw)
    graphs = LLM(str(tiny_dirs["ouro"]), use_cuda_graphs=True, **kw)
    assert run(graphs, PROMPTS, policies) == run(plain, PROMPTS, policies)
    runner = graphs.engine.runner
    assert runner._row_graph_runner is not None and runner._row_graph_runner.replays > 0
    assert run(graphs, PROMPTS, greedy()) == run(plain, PROMPTS, greedy())
    assert runner.graph_runner.replays > 0


@pytest.mark.gpu
def test_cuda_graphs_serve_per_request_exits_with_eager_tokens(tiny_dirs):
    """Compiled + CUDA graphs with per-request exit policies ("last-exited" layout: the masked
    lockstep graph) give the eager engine's tokens, and the per-row-option graphs replay."""
    import torch

    from rlt_compile import load_model

    policies = [
        greedy(exit_policy="fixed", exit_step=0),
        greedy(exit_policy="full"),
        greedy(exit_policy="threshold", exit_threshold=0.5),
        greedy(exit_policy="fixed", exit_step=2),
    ]
    options = {"kv_layout": "last-exited"}

    def build(**kw):
        model = load_model(tiny_dirs["ouro"], dtype=torch.float32, device="cuda", load_tokenizer=False)
        return LLM(model, num_blocks=64, max_num_seqs=8, model_options=options, **kw)

    eager = build()
    graphs = build(compile=True, use_cuda_graphs=True)
    assert run(graphs, PROMPTS, policies) == run(eager, PROMPTS, policies)
    assert graphs.engine.runner._row_graph_runner.replays > 0
    assert run(graphs, PROMPTS, greedy()) == run(eager, PROMPTS, greedy())
    assert graphs.engine.runner.graph_runner.replays > 0
