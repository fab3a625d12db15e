"""Depth benchmark: decode cost vs loop depth for Ouro-1.4B (fixed exit step k, "last-exited" KV)
and Huginn-0125 (recurrences r), real configs with random bf16 weights, graphs on and off.

    python benchmarks/depth_bench.py [--batch 1,64] [--tokens 20] [--out depth.md]

Each timed step decodes one token per sequence at a constant context (the same position is
decoded again, so the cost per step is that of a real decode step at that context length).

``--engine`` adds the engine comparison for Ouro-1.4B with mixed per-request exits (request ``i``
exits at step ``i % 4``), compiled + CUDA graphs, output tok/s over the whole run: full depth for
everyone (today's engines), per-request exits in lockstep batches ("last-exited", one masked pass
per loop step; the graph runs every step with exited rows masked), and continuous depth batching
(rows at different loop steps share each pass; one graph per padded bucket). ``--engine-batch``
caps the running sequences (``max_num_seqs``); with more requests than that, a row that exits early
frees its place for a waiting request, which is where continuous depth batching gains.
"""

from __future__ import annotations

import argparse

import torch

from rlt_compile.bench import CONFIGS, build_random_model, wall_ms
from rlt_compile.compiler import compile_model
from rlt_compile.engine import LLMEngine, SamplingParams
from rlt_compile.graphs import CudaGraphRunner
from rlt_compile.kernels.metadata import build_metadata

BLOCK = 16


