"""Self-speculation and wavefront-prefill benchmark for Ouro-1.4B (real config, random bf16 weights).

    python benchmarks/spec_bench.py [--batch 1,8,64] [--num-draft 4] [--draft-steps 1] [--out spec.md]

Part 1 times, per batch size, a plain full-depth decode step, a draft step (``draft_steps`` loop
steps) and a verify pass (``num_draft + 1`` tokens per sequence, full depth), each captured as a
CUDA graph, and derives the speedup for acceptance rates alpha:
``E[tokens/round] * t_plain / (num_draft * t_draft + t_verify)`` with
``E = (1 - alpha^(K+1)) / (1 - alpha)``. Random weights give no meaningful acceptance, so the
rate is a parameter here. Part 2 times prefill of 1k/4k/8k-token prompts: one chunk after another
(each chunk all loop steps) vs wavefront chunked prefill, same chunk size, compiled.
Part 3 (``--pipeline``) decodes one sequence through the continuous depth batcher with CUDA graphs,
with and without the token pipeline (``pipeline_draft_step=d``), on the random model as is (drafts
almost never agree) and with forced agreement (the post-sublayer norm weights zeroed, so every loop
step returns the same normalised state and every draft is right): ms per generated token and the
accepted-draft fraction.
Part 5 (``--engine``) runs the engine itself (compile + CUDA graphs; greedy, ``--tokens`` tokens
after a ``--context``-token prompt, batch 1 and 4) plain and with self-speculation (``num_draft``
drafts of ``draft_steps`` loop steps; draft and verify passes replay their own graphs), on the
random model and with forced agreement: ms per generated token over the run, prefill included.
Part 4 (``--async-pipeline``) decodes 256 tokens of one sequence with the asynchronous token
pipeline (``rlt_compile.models.async_pipeline``: one CUDA graph per pass, decisions on the device)
on the forced-agreement model (``force_agreement``), with a fraction of drafts corrupted on the
device to set the acceptance rate, against a plain full-depth decode step (CUDA graph) of the same
model. ``--pipeline-model`` picks the model: ouro-1.4b (default), ouro-2.6b, nanbeige4.2-3b or
huginn-0125 (32 recurrences, zero initial state).
"""

from __future__ import annotations

import argparse
import time

import torch

from rlt_compile.bench import CONFIGS, build_random_model, wall_ms
from rlt_compile.compiler import compile_model
from rlt_compile.graphs import capture_graph
from rlt_compile.kernels.metadata import build_metadata
from rlt_compile.models.async_pipeline import AsyncTokenPipeline
from rlt_compile.models.depth_batching import DepthBatcher
from rlt_compile.models.wavefront import wavefront_prefill

BLOCK = 16


def graph_ms(fn, n: int = 20) -> float:
    """Capture ``fn`` (fixed shapes) in a CUDA graph and time its replays."""
    graph, _ = capture_graph(fn, torch.device("cuda"))
    return wall_ms(graph.replay, n)


