"""Where one pass of the asynchronous token pipeline spends its time (spec_bench part 4's model).

Built to settle why a Nanbeige4.2-3B pass cost ~92 ms on the H200 (bf16, random weights, forced
agreement) against ~4.5 ms for a plain full-depth step; its first run (session 5, docs/benchmarks.md)
measured 3.447 ms per pass with graphs against 36.3 ms without. Prints, in this order (GPU: well
under a minute after the compile):

1. the decode linears of the model alone (first layer's weights and the output head) at 1 row (the
   plain step) and at ``T`` rows (a pipeline pass: one row per loop step), each 20 calls in one CUDA
   graph: the Triton GEMV (``kernels/gemv.py``) with its default tiles for those rows (no ``tl.dot``
   at one row), the same forced onto its 16-row ``tl.dot`` tile, and ``F.linear``
   (cuBLAS), us per call, GB/s and the ratio to cuBLAS (``--rows``, ``--linears-only``);
2. the plain full-depth decode step (CUDA graph, spec_bench's timer);
3. the pipeline pass as one CUDA graph (ms per replay) and without graphs (compiled units called
   from Python, device synchronised), with the Dynamo graphs compiled / recompiles counted across
   the passes;
4. a torch.profiler table of the kernels of a few replays (device time per kernel name and shape).

    python benchmarks/pipeline_pass_profile.py [--model nanbeige4.2-3b] [--passes 64]
    python benchmarks/pipeline_pass_profile.py --device cpu --tiny     # smoke test (no graphs)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_bench import BLOCK, family_options, force_agreement, plain_step_ms  # noqa: E402

from rlt_compile.bench import CONFIGS, build_random_model, tiny_bench_config  # noqa: E402
from rlt_compile.compiler import compile_model  # noqa: E402
from rlt_compile.models.async_pipeline import AsyncTokenPipeline  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def linear_shapes(model) -> list[tuple[str, int, int]]:
    """(name, N, K) of the first layer's 2-D weights and the output head (unfused shapes)."""
    seen, out = set(), []
    for name, p in model.named_parameters():
        first_layer = any(f"{stack}.0." in name for stack in ("layers", "core_block"))
        if p.dim() == 2 and (first_layer or "lm_head" in name) and tuple(p.shape) not in seen:
            seen.add(tuple(p.shape))
            out.append((name, *p.shape))
    return out


