"""Engine-level profile (``python -m rlt_compile.bench --engine-profile``): sync vs async scheduling.

Decode at several batch sizes on one ``LLMEngine``; reports ms/step (timed without the profiler),
the GPU-busy fraction (union of device activity over wall time, from the torch profiler) overall and
per step, and device kernels and host launch calls per token (docs/engine.md, "Profiling").
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rlt_compile.bench import BLOCK_SIZE, CONFIGS, MODELS, _fmt, build_random_model, tiny_bench_config

ENGINE_BATCHES = (1, 32, 128)
LAUNCH_APIS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
    "hipLaunchKernel",
    "hipExtModuleLaunchKernel",
    "hipGraphLaunch",
    "hipMemcpyAsync",
    "hipMemsetAsync",
)
STEP_LABEL = "rlt_engine_step"
PROFILE_LEAD_STEPS = 2  # steps run under the profiler before the labelled ones


@dataclass
class EngineProfile:
    batch: int
    engine: str  # "sync" | "async"
    ms_per_step: float  # decode steps, timed without the profiler
    tok_s: float
    busy: float | None = None  # device-busy time / wall time over the profiled steps (None on the CPU)
    busy_per_step_mean: float | None = None
    busy_per_step_min: float | None = None
    kernels_per_token: float | None = None  # device kernels (graph nodes included) per generated token
    launches_per_token: float | None = None  # host launch API calls (a graph replay is one) per token
    ops_per_token: float | None = None  # CPU: aten ops per token (the smoke mode's stand-in for launches)
    profiled_steps: int = 0
    idle_us_per_step: float | None = None  # device idle time inside the profiled range, per step
    gaps: list | None = None  # the largest idle gaps by neighbours: (before, after, count, us per step)


def _union_ms(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to [lo, hi] (profiler microseconds)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, end = 0.0, lo
    for a, b in clipped:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def idle_gaps(device: list[tuple[float, float, str]], lo: float, hi: float, min_us: float = 0.5, top: int = 8):
    """Idle time of the device inside ``[lo, hi]`` (profiler microseconds): the total, and the gaps of at
    least ``min_us`` grouped by the activities before and after them, largest total first, as
    ``(before, after, count, total us)``. Names are cut to 70 characters."""
    spans = sorted((max(a, lo), min(b, hi), n) for a, b, n in device if b > lo and a < hi)
    groups: dict[tuple[str, str], list] = {}
    idle, end, before = 0.0, lo, "(range start)"
    for a, b, name in spans:
        if a > end:
            idle += a - end
            if a - end >= min_us:
                entry = groups.setdefault((before[:70], name[:70]), [0, 0.0])
                entry[0] += 1
                entry[1] += a - end
        if b > end:
            end, before = b, name
    idle += max(0.0, hi - end)
    ranked = sorted(((k[0], k[1], c, t) for k, (c, t) in groups.items()), key=lambda g: -g[3])
    return idle, ranked[:top]


def analyze_engine_trace(events, tokens: int, device_type: str) -> dict:
    """Busy fractions per step window and launch counts from ``torch.profiler`` events.

    Step windows are the CPU ranges labelled ``STEP_LABEL``; device activity is every CUDA event
    (kernels, copies, sets) that is not a user annotation; busy = union of device intervals inside
    the window / window length, so overlapping streams are not counted twice.
    """
    cuda = torch.autograd.DeviceType.CUDA
    steps, device, launches, ops = [], [], [], []
    for evt in events:
        name = evt.name
        if evt.device_type == cuda:
            if name != STEP_LABEL:
                device.append((evt.time_range.start, evt.time_range.end, name))
            continue
        if name == STEP_LABEL:
            steps.append((evt.time_range.start, evt.time_range.end))
        elif name in LAUNCH_APIS:
            launches.append(evt.time_range.start)
        elif name.startswith("aten::"):
            ops.append(evt.time_range.start)
    steps.sort()
    if not steps:
        return {"profiled_steps": 0, "ops_per_token": len(ops) / max(tokens, 1)}
    lo, hi = steps[0][0], steps[-1][1]

    def in_windows(times: list[float]) -> int:  # host calls of the labelled steps only
        return sum(1 for t in times if lo <= t < hi)

    out: dict = {"profiled_steps": len(steps), "ops_per_token": in_windows(ops) / max(tokens, 1)}
    if device_type != "cuda":
        return out
    intervals = [(a, b) for a, b, _ in device]
    fractions = [_union_ms(intervals, a, b) / (b - a) for a, b in steps if b > a]
    kernels = sum(1 for a, b, n in device if lo <= a < hi and not n.lower().startswith(("memcpy", "memset")))
    idle, gaps = idle_gaps(device, lo, hi)
    n_steps = len(steps)
    out.update(
        idle_us_per_step=idle / n_steps,
        gaps=[(before, after, count, total / n_steps) for before, after, count, total in gaps],
        busy=_union_ms(intervals, lo, hi) / (hi - lo),
        busy_per_step_mean=sum(fractions) / len(fractions),
        busy_per_step_min=min(fractions),
        kernels_per_token=kernels / max(tokens, 1),
        launches_per_token=in_windows(launches) / max(tokens, 1),
    )
    return out


def _decode_run(engine, batch: int, prompt_len: int, warm: int, steps: int, profile: bool, seed: int):
    """Prefill ``batch`` random prompts, ``warm`` decode steps, then ``steps`` measured decode steps."""
    from rlt_compile.engine import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=warm + steps + 4, ignore_eos=True)
    ids = [
        engine.add_request(None, torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), params)
        for _ in range(batch)
    ]
    total_prefill = engine.stats.prefill_tokens + batch * prompt_len
    while engine.stats.prefill_tokens < total_prefill:
        engine.step()
    for _ in range(warm):
        engine.step()
    is_gpu = engine.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(engine.device)) if is_gpu else (lambda: None)
    sync()
    decoded = engine.stats.decode_tokens
    prof = None
    if profile:
        from torch.profiler import ProfilerActivity, record_function
        from torch.profiler import profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_gpu else [])
        with torch_profile(activities=activities) as prof:
            # Unlabelled steps first: the profiler's start-up and the pipeline refill after the sync
            # above (the device idles while the host prepares the first step: a cost of this
            # harness, 130-230 us per step averaged over 16 at batch 1) stay outside the windows.
            for _ in range(PROFILE_LEAD_STEPS):
                engine.step()
            decoded = engine.stats.decode_tokens
            for _ in range(steps):
                with record_function(STEP_LABEL):
                    engine.step()
            sync()
        elapsed = None
    else:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        elapsed = time.perf_counter() - start
    tokens = engine.stats.decode_tokens - decoded
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    if engine.async_scheduler is not None:
        engine.async_scheduler.drain()
    return tokens, elapsed, prof


def profile_engine(
    model,
    batches=ENGINE_BATCHES,
    steps: int = 16,
    warm: int = 3,
    prompt_len: int = 64,
    compile: bool = True,
    graphs: bool = True,
    log=None,
    passes: list[str] | None = None,
) -> list[EngineProfile]:
    """Sync vs async engine decode at each batch size on one engine (compiled and captured once):
    step time without the profiler, then GPU-busy fraction and launches per token with it."""
    from rlt_compile.engine import LLMEngine
    from rlt_compile.engine.async_runner import AsyncScheduler

    is_gpu = next(model.parameters()).device.type == "cuda"
    max_batch = max(batches)
    max_len = prompt_len + warm + steps + 8
    per_seq = -(-(max_len + 1) // BLOCK_SIZE)
    engine = LLMEngine(
        model,
        num_blocks=max_batch * per_seq + 8,
        block_size=BLOCK_SIZE,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(2048, prompt_len),
        max_model_len=max_len,
        enable_prefix_caching=False,
        compile=compile,
        use_cuda_graphs=graphs and compile and is_gpu,
        model_options={"init_scale": 0.0} if model.family == "huginn" else {},
        compile_options={"passes": passes} if passes is not None else {},
    )
    async_scheduler = AsyncScheduler(engine)
    results = []
    for batch in batches:
        for mode in ("sync", "async"):
            engine.async_scheduler = async_scheduler if mode == "async" else None
            _decode_run(engine, batch, prompt_len, warm, 2, False, seed=batch)  # Triton JIT, autotuning
            tokens, elapsed, _ = _decode_run(engine, batch, prompt_len, warm, steps, False, seed=batch)
            r = EngineProfile(batch, mode, elapsed / steps * 1e3, tokens / elapsed if elapsed else 0.0)
            tokens, _, prof = _decode_run(engine, batch, prompt_len, warm, steps, True, seed=batch)
            for key, value in analyze_engine_trace(prof.events(), tokens, "cuda" if is_gpu else "cpu").items():
                setattr(r, key, value)
            results.append(r)
            if log is not None:
                log.info(
                    "engine b%d %s: %.3f ms/step, busy %s, kernels/token %s",
                    batch,
                    mode,
                    r.ms_per_step,
                    r.busy,
                    r.kernels_per_token,
                )
    engine.async_scheduler = None
    return results


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def engine_markdown(results: list[EngineProfile], title: str) -> str:
    by = {(r.batch, r.engine): r for r in results}
    lines = [
        title,
        "",
        "| batch | engine | ms/step | tok/s | async speedup | GPU busy | busy/step mean (min) | kernels/token "
        "| host launches/token | aten ops/token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        sync = by.get((r.batch, "sync"))
        speedup = sync.ms_per_step / r.ms_per_step if (r.engine == "async" and sync and r.ms_per_step) else None
        lines.append(
            f"| {r.batch} | {r.engine} | {r.ms_per_step:.3f} | {r.tok_s:.1f} | {_fmt(speedup, '.2f')}"
            f"{'x' if speedup else ''} | {_pct(r.busy)} | {_pct(r.busy_per_step_mean)} "
            f"({_pct(r.busy_per_step_min)}) | {_fmt(r.kernels_per_token)} | {_fmt(r.launches_per_token, '.2f')} "
            f"| {_fmt(r.ops_per_token)} |"
        )
    lines += [
        "",
        "ms/step: decode steps timed without the profiler. GPU busy: union of device activity (kernels, "
        "copies) over the profiled steps' wall time; per step: the same inside each step's window (with "
        "async scheduling a step's kernels run during the next step's window). Kernels/token counts graph "
        "nodes; host launches/token counts launch/copy API calls (a graph replay is one).",
        "",
    ]
    for r in results:
        if not r.gaps:
            continue
        lines += [
            f"Device idle, batch {r.batch} {r.engine}: {r.idle_us_per_step:.1f} us per step; the largest gaps "
            "(>= 0.5 us) by the activities around them:",
            "",
            "| before the gap | after the gap | gaps | us per step |",
            "|---|---|---|---|",
        ]
        lines += [f"| `{b}` | `{a}` | {c} | {t:.1f} |" for b, a, c, t in r.gaps]
        lines.append("")
    return "\n".join(lines)


def engine_profile_main(args, device: torch.device) -> int:
    log = logging.getLogger("rlt_compile.bench")
    names = [m.strip() for m in args.model.split(",")] if args.model != "all" else list(MODELS)
    batches = [int(b) for b in args.batches.split(",")]
    dtype = getattr(torch, args.dtype)
    is_gpu = device.type == "cuda"
    mode = args.engine_mode or ("graphs" if is_gpu else "eager")
    device_name = torch.cuda.get_device_name(device) if is_gpu else "cpu"
    tables, raw_results = [], []
    for name in names:
        raw = tiny_bench_config(name) if args.tiny else CONFIGS[name]
        model = build_random_model(raw, dtype, device)
        t0 = time.perf_counter()
        results = profile_engine(
            model,
            batches,
            steps=args.engine_steps,
            prompt_len=args.context if not args.tiny else min(args.context, 32),
            compile=mode in ("compiled", "graphs"),
            graphs=mode == "graphs",
            log=log,
            passes=args.passes.split(",") if args.passes else None,
        )
        title = (
            f"Engine decode profile, {name}{' (tiny config)' if args.tiny else ''}, random {args.dtype} weights, "
            f"{device_name}, torch {torch.__version__}; {mode}; passes: {args.passes or 'default'}; {args.engine_steps} decode steps per run, "
            f"prompt {args.context if not args.tiny else min(args.context, 32)} tokens; "
            f"{time.perf_counter() - t0:.0f} s."
        )
        tables.append(engine_markdown(results, title))
        raw_results += [{"model": name, **asdict(r)} for r in results]
        del model
        if is_gpu:
            torch.cuda.empty_cache()
    text = "\n".join(tables)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(raw_results, indent=2))
    return 0
