"""Serving benchmark: TTFT, inter-token latency and output tok/s of the HTTP server under load.

The script starts the server itself, in a child process (so the load generator does not share a
GIL with the engine): Ouro-1.4B's real config with random bf16 weights on CUDA, built on the meta
device and materialized on the GPU, no tokenizer (prompts are token ids). A bounded async load
generator (httpx) then runs each concurrency level (default 1, 16, 64): ``c`` workers send
streaming ``/v1/completions`` requests (random token-id prompts, greedy, ``ignore_eos``, fixed
output length) back to back until the level's request count is done or its time limit is hit.

Per request: TTFT = first streamed token - send time; ITL = gaps between streamed tokens (a chunk
carrying k tokens counts as k gaps of equal size). Output tok/s = tokens received / wall time of
the level. ``--out FILE`` writes a markdown table.

    python benchmarks/serve_bench.py --out serve.md [--concurrency 1,16,64] [--attention triton] [--compile]
    python benchmarks/serve_bench.py --tiny --out /tmp/serve.md      # CPU smoke run on a tiny model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlt_compile.generate import parse_buckets  # noqa: E402

MODEL_NAME = "ouro-1.4b-random"


def ouro_1_4b() -> dict:
    from rlt_compile.bench import CONFIGS

    return CONFIGS["ouro-1.4b"]


# -- the server (child process) -----------------------------------------------------------------
def random_model(raw_config: dict, device: str, dtype_name: str, seed: int = 0):
    """Random weights on ``device`` (rlt_compile.bench.build_random_model)."""
    import torch

    from rlt_compile.bench import build_random_model

    return build_random_model(raw_config, getattr(torch, dtype_name), torch.device(device), seed)


def use_triton_attention() -> None:
    """Route eager ``rlt::attention`` on CUDA to the Triton paged kernel (the default is the torch
    reference, which loops over sequences on the host)."""
    import torch

    import rlt_compile.kernels.triton_attention  # noqa: F401  (registers rlt::attention_triton)

    def impl(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale):
        return torch.ops.rlt.attention_triton(
            q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale
        )

    torch.library.register_kernel("rlt::attention", "cuda", impl)


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from rlt_compile.engine import LLM
    from rlt_compile.server import build_app

    if args.tiny:
        from rlt_compile.tiny import tiny_config

        raw, device, dtype = tiny_config("ouro"), "cpu", "float32"
    else:
        raw, device, dtype = ouro_1_4b(), "cuda", "bfloat16"
        if args.attention == "triton":
            use_triton_attention()
    model = random_model(raw, device, dtype)
    max_len = args.prompt_len + args.output_len + 16
    llm = LLM(
        model,
        max_num_seqs=max(args.concurrency),
        max_model_len=max_len,
        enable_prefix_caching=False,  # random prompts share nothing
        compile=args.compile,
        use_cuda_graphs=args.compile and not args.tiny,
        cuda_graph_prefill_tokens=args.prefill_graphs if args.compile else None,
    )
    if args.baseline_file:
        Path(args.baseline_file).write_text(json.dumps(engine_baseline(llm.engine, args)))
    app = build_app(llm, served_model_name=MODEL_NAME, drain_timeout=5.0)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", timeout_graceful_shutdown=5)


def engine_baseline(engine, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The engine alone (no HTTP): per concurrency c, c requests at once; output tok/s and the
    median decode step time. What the server adds on top is the difference."""
    from rlt_compile.engine import SamplingParams

    vocab = engine.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    out = {}
    for c in [1, *args.concurrency]:  # the first pass warms up
        rng = random.Random(c)
        for _ in range(c):
            engine.add_request(None, [rng.randrange(10, vocab) for _ in range(args.prompt_len)], params)
        steps, tokens, start = [], 0, time.perf_counter()
        while engine.has_unfinished():
            t = time.perf_counter()
            tokens += sum(len(o.token_ids) for r in engine.step() for o in r.outputs)
            steps.append(time.perf_counter() - t)
        seconds = time.perf_counter() - start
        out[str(c)] = {"tok_s": tokens / seconds, "step_p50": percentile(steps, 50)}
        print(
            f"engine only, c={c}: {tokens / seconds:.1f} tok/s, step p50 {1e3 * percentile(steps, 50):.2f} ms",
            file=sys.stderr,
        )
    return out


