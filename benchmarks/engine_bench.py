"""Engine throughput on the GPU: Ouro-1.4B (real config, random bf16 weights) through LLMEngine.

Scenarios: 80-token prompts with 64 output tokens at batch 1/32/128/256, and 1k-token prompts at
batch 32/64 (greedy, ``ignore_eos``). Modes, each measured in the same process:

  eager          the plain engine: model forward in eager PyTorch, reference (torch) attention
  eager+triton   the same with ``rlt::attention`` dispatched to the Triton paged kernel on CUDA
  compiled       ``compile=True`` + ``use_cuda_graphs=True``: decode graphs and the default prefill /
                 mixed-step graphs (only when rlt_compile.compiler and rlt_compile.graphs exist)
  no-prefill-graphs  the same without prefill / mixed-step graphs (``cuda_graph_prefill_tokens=[]``);
                 not in the default modes
  prefill-graphs the same with prefill / mixed-step graphs for powers of two from 16 to 2048 tokens;
                 not in the default modes

Output tok/s counts generated tokens over the wall time of the whole run (prefill included); the
non-reference modes first run each scenario once untimed (up to ``--warm-time-limit``), so Triton
compilation and autotuning for its shapes stay out of the timing.
The eager reference attention loops over sequences on the host, so its runs are time-limited
(``--eager-time-limit``) and marked partial: tok/s is then measured over what finished in time.

    python benchmarks/engine_bench.py --out engine.md [--modes eager,eager+triton,compiled] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlt_compile.bench import CONFIGS, build_random_model  # noqa: E402
from rlt_compile.engine import LLMEngine, SamplingParams  # noqa: E402

OURO_1_4B = CONFIGS["ouro-1.4b"]

# (name, batch, prompt tokens, output tokens)
SCENARIOS = [
    ("80+64 b1", 1, 80, 64),
    ("80+64 b32", 32, 80, 64),
    ("80+64 b128", 128, 80, 64),
    ("80+64 b256", 256, 80, 64),
    ("1k+64 b32", 32, 1024, 64),
    ("1k+64 b64", 64, 1024, 64),
]
MODES = ("eager", "eager+triton", "compiled")
PREFILL_GRAPH_TOKENS = [16 << i for i in range(8)]  # 16 .. 2048
FAST_MODES = ("compiled", "no-prefill-graphs", "prefill-graphs")


@dataclass
class Result:
    scenario: str
    mode: str
    tok_s: float
    seconds: float
    generated: int
    expected: int
    note: str = ""
    decode_tok_s: float = 0.0  # over decode-only steps (no prompt tokens in the batch)


def random_model(device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """Ouro-1.4B with random weights (rlt_compile.bench.build_random_model)."""
    return build_random_model(OURO_1_4B, dtype, torch.device(device), seed)


def set_attention(backend: str) -> None:
    """Route the eager ``rlt::attention`` CUDA kernel to the Triton op or back to the reference."""
    from rlt_compile.kernels.reference import attention_reference

    if backend == "triton":
        import rlt_compile.kernels.triton_attention  # noqa: F401  (registers rlt::attention_triton)

        def impl(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale):
            return torch.ops.rlt.attention_triton(
                q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale
            )
    else:
        impl = attention_reference
    torch.library.register_kernel("rlt::attention", "cuda", impl)


def make_engine(model, mode: str, num_blocks: int, max_num_seqs: int) -> LLMEngine:
    fast = mode in FAST_MODES
    prefill_tokens = {"prefill-graphs": PREFILL_GRAPH_TOKENS, "no-prefill-graphs": []}.get(mode)
    return LLMEngine(
        model,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=2048,
        enable_prefix_caching=False,  # random prompts share nothing; keep hashing out of the numbers
        compile=fast,
        use_cuda_graphs=fast,
        cuda_graph_prefill_tokens=prefill_tokens,
    )


def run_scenario(eng: LLMEngine, batch: int, prompt_len: int, out_len: int, time_limit: float | None, seed: int):
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    ids = [
        eng.add_request(None, torch.randint(0, 49152, (prompt_len,), generator=gen).tolist(), params)
        for _ in range(batch)
    ]
    before = eng.stats.generated_tokens
    torch.cuda.synchronize()
    start = time.perf_counter()
    partial = False
    decode_tokens, decode_seconds = 0, 0.0
    while eng.has_unfinished():
        prefill, generated, t = eng.stats.prefill_tokens, eng.stats.generated_tokens, time.perf_counter()
        eng.step()  # sampling reads the tokens back, so the step has finished on the device here
        if eng.stats.prefill_tokens == prefill:
            decode_tokens += eng.stats.generated_tokens - generated
            decode_seconds += time.perf_counter() - t
        if time_limit is not None and time.perf_counter() - start > time_limit and eng.has_unfinished():
            partial = True
            break
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = eng.stats.generated_tokens - before
    if partial:
        for rid in ids:
            eng.abort_request(rid)
        while eng.has_unfinished():
            eng.step()
    return generated, seconds, partial, decode_tokens / decode_seconds if decode_seconds else 0.0


def warm_up(eng: LLMEngine) -> None:
    """Compile/autotune outside the timings: a prefill, a mixed step and decodes."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for n in (3, 40):
        eng.add_request(None, list(range(1, n + 1)), params)
    while eng.has_unfinished():
        eng.step()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write a markdown table here")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--scenarios", default=None, help="comma-separated names (default: all)")
    p.add_argument("--eager-time-limit", type=float, default=4.0, help="seconds per eager (reference) run")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per run for the other modes")
    p.add_argument("--warm-time-limit", type=float, default=10.0, help="seconds per untimed warm pass")
    p.add_argument("--quick", action="store_true", help="16 output tokens instead of 64")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("engine_bench needs a CUDA GPU", file=sys.stderr)
        return 1
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - {*MODES, *FAST_MODES}
    if unknown:
        print(f"unknown modes {sorted(unknown)}", file=sys.stderr)
        return 2
    if set(FAST_MODES) & set(modes) and (
        importlib.util.find_spec("rlt_compile.compiler") is None
        or importlib.util.find_spec("rlt_compile.graphs") is None
    ):
        print("compiled modes skipped: rlt_compile.compiler / rlt_compile.graphs not available", file=sys.stderr)
        modes = [m for m in modes if m not in FAST_MODES]
    scenarios = SCENARIOS
    if args.scenarios:
        wanted = {s.strip() for s in args.scenarios.split(",")}
        scenarios = [s for s in SCENARIOS if s[0] in wanted]
    if args.quick:
        scenarios = [(n, b, pl, 16) for n, b, pl, _ in scenarios]

    t0 = time.perf_counter()
    model = random_model()
    print(f"model ready in {time.perf_counter() - t0:.1f}s: {torch.cuda.get_device_name()}", flush=True)
    max_seqs = max(b for _, b, _, _ in scenarios)
    need_tokens = max(b * (-(-(pl + o) // 16) * 16) for _, b, pl, o in scenarios)
    num_blocks = need_tokens // 16 + 64
    results: list[Result] = []
    for mode in modes:
        set_attention("reference" if mode == "eager" else "triton")
        t_mode = time.perf_counter()
        eng = make_engine(model, mode, num_blocks, max_seqs)
        warm_up(eng)
        print(f"[{mode}] engine + warm-up {time.perf_counter() - t_mode:.1f}s", flush=True)
        limit = args.eager_time_limit if mode == "eager" else args.time_limit
        for i, (name, batch, prompt_len, out_len) in enumerate(scenarios):
            if mode != "eager":  # an untimed pass with the same shapes first: Triton JIT, autotuning
                run_scenario(eng, batch, prompt_len, out_len, args.warm_time_limit, seed=i)
            generated, seconds, partial, decode_tok_s = run_scenario(eng, batch, prompt_len, out_len, limit, seed=i)
            r = Result(
                name,
                mode,
                generated / seconds,
                seconds,
                generated,
                batch * out_len,
                "partial (time limit)" if partial else "",
                decode_tok_s,
            )
            results.append(r)
            print(
                f"[{mode}] {name}: {r.tok_s:9.1f} tok/s (decode steps {decode_tok_s:9.1f} tok/s)  {seconds:6.2f}s  "
                f"{generated}/{r.expected} tokens {r.note}",
                flush=True,
            )
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    set_attention("reference")
    table = format_table(results, modes)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


def format_table(results: list[Result], modes: list[str]) -> str:
    by = {(r.scenario, r.mode): r for r in results}
    scenarios = list(dict.fromkeys(r.scenario for r in results))
    head = ["scenario"] + [f"{m} tok/s" for m in modes]
    if "eager+triton" in modes and "compiled" in modes:
        head.append("compiled / eager+triton")
    if "eager" in modes and len(modes) > 1:
        head.append(f"{modes[-1]} / eager")
    head.append(f"{modes[-1]} decode-step tok/s")
    lines = [
        f"Engine throughput, Ouro-1.4B config (random bf16 weights), {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}. Output tok/s over the whole run (prefill included); decode-step tok/s "
        "over the steps without prompt tokens only; * = partial run stopped by the time limit.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for s in scenarios:
        row = [s]
        for m in modes:
            r = by.get((s, m))
            row.append("-" if r is None else f"{r.tok_s:.1f}{'*' if r.note else ''}")
        if "eager+triton" in modes and "compiled" in modes:
            a, b = by.get((s, "compiled")), by.get((s, "eager+triton"))
            row.append(f"{a.tok_s / b.tok_s:.2f}x" if a and b and b.tok_s else "-")
        if "eager" in modes and len(modes) > 1:
            a, b = by.get((s, modes[-1])), by.get((s, "eager"))
            row.append(f"{a.tok_s / b.tok_s:.1f}x" if a and b and b.tok_s else "-")
        last = by.get((s, modes[-1]))
        row.append(f"{last.decode_tok_s:.1f}" if last and last.decode_tok_s else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