def spec_costs(model, cm, batch: int, context: int, num_draft: int, draft_steps: int):
    blocks = -(-(context + num_draft + 2) // BLOCK)
    planes = model.allocate_kv_cache(batch * blocks, BLOCK)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    dev = "cuda"

    def inputs(q: int):
        meta = build_metadata([q] * batch, [context] * batch, tables, BLOCK, device=dev)
        ids = torch.randint(0, model.vocab_size, (batch * q,), device=dev)
        pos = torch.arange(context, context + q, device=dev).repeat(batch)
        return ids, pos, meta

    one, many = inputs(1), inputs(num_draft + 1)
    rows = torch.arange(batch, device=dev)
    all_rows = torch.arange(batch * (num_draft + 1), device=dev)
    draft_opts = {"num_steps": draft_steps, "exit_at_step": draft_steps - 1}
    t_plain = graph_ms(lambda: cm.run_compiled(*one[:2], planes, one[2], rows))
    t_draft = graph_ms(lambda: cm.run_compiled(*one[:2], planes, one[2], rows, **draft_opts))
    t_verify = graph_ms(lambda: cm.run_compiled(*many[:2], planes, many[2], all_rows))
    return t_plain, t_draft, t_verify


def prefill_costs(model, cm, length: int, chunk: int):
    blocks = -(-length // BLOCK)
    table = list(range(blocks))
    dev = "cuda"
    ids = torch.randint(0, model.vocab_size, (length,), device=dev)
    last = torch.tensor([length - 1], device=dev)
    plain_planes = model.allocate_kv_cache(blocks, BLOCK)

    def chunked():
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            meta = build_metadata([end - start], [start], [table], BLOCK, device=dev)
            cm.run_compiled(ids[start:end], torch.arange(start, end, device=dev), plain_planes, meta,
                            torch.tensor([end - start - 1], device=dev))  # fmt: skip

    def one_shot():
        meta = build_metadata([length], [0], [table], BLOCK, device=dev)
        cm.run_compiled(ids, torch.arange(length, device=dev), plain_planes, meta, last)

    folded = model.allocate_kv_cache(blocks, BLOCK, fold_steps=True)
    tokens = ids.tolist()

    def wavefront():
        wavefront_prefill(model, folded, tokens, table, chunk)

    out = (wall_ms(chunked, 3), wall_ms(wavefront, 3), wall_ms(one_shot, 3))
    torch.cuda.empty_cache()
    return out


def pipeline_ms(model, context: int, tokens: int, draft_step: int | None) -> tuple[float, float]:
    """(ms per generated token, accepted / drafted) for batch-1 decode through the depth batcher."""
    import time

    blocks = -(-(context + tokens + 16) // BLOCK)
    planes = model.allocate_kv_cache(blocks, BLOCK, fold_steps=True)
    batcher = DepthBatcher(model, planes, BLOCK, pipeline_draft_step=draft_step)
    batcher.capture_graphs(max_rows=8, max_blocks_per_seq=blocks, buckets=[1, 2, 4, 8])
    prompt = torch.randint(0, model.vocab_size, (context,)).tolist()
    batcher.add(0, prompt, list(range(blocks)))
    produced = 0
    for _ in range(8):  # warm-up passes
        produced += len(batcher.step())
    torch.cuda.synchronize()
    t0, start = time.perf_counter(), produced
    while produced - start < tokens:
        produced += len(batcher.step())
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / (produced - start)
    accepted = batcher.accepted / batcher.drafts if batcher.drafts else 0.0
    del batcher, planes
    torch.cuda.empty_cache()
    return ms, accepted


def engine_ms(model, batch: int, context: int, tokens: int, num_draft: int, draft_steps: int):
    """(ms per generated token, acceptance) of an engine run: ``batch`` greedy requests of ``context``
    prompt tokens and ``tokens`` new ones each, after a short warm-up run on the same engine."""
    from rlt_compile.engine import LLMEngine, SamplingParams

    max_len = context + tokens + num_draft + 16
    eng = LLMEngine(model, compile=True, use_cuda_graphs=True, max_num_seqs=max(batch, 4), max_model_len=max_len,
                    num_blocks=max(batch, 4) * (-(-max_len // BLOCK)) + 8, enable_prefix_caching=False,
                    speculative_num_draft=num_draft, speculative_draft_steps=draft_steps)  # fmt: skip
    gen = torch.Generator().manual_seed(batch)

    def run(engine, n: int) -> None:
        for _ in range(batch):
            prompt = torch.randint(0, model.vocab_size, (context,), generator=gen).tolist()
            engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        engine.run_to_completion()

    run(eng, 8)  # graph capture at first use, Triton autotuning
    torch.cuda.synchronize()
    start = time.perf_counter()
    run(eng, tokens)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / tokens
    acceptance = eng.stats.spec_acceptance_rate if num_draft else None
    del eng
    torch.cuda.empty_cache()
    return ms, acceptance


def force_agreement(model) -> None:
    """Make every loop step (Huginn: recurrence) return the same state, so every 1-step draft is the
    full-depth token. Ouro: the post-sublayer norm weights zeroed (sublayer outputs vanish), unit
    final norm; Nanbeige (no post-sublayer norms): attention and MLP output projections zeroed,
    unit final norm; Huginn: the adapter's state half zeroed (every recurrence sees only ``e``)."""
    if model.family == "huginn":
        model.transformer.adapter.weight[:, : model.config.n_embd].zero_()
        return
    for layer in model.model.layers:
        if model.family == "ouro":
            layer.input_layernorm_2.weight.zero_()
            layer.post_attention_layernorm_2.weight.zero_()
        else:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.model.norm.weight.fill_(1.0)


def family_options(model) -> dict:
    """Forward options of part 4: Huginn with a zero initial state (no random draws in the graphs)."""
    return {"init_scale": 0.0} if model.family == "huginn" else {}


def plain_step_ms(model, cm, context: int) -> float:
    """A batch-1 full-depth decode step at ``context`` as a CUDA graph."""
    blocks = -(-(context + 2) // BLOCK)
    planes = model.allocate_kv_cache(blocks, BLOCK)
    meta = build_metadata([1], [context], [list(range(blocks))], BLOCK, device="cuda")
    ids = torch.randint(0, model.vocab_size, (1,), device="cuda")
    pos = torch.tensor([context], device="cuda")
    rows = torch.zeros(1, dtype=torch.long, device="cuda")
    opts = family_options(model)
    return graph_ms(lambda: cm.run_compiled(ids, pos, planes, meta, rows, **opts))


def async_pipeline_ms(model, context: int, tokens: int, acceptance: float) -> tuple[float, dict]:
    """(ms per decoded token, stats) for the asynchronous pipeline with drafts kept right with
    probability ``acceptance`` (on the forced-agreement model every uncorrupted draft is right)."""
    import time

    dev = next(model.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else lambda: None
    blocks = -(-(context + tokens + model.default_steps) // BLOCK)  # + the rows in flight
    planes = model.allocate_kv_cache(blocks, BLOCK, fold_steps=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    wrong = torch.rand(8192, generator=gen, device=dev) >= acceptance
    vocab = model.vocab_size

    def corrupt(draft, passes):  # index_select: indexing with a 0-d tensor would read it on the host
        flip = wrong.index_select(0, (passes % wrong.numel()).view(1)).squeeze(0)
        return torch.where(flip, (draft + 1) % vocab, draft)

    runner = AsyncTokenPipeline(
        model, planes, BLOCK, list(range(blocks)), tokens, draft_transform=corrupt, **family_options(model)
    )
    prompt = torch.randint(0, vocab, (context,)).tolist()
    runner.generate(prompt, 8)  # capture and warm-up

    def timed(n):
        sync()
        t0 = time.perf_counter()
        out = runner.generate(prompt, n)
        sync()
        return time.perf_counter() - t0, out

    prefill_s, _ = timed(1)  # the prefill alone: generate(prompt, 1) runs no pass
    total_s, (_, stats) = timed(tokens)
    ms = (total_s - prefill_s) * 1e3 / (tokens - 1)
    return ms, stats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8,64")
    parser.add_argument("--num-draft", type=int, default=4)
    parser.add_argument("--draft-steps", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prefill", default="1024,4096,8192")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--out", default=None)
    parser.add_argument("--pipeline", action="store_true", help="add part 3 (token pipeline, module doc)")
    parser.add_argument("--skip-spec", action="store_true", help="skip parts 1 and 2")
    parser.add_argument("--async-pipeline", action="store_true", help="add part 4 (module doc)")
    parser.add_argument("--engine", action="store_true", help="add part 5 (module doc)")
    parser.add_argument("--tokens", type=int, default=256, help="parts 4 and 5: decoded tokens")
    parser.add_argument(
        "--pipeline-model",
        default="ouro-1.4b",
        choices=["ouro-1.4b", "ouro-2.6b", "nanbeige4.2-3b", "huginn-0125"],
        help="part 4: the model (real config, random bf16 weights)",
    )
    args = parser.parse_args(argv)
    k = args.num_draft
    lines = [
        f"Ouro-1.4B (random bf16 weights) on {torch.cuda.get_device_name()}, torch {torch.__version__}; "
        f"K={k} drafts of {args.draft_steps} loop step(s), context {args.context}; all passes CUDA graphs.",
        "",
        "| batch | plain step ms | draft step ms | verify pass ms | speedup a=0.5 | a=0.7 | a=0.9 | a=1.0 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    with torch.no_grad():
        # Ouro-1.4B for parts 1-3; part 4 builds its own model unless it is the same one
        needs_ouro = not args.skip_spec or args.pipeline or args.engine or args.pipeline_model == "ouro-1.4b"
        if needs_ouro:
            model = build_random_model(CONFIGS["ouro-1.4b"], torch.bfloat16, torch.device("cuda"))
            cm = compile_model(model, platform="cuda")
        for b in () if args.skip_spec else (int(x) for x in args.batch.split(",")):
            t_plain, t_draft, t_verify = spec_costs(model, cm, b, args.context, k, args.draft_steps)
            speedups = []
            for alpha in (0.5, 0.7, 0.9, 1.0):
                expected = k + 1 if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
                speedups.append(expected * t_plain / (k * t_draft + t_verify))
            print(f"batch {b}: plain {t_plain:.3f} draft {t_draft:.3f} verify {t_verify:.3f} ms", flush=True)
            lines.append(
                f"| {b} | {t_plain:.3f} | {t_draft:.3f} | {t_verify:.3f} | "
                + " | ".join(f"{s:.2f}x" for s in speedups)
                + " |"
            )
        lines += [
            "",
            f"Prefill, chunk {args.chunk} tokens, compiled (no graphs):",
            "",
            "| prompt | chunk by chunk ms | wavefront ms | WCPB speedup | one-shot ms | WCPB tok/s |",
            "|---|---|---|---|---|---|",
        ]
        for n in () if args.skip_spec else (int(x) for x in args.prefill.split(",")):
            chunked, wave, one = prefill_costs(model, cm, n, args.chunk)
            print(f"prefill {n}: chunked {chunked:.1f} wavefront {wave:.1f} one-shot {one:.1f} ms", flush=True)
            lines.append(
                f"| {n} | {chunked:.1f} | {wave:.1f} | {chunked / wave:.2f}x | {one:.1f} | {n / wave * 1e3:.0f} |"
            )
        if args.pipeline:
            lines += [
                "",
                "Token pipeline, batch 1, continuous depth batcher with CUDA graphs, 64 tokens after 8 warm-up passes:",
                "",
                "| model | pipeline | ms/token | tok/s | accepted drafts | speedup |",
                "|---|---|---|---|---|---|",
            ]
            for forced in (False, True):
                if forced:  # sublayer outputs vanish: every loop step gives the same normalised state
                    for layer in model.model.layers:
                        layer.input_layernorm_2.weight.zero_()
                        layer.post_attention_layernorm_2.weight.zero_()
                    model.model.norm.weight.fill_(1.0)
                label = "forced agreement" if forced else "random weights"
                base, _ = pipeline_ms(model, args.context, 64, None)
                lines.append(f"| {label} | off | {base:.3f} | {1e3 / base:.0f} | - | 1.00x |")
                for d in (0, 1):
                    ms, acc = pipeline_ms(model, args.context, 64, d)
                    print(f"pipeline {label} d={d}: {ms:.3f} ms/token (off {base:.3f}), accepted {acc:.2f}", flush=True)
                    lines.append(f"| {label} | d={d} | {ms:.3f} | {1e3 / ms:.0f} | {acc:.0%} | {base / ms:.2f}x |")
        if args.engine:
            lines += [
                "",
                f"The engine (compile + CUDA graphs), {args.context}-token prompts, {args.tokens} greedy tokens each; "
                f"self-speculation K={k}, d={args.draft_steps}; ms per generated token over the run:",
                "",
                "| model | batch | plain ms/token | speculative ms/token | acceptance | speedup |",
                "|---|---|---|---|---|---|",
            ]
            for forced in (False, True):
                if forced:
                    force_agreement(model)
                for b in (1, 4):
                    plain, _ = engine_ms(model, b, args.context, args.tokens, 0, args.draft_steps)
                    spec, acc = engine_ms(model, b, args.context, args.tokens, k, args.draft_steps)
                    label = "forced agreement" if forced else "random weights"
                    print(
                        f"engine {label} b{b}: plain {plain:.3f} spec {spec:.3f} ms/token, acceptance {acc}", flush=True
                    )
                    lines.append(f"| {label} | {b} | {plain:.3f} | {spec:.3f} | {acc:.2f} | {plain / spec:.2f}x |")
        if args.async_pipeline:
            name = args.pipeline_model
            if name != "ouro-1.4b":
                if needs_ouro:
                    del model, cm
                    torch.cuda.empty_cache()
                model = build_random_model(CONFIGS[name], torch.bfloat16, torch.device("cuda"))
                cm = compile_model(model, platform="cuda")
            force_agreement(model)
            t_plain = plain_step_ms(model, cm, args.context)
            lines += [
                "",
                f"Asynchronous token pipeline, {name} ({model.default_steps} loop steps), batch 1, {args.tokens} "
                f"tokens, context {args.context}, forced agreement with drafts corrupted on the device; plain "
                f"full-depth step (CUDA graph) {t_plain:.3f} ms:",
                "",
                "| target acceptance | measured acceptance | passes/token | ms/pass | ms/token | tok/s | speedup |",
                "|---|---|---|---|---|---|---|",
            ]
            for target in (1.0, 0.9, 0.7, 0.5, 0.0):
                ms, st = async_pipeline_ms(model, args.context, args.tokens, target)
                per_token = st["passes"] / (args.tokens - 1)
                print(f"async pipeline a={target}: {ms:.3f} ms/token, {st}", flush=True)
                lines.append(
                    f"| {target:.1f} | {st['acceptance']:.2f} | {per_token:.2f} | {ms / per_token:.3f} | {ms:.3f} | "
                    f"{1e3 / ms:.0f} | {t_plain / ms:.2f}x |"
                )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