# -- the load generator -------------------------------------------------------------------------
@dataclass
class RequestResult:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    latency: float = 0.0
    error: str | None = None


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    seconds: float
    tokens: int
    ttft: list[float]
    itl: list[float]
    latency: list[float]
    errors: int
    partial: bool


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ranked = sorted(values)
    rank = max(1, -(-len(ranked) * q // 100))
    return ranked[min(int(rank), len(ranked)) - 1]


async def one_request(client, url: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    continue
                count = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
                if not count:
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                    result.gaps += [0.0] * (count - 1)
                else:
                    result.gaps += [(now - last) / count] * count
                last = now
                result.tokens += count
    except Exception as e:  # a failed request is counted, not fatal
        result.error = repr(e)
    result.latency = time.perf_counter() - start
    return result


async def run_level(
    base_url: str, concurrency: int, num_requests: int, prompt_len: int, output_len: int, time_limit: float, vocab: int
) -> LevelResult:
    import httpx

    rng = random.Random(concurrency)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(num_requests)]
    todo: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        todo.put_nowait(p)
    results: list[RequestResult] = []
    start = time.perf_counter()
    deadline = start + time_limit
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(300.0)) as client:

        async def worker() -> None:
            while time.perf_counter() < deadline:
                try:
                    prompt = todo.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await one_request(client, "/v1/completions", prompt, output_len))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    for r in results:
        if r.error is not None:
            print(f"  request failed: {r.error}", file=sys.stderr)
    return LevelResult(
        concurrency=concurrency,
        requests=len(results),
        seconds=seconds,
        tokens=sum(r.tokens for r in results),
        ttft=[r.ttft for r in ok if r.ttft is not None],
        itl=[g for r in ok for g in r.gaps],
        latency=[r.latency for r in ok],
        errors=len(results) - len(ok),
        partial=len(results) < num_requests,
    )


def markdown(results: list[LevelResult], baseline: dict | None, header: str) -> str:
    extra_head = " engine-only tok/s | engine-only step p50 (ms) |" if baseline else ""
    lines = [
        "## Serving benchmark (`benchmarks/serve_bench.py`)",
        "",
        header,
        "",
        "| concurrency | requests | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) "
        "| E2E p50 (s) | errors |" + extra_head,
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if baseline else ""),
    ]
    for r in results:
        note = " (time limit)" if r.partial else ""
        row = (
            f"| {r.concurrency} | {r.requests}{note} | {r.tokens / r.seconds:.1f} "
            f"| {1e3 * percentile(r.ttft, 50):.1f} | {1e3 * percentile(r.ttft, 99):.1f} "
            f"| {1e3 * percentile(r.itl, 50):.2f} | {1e3 * percentile(r.itl, 99):.2f} "
            f"| {percentile(r.latency, 50):.2f} | {r.errors} |"
        )
        if baseline:
            b = baseline.get(str(r.concurrency))
            row += f" {b['tok_s']:.1f} | {1e3 * b['step_p50']:.2f} |" if b else " - | - |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, child: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise SystemExit(f"server exited with code {child.returncode} before becoming ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server not ready after {timeout:.0f}s")


def describe_device(tiny: bool) -> str:
    if tiny:
        return "CPU (tiny Ouro, smoke run)"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip().splitlines()[0]
    except Exception:
        return "unknown GPU"