def linear_table(model, rows: list[int], dtype: torch.dtype) -> None:
    from rlt_compile.graphs import capture_graph
    from rlt_compile.kernels import gemv

    dev = torch.device("cuda")
    variants = {
        "gemv": lambda x, w: gemv.linear_gemv(x, w),  # the default tiles for these rows
        "gemv-dot": lambda x, w: gemv.linear_gemv(x, w, gemv.gemv_config(16, *w.shape, w.dtype, w.device)),
        "F.linear": F.linear,
    }
    print(f"1. decode linears, {dtype}, 20 calls per CUDA graph (us per call, weight GB/s; / cuBLAS):", flush=True)
    print(f"   {'weight':<40} {'N x K':>14} {'rows':>4} " + " ".join(f"{v:>22}" for v in variants) + "  default tiles")
    for name, n, k in linear_shapes(model):
        nbytes = n * k * torch.tensor([], dtype=dtype).element_size()
        copies = max(1, min(8, (256 << 20) // nbytes))  # rotate copies so the weights leave the 50 MB L2
        weights = [torch.randn(n, k, dtype=dtype, device=dev) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, dtype=dtype, device=dev)
            times = []
            for fn in variants.values():

                def chain(fn=fn, x=x, ws=weights):
                    for i in range(20):
                        fn(x, ws[i % len(ws)])

                graph, _ = capture_graph(chain, dev)
                graph.replay()
                sync(dev)
                t0 = time.perf_counter()
                for _ in range(5):
                    graph.replay()
                sync(dev)
                times.append((time.perf_counter() - t0) / 100 * 1e6)
            cells = " ".join(f"{t:>7.1f} {nbytes / t / 1e3:>4.0f}GB/s {t / times[-1]:>5.2f}x" for t in times)
            print(f"   {name:<40} {n:>6} x {k:<6} {m:>4} {cells}  {gemv.gemv_config(m, n, k, dtype, dev)}", flush=True)
        weights = None  # free the copies before the next shape
        torch.cuda.empty_cache()


def dynamo_stats(cm) -> tuple[dict, int]:
    """(Dynamo graphs per compile unit, graphs Dynamo has compiled in this process)."""
    from torch._dynamo.utils import counters

    return dict(cm.graph_counts()), counters["stats"]["unique_graphs"]


def time_passes(run, passes: int, dev: torch.device) -> float:
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(passes):
        run()
    sync(dev)
    return (time.perf_counter() - t0) / passes * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="nanbeige4.2-3b", choices=sorted(CONFIGS))
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--passes", type=int, default=64, help="timed passes (each way)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny config (smoke test, e.g. with --device cpu)")
    parser.add_argument("--skip-linears", action="store_true", help="skip part 1")
    parser.add_argument("--rows", default=None, help="part 1's row counts, comma list (default: 1, 2, T)")
    parser.add_argument("--linears-only", action="store_true", help="part 1 only")
    args = parser.parse_args(argv)
    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    raw = tiny_bench_config(args.model) if args.tiny else CONFIGS[args.model]
    from rlt_compile.platform import pdl_enabled

    with torch.no_grad():
        model = build_random_model(raw, dtype, dev)
        steps = model.default_steps
        print(
            f"{args.model}{' (tiny)' if args.tiny else ''} on {torch.cuda.get_device_name() if gpu else 'cpu'}, "
            f"torch {torch.__version__}, {dtype}, vocab {model.vocab_size}, T={steps} rows per pass, "
            f"PDL {'on' if gpu and pdl_enabled() else 'off'}",
            flush=True,
        )
        if gpu and not args.skip_linears:
            rows = [int(r) for r in args.rows.split(",")] if args.rows else sorted({1, steps, 2})
            linear_table(model, rows, dtype)
        if args.linears_only:
            return 0
        t0 = time.perf_counter()
        cm = compile_model(model, platform=args.device)
        force_agreement(model)
        if gpu:
            t_plain = plain_step_ms(model, cm, args.context)
            print(
                f"2. plain full-depth step (CUDA graph): {t_plain:.3f} ms (compile + capture {time.perf_counter() - t0:.0f} s)"
            )
        n = args.passes + 1  # a pass emits at most one token: the output buffer must outlast the timed passes
        blocks = -(-(args.context + n + steps) // BLOCK)
        planes = model.allocate_kv_cache(blocks, BLOCK, fold_steps=True)
        prompt = torch.randint(0, model.vocab_size, (args.context,)).tolist()
        opts = family_options(model)
        print("3. pipeline pass:", flush=True)
        for graphs in (True, False) if gpu else (False,):
            runner = AsyncTokenPipeline(model, planes, BLOCK, list(range(blocks)), n, use_graphs=graphs, **opts)
            runner.generate(prompt, min(8, n))  # compile, capture and warm up
            before = dynamo_stats(cm)
            runner.generate(prompt, 1)  # prefill only: the pipeline's start state, no pass
            run = runner.graph.replay if graphs else runner._pass
            ms = time_passes(run, args.passes, dev)
            after = dynamo_stats(cm)
            label = "CUDA graph replay" if graphs else "no graphs (compiled units from Python)"
            print(
                f"   {label}: {ms:.3f} ms/pass over {args.passes} passes; Dynamo graphs {before[0]} -> {after[0]}, "
                f"graphs compiled during the passes: {after[1] - before[1]}; {int(runner.count)} tokens emitted",
                flush=True,
            )
            if graphs:
                graph_runner = runner
        if gpu:
            from torch.profiler import ProfilerActivity, profile

            graph_runner.generate(prompt, 1)
            reps = 4
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                for _ in range(reps):
                    graph_runner.graph.replay()
                sync(dev)
            events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(e.time_range.elapsed_us() for e in events) / 1e3 / reps  # kernel durations
            print(
                f"4. kernels of {reps} replays: {len(events) / reps:.0f} per pass, {busy:.3f} ms device time per pass"
            )
            table = prof.key_averages()
            try:
                print(table.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
            except (AttributeError, KeyError):
                print(table.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
