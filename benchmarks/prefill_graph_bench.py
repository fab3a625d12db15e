"""Prefill steps with and without ``PrefillGraphRunner`` graphs (time to first token's step).

For each case - a fresh prompt of each ``--lengths`` length, and a mixed batch (``--mixed``: decode
rows of earlier sequences plus a prompt chunk) - it times the compiled step called directly (host-
bound on small batches: hundreds of launches through Python) and the same batch replayed from the
runner's graph, both as wall milliseconds per step with the device synchronised. It checks that the
replay gives the logits of the step run on the same padded batch (a runner without graphs, bf16
tolerance), and reports the difference to the unpadded step: a bf16 model's logits move with the
shape cuBLAS tiles (a 16-token prompt alone against the same 16 tokens inside a 128-token one:
0.44 on Ouro-1.4B's random-weight logits, eager or compiled alike; docs/benchmarks.md, session 25).
Random weights with the real configuration; the graphs are captured for the token buckets the cases
need, and the capture time and the buckets dropped as slower than the step are reported.

    python benchmarks/prefill_graph_bench.py [--model ouro-1.4b] [--lengths 16,128,512] [--out FILE]
    python benchmarks/prefill_graph_bench.py --smoke     # tiny config on the CPU (static buffers, no graphs)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlt_compile.bench import BLOCK_SIZE, CONFIGS, build_random_model, tiny_bench_config  # noqa: E402
from rlt_compile.compiler import compile_model  # noqa: E402
from rlt_compile.engine.config import DEFAULT_PREFILL_GRAPH_SEQS, DEFAULT_PREFILL_GRAPH_TOKENS  # noqa: E402
from rlt_compile.kernels.metadata import build_metadata  # noqa: E402
from rlt_compile.prefill_graphs import PrefillGraphRunner  # noqa: E402

BF16_TOL = {"rtol": 3e-2, "atol": 6e-2}


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cases(lengths: list[int], mixed: int, device) -> list[tuple[str, list[tuple[int, int]]]]:
    """(name, [(query tokens, cached tokens) per sequence]); sequence i owns blocks from 64 * i on."""
    out = [(f"prompt {n}", [(n, 0)]) for n in lengths]
    if mixed:
        out.append(
            (f"{mixed} decodes + chunk {max(lengths)}", [(1, 100 + 7 * i) for i in range(mixed)] + [(max(lengths), 0)])
        )
    return out


def batch(parts: list[tuple[int, int]], vocab: int, blocks_per_seq: int, device):
    gen = torch.Generator().manual_seed(len(parts))
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(parts))]
    meta = build_metadata([q for q, _ in parts], [c for _, c in parts], tables, BLOCK_SIZE, device=device)
    total = sum(q for q, _ in parts)
    ids = torch.randint(0, vocab, (total,), generator=gen).to(device)
    pos = torch.cat([torch.arange(c, c + q) for q, c in parts]).to(device)
    rows = (torch.cumsum(torch.tensor([q for q, _ in parts]), 0) - 1).to(device)
    return ids, pos, meta, rows


def timed(fn, reps: int, sync) -> float:
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="ouro-1.4b", choices=sorted(CONFIGS))
    p.add_argument("--lengths", default="16,128,512")
    p.add_argument("--mixed", type=int, default=15, help="decode rows in the mixed case (0: none)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--token-buckets", default=None, help="capture these token buckets (default: the cases' own)")
    p.add_argument("--max-seqs", type=int, default=None, help="sequence buckets: powers of two up to this")
    p.add_argument(
        "--engine-defaults",
        action="store_true",
        help="the engine's default buckets (DEFAULT_PREFILL_GRAPH_TOKENS x _SEQS, --max-seqs as max_num_seqs: 256)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny config on the CPU")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.smoke:
        print("error: no GPU (use --smoke for the CPU check)", file=sys.stderr)
        return 2
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.smoke:
        raw, dtype, lengths, args.reps = tiny_bench_config(args.model), torch.float32, [5, 12], 2
        args.mixed = min(args.mixed, 3)
    else:
        raw, dtype = CONFIGS[args.model], torch.bfloat16
    model = build_random_model(raw, dtype, device)
    options = {"init_scale": 0.0} if model.family == "huginn" else {}
    all_cases = cases(lengths, args.mixed, device)
    seqs = max(len(parts) for _, parts in all_cases)
    blocks_per_seq = -(-(max(lengths) + 200) // BLOCK_SIZE)
    planes = model.allocate_kv_cache(seqs * blocks_per_seq, BLOCK_SIZE, max_steps=options.get("num_steps"))
    cm = compile_model(model, platform=device.type)
    if args.engine_defaults:
        token_buckets = list(DEFAULT_PREFILL_GRAPH_TOKENS)
        args.max_seqs = most = min(args.max_seqs or 256, token_buckets[-1])
        seq_buckets = [s for s in DEFAULT_PREFILL_GRAPH_SEQS if s < most] + [most]
    elif args.token_buckets:
        token_buckets, seq_buckets = [int(x) for x in args.token_buckets.split(",")], None
    else:
        token_buckets = sorted({next_pow2(sum(q for q, _ in parts)) for _, parts in all_cases})
        seq_buckets = None if args.max_seqs else sorted({next_pow2(len(parts)) for _, parts in all_cases})
    runner = PrefillGraphRunner(cm.run_compiled, planes, blocks_per_seq, token_buckets, seq_buckets,
                                max_num_seqs=args.max_seqs or seqs, step_options=options)  # fmt: skip
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _, parts in all_cases:  # compile every shape outside the timing (Triton, Inductor)
        ids, pos, meta, rows = batch(parts, model.vocab_size, blocks_per_seq, device)
        with torch.no_grad():
            cm(ids, pos, planes, meta, rows, **options)
    if device.type == "cuda":  # the graphs' pool alone, not the compile warm-ups' freed cache
        torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    runner.capture()
    pool_mb = ((torch.cuda.memory_reserved(device) if device.type == "cuda" else 0) - reserved) / 2**20
    # the same steps on the same padded batches, without graphs: what each replay must equal
    padded = PrefillGraphRunner(cm.run_compiled, planes, blocks_per_seq, runner.token_buckets, runner.seq_buckets,
                                max_num_seqs=args.max_seqs or seqs, step_options=options, use_graphs=False).capture()  # fmt: skip
    dropped = sorted({t for t, _ in runner.dropped})
    lines = [
        f"Prefill steps, {args.model} ({dtype}, {device}; {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}); "
        f"graphs: tokens {runner.token_buckets} x sequences {runner.seq_buckets} ({len(runner.shapes())} shapes), "
        f"captured in {runner.capture_seconds:.2f} s, {pool_mb:.0f} MiB more reserved",
        "",
        *(
            [
                f"Step without a graph (smallest shape): {runner.step_ms:.2f} ms; replays of all-padding batches (ms): "
                + ", ".join(f"{t}: {ms:.2f}" for t, ms in runner.replay_ms.items())
                + (f"; token buckets dropped as slower: {dropped}" if dropped else ""),
                "",
            ]
            if runner.step_ms is not None
            else []
        ),
        "| case | tokens | graph (tokens, seqs) | compiled step ms | graph replay ms | speedup | max abs diff, padded step "
        "| max abs diff, unpadded step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    failed = False
    for name, parts in all_cases:
        ids, pos, meta, rows = batch(parts, model.vocab_size, blocks_per_seq, device)
        with torch.no_grad():
            unpadded = cm(ids, pos, planes, meta, rows, **options).float()
        shape = runner.bucket_for(ids.shape[0], len(parts))
        want = unpadded if shape is None else padded(ids, pos, meta, rows).float()
        got = runner(ids, pos, meta, rows).float()
        diff, unpadded_diff = (got - want).abs().max().item(), (got - unpadded).abs().max().item()
        if not torch.allclose(got, want, **BF16_TOL):
            failed = True
        inputs = (ids, pos, meta, rows)
        with torch.no_grad():
            step_ms = timed(lambda inputs=inputs: cm(*inputs[:2], planes, *inputs[2:], **options), args.reps, sync)
        graph_ms = timed(lambda inputs=inputs: runner(*inputs), args.reps, sync)
        lines.append(
            f"| {name} | {ids.shape[0]} | {shape or 'none: the step'} | {step_ms:.2f} | {graph_ms:.2f} "
            f"| {step_ms / graph_ms:.1f}x | {diff:.2e} | {unpadded_diff:.2e} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if failed:
        print(
            "error: a graph replay's logits differ from the compiled step's on the same padded batch", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