def bench(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, __file__, "--serve-child", "--port", str(port)] + args.child_argv
    baseline_file = None
    if args.engine_baseline:
        baseline_file = Path(tempfile.mkdtemp()) / "baseline.json"
        cmd += ["--baseline-file", str(baseline_file)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen(cmd, env=env)
    try:
        wait_ready(url, child, args.startup_timeout)
        print(f"server ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        vocab = 256 if args.tiny else ouro_1_4b()["vocab_size"]
        # warm-up: kernel compilation for prefill and decode shapes
        warm = max(args.concurrency)
        asyncio.run(run_level(url, min(warm, 16), min(warm, 16), args.prompt_len, 8, 120.0, vocab))
        results = []
        for c in args.concurrency:
            n = max(args.min_requests, c * args.waves)
            r = asyncio.run(run_level(url, c, n, args.prompt_len, args.output_len, args.time_limit, vocab))
            print(
                f"c={c}: {r.requests} requests, {r.tokens / r.seconds:.1f} tok/s, "
                f"TTFT p50 {1e3 * percentile(r.ttft, 50):.1f} ms, ITL p50 {1e3 * percentile(r.itl, 50):.2f} ms",
                file=sys.stderr,
            )
            results.append(r)
    finally:
        child.send_signal(signal.SIGINT)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    mode = (
        (
            "compiled + CUDA graphs" + prefill_graphs_label(args.prefill_graphs)
            if args.compile
            else f"eager, {args.attention} attention"
        )
        if not args.tiny
        else "eager"
    )
    header = (
        f"{'Tiny Ouro' if args.tiny else 'Ouro-1.4B (real config, random bf16 weights)'} on {describe_device(args.tiny)}, "
        f"{mode}; prompts of {args.prompt_len} random token ids, {args.output_len} output tokens (greedy, "
        f"ignore_eos), streaming `/v1/completions`; server and load generator in separate processes on one host. "
        f"TTFT includes queueing; ITL = gap between streamed tokens. Total run {time.perf_counter() - t0:.0f}s."
    )
    baseline = json.loads(baseline_file.read_text()) if baseline_file and baseline_file.exists() else None
    if baseline:
        header += " Engine-only columns: the same load through `LLMEngine.step` in the server process, no HTTP."
    table = markdown(results, baseline, header)
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 0 if all(r.errors == 0 for r in results) else 1


def prefill_graphs_label(buckets: list[int] | None) -> str:
    if buckets is None:
        return " + the engine's default prefill graphs"
    return f" + prefill graphs {buckets}" if buckets else " without prefill graphs"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrency levels")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--waves", type=int, default=2, help="requests per level = max(min_requests, c * waves)")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--time-limit", type=float, default=40.0, help="seconds per level before it stops sending")
    p.add_argument("--startup-timeout", type=float, default=150.0)
    p.add_argument("--attention", choices=("triton", "torch"), default="triton", help="eager attention on CUDA")
    p.add_argument("--compile", action="store_true", help="serve with compile=True and CUDA graphs")
    p.add_argument("--prefill-graphs", type=parse_buckets, default=None, metavar="N,N,...|off",
                   help="with --compile: prefill / mixed-step graphs for these token buckets (default: the "
                        "engine's; off: none)")  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="tiny Ouro on the CPU (a smoke run of this script)")
    p.add_argument("--engine-baseline", action="store_true", help="also time the engine alone (no HTTP) before serving")
    p.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--baseline-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    if args.serve_child:
        serve(args)
        return 0
    args.child_argv = [
        "--concurrency",
        ",".join(map(str, args.concurrency)),
        "--prompt-len",
        str(args.prompt_len),
        "--output-len",
        str(args.output_len),
        "--attention",
        args.attention,
    ]
    args.child_argv += ["--compile"] if args.compile else []
    if args.prefill_graphs is not None:
        args.child_argv += ["--prefill-graphs", ",".join(map(str, args.prefill_graphs)) or "off"]
    args.child_argv += ["--tiny"] if args.tiny else []
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