def setup(model, batch: int, context: int, max_steps: int | None, prefill_options: dict):
    blocks = -(-(context + 1) // BLOCK)
    planes = model.allocate_kv_cache(batch * blocks, BLOCK, max_steps=max_steps)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    gen = torch.Generator().manual_seed(0)
    for i in range(batch):  # prefill one sequence at a time (keeps the activation memory small)
        ids = torch.randint(0, model.vocab_size, (context,), generator=gen).cuda()
        meta = build_metadata([context], [0], [tables[i]], BLOCK, device="cuda")
        model(ids, torch.arange(context, device="cuda"), planes, meta, torch.tensor([context - 1], device="cuda"),
              **prefill_options)  # fmt: skip
    meta = build_metadata([1] * batch, [context] * batch, tables, BLOCK, device="cuda")
    ids = torch.randint(0, model.vocab_size, (batch,), generator=gen).cuda()
    pos = torch.full((batch,), context, device="cuda")
    rows = torch.arange(batch, device="cuda")
    return planes, blocks, meta, ids, pos, rows


def measure(model, cm, label, variants, batch, context, tokens, max_steps, prefill_options, graphs=True):
    planes, blocks, meta, ids, pos, rows = setup(model, batch, context, max_steps, prefill_options)
    out = []
    for name, opts in variants:
        compiled_ms = wall_ms(lambda o=opts: cm.run_compiled(ids, pos, planes, meta, rows, **o), tokens)
        graph_ms = None
        if graphs:
            runner = CudaGraphRunner(cm.run_compiled, planes, batch, blocks, buckets=[batch], step_options=opts)
            runner.capture()
            graph_ms = wall_ms(lambda r=runner: r(ids, pos, meta, rows), tokens)
            del runner
        out.append((label, batch, name, compiled_ms, graph_ms))
        print(
            f"{label} batch {batch} {name}: compiled {compiled_ms:.3f} ms, graphs {graph_ms or float('nan'):.3f} ms",
            flush=True,
        )
    torch.cuda.empty_cache()
    return out


def engine_mixed_exits(requests: int, prompt: int, out_tokens: int, batch: int) -> list[tuple[str, float, int]]:
    """(mode, output tok/s, engine steps) for Ouro-1.4B with exits at step i % 4 (module doc)."""
    import time

    modes = [
        ("full depth, graphs", {}, False),
        ("per-request exits, lockstep (masked)", {"kv_layout": "last-exited"}, True),
        ("per-request exits, continuous depth batching", {"kv_layout": "last-exited"}, True),
    ]
    out = []
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (prompt,), generator=gen).tolist() for _ in range(requests)]
    for name, model_options, mixed in modes:
        model = build_random_model(CONFIGS["ouro-1.4b"], torch.bfloat16, torch.device("cuda"))
        eng = LLMEngine(model, num_blocks=requests * (-(-(prompt + out_tokens) // BLOCK)) + 16, max_num_seqs=batch,
                        max_model_len=prompt + out_tokens + 16, enable_prefix_caching=False, compile=True,
                        use_cuda_graphs=True, depth_batching="continuous" in name, model_options=model_options)  # fmt: skip

        def run(n_out, eng=eng, mixed=mixed):
            for i, p in enumerate(prompts):
                extra = {"exit_policy": "fixed", "exit_step": i % 4} if mixed else {}
                eng.add_request(None, p, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True, **extra))
            steps = 0
            while eng.has_unfinished():
                eng.step()
                steps += 1
            return steps

        run(2)  # warm-up: compiles and captures
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = run(out_tokens)
        torch.cuda.synchronize()
        tok_s = requests * out_tokens / (time.perf_counter() - t0)
        print(f"engine {name}: {tok_s:.0f} output tok/s, {steps} engine steps", flush=True)
        out.append((name, tok_s, steps))
        del eng, model
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--models", default="ouro-1.4b,huginn-0125")
    parser.add_argument("--out", default=None)
    parser.add_argument("--engine", action="store_true", help="add the engine comparison (module doc)")
    parser.add_argument("--engine-requests", type=int, default=128)
    parser.add_argument("--engine-batch", type=int, default=32, help="max_num_seqs of the engine comparison")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    with torch.no_grad():
        if "ouro-1.4b" in args.models:
            model = build_random_model(CONFIGS["ouro-1.4b"], torch.bfloat16, torch.device("cuda"))
            cm = compile_model(model, platform="cuda")
            variants = [(f"k={k}", {"exit_at_step": k, "kv_layout": "last-exited"}) for k in range(4)]
            for b in batches:
                rows += measure(model, cm, "ouro-1.4b", variants, b, args.context, args.tokens, None, {})
            del model, cm
            torch.cuda.empty_cache()
        if "huginn-0125" in args.models:
            model = build_random_model(CONFIGS["huginn-0125"], torch.bfloat16, torch.device("cuda"))
            cm = compile_model(model, platform="cuda")
            variants = [(f"r={r}", {"num_steps": r, "init_scale": 0.0}) for r in (4, 8, 16, 32)]
            for b in batches:
                rows += measure(model, cm, "huginn-0125", variants, b, args.context, args.tokens, 32,
                                {"num_steps": 32, "init_scale": 0.0})  # fmt: skip
    lines = [
        f"Decode cost vs depth, bf16, context {args.context}, {torch.cuda.get_device_name()}, torch {torch.__version__}.",
        "",
        "| model | batch | depth | compiled ms/step | graphs ms/step | graphs tok/s | time / full-depth time | ideal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    full = {}
    for label, b, name, _, g in rows:
        if name in ("k=3", "r=32"):
            full[(label, b)] = g
    for label, b, name, c, g in rows:
        depth = int(name.split("=")[1]) + (1 if label.startswith("ouro") else 0)
        ideal = depth / (4 if label.startswith("ouro") else 32)
        ratio = g / full[(label, b)] if g and full.get((label, b)) else None
        lines.append(f"| {label} | {b} | {name} | {c:.3f} | {g:.3f} | {b * 1e3 / g:.0f} | {ratio:.2f} | {ideal:.2f} |")
    if args.engine:
        results = engine_mixed_exits(args.engine_requests, 64, 32, args.engine_batch)
        lines += [
            "",
            f"Engine, Ouro-1.4B, {args.engine_requests} requests, at most {args.engine_batch} running (64-token prompts, "
            "32 output tokens), request i exits "
            "at step i % 4 (ideal: 0.625 of full depth), compile + CUDA graphs:",
            "",
            "| mode | output tok/s | engine steps | vs full depth |",
            "|---|---|---|---|",
        ]
        base = results[0][1]
        lines += [f"| {name} | {tok:.0f} | {steps} | {tok / base:.2f}x |" for name, tok, steps in results]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
