"""``python -m rlt_compile.bench``: batch-1 decode of the real model shapes, eager vs compiled vs
compiled + CUDA graphs.

    python -m rlt_compile.bench --model all --out docs/bench_decode.md
    python -m rlt_compile.bench --model ouro-1.4b [--batch 1] [--steps 64] [--out FILE]

Models (real configs, random bf16 weights built on the meta device and materialised on the GPU):
ouro-1.4b, ouro-2.6b, nanbeige4.2-3b, huginn-0125 (32 recurrences). For each: one sequence of
``--context`` (128) random tokens is prefilled eagerly, then decode steps run

* eager: the plain model (the torch reference attention op), ``--eager-steps`` tokens;
* compiled: ``compile_model(model, "cuda")`` (Triton paged attention, Inductor), ``--compiled-steps``;
* graphs: the compiled step captured by ``CudaGraphRunner`` for the batch's bucket, ``--steps``.

Each decode step's inputs and metadata are prepared on the device before timing, and the next token
is the argmax of the last logits (kept on the device), so the timings are the step itself. Reported:
tok/s, ms/token, % of the bandwidth floor (bytes read per token - loop weights once per loop step,
the rest once - over the copy bandwidth measured in the same run), % of design.md's yardstick,
speedup over eager, compile time (first compiled call) and graph-capture time.

``--variant RLT_GEMV_CONFIG=...`` (or ``RLT_ATTENTION_CONFIG``, repeatable) also times the graphs
under other launcher configs in the same process, interleaved with the baseline for ``--rounds``
rounds (``bench_variants.py``).

``--device cpu --tiny`` runs the same code on tiny configs without graphs (a smoke test). ``--table N``
sizes the block table for N positions, as an engine's is for its max model length (the default
describes just the context and the decoded tokens); the GQA decode attention's split count follows
it (MHA's does not: its empty splits cost nothing).

``--engine-profile`` profiles the serving engine instead (``LLMEngine``, compiled + CUDA graphs on
the GPU): decode at ``--batches`` (1, 32, 128) with synchronous and asynchronous scheduling on one
engine, reporting ms/step (timed without the profiler), the GPU-busy fraction over the profiled
steps and per step (torch profiler: union of device activity / wall time), device kernels and host
launch calls per token (docs/engine.md, "Profiling"):

    python -m rlt_compile.bench --engine-profile --model ouro-1.4b --out engine_profile.md
    python -m rlt_compile.bench --engine-profile --device cpu --tiny --batches 1,4   # smoke test
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rlt_compile.bench_variants import parse_variant, run_variants, variants_table
from rlt_compile.kernels.metadata import build_metadata

BLOCK_SIZE = 16

CONFIGS: dict[str, dict] = {
    "ouro-1.4b": {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "vocab_size": 49152,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 65536,
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "tie_word_embeddings": False,
    },
    "nanbeige4.2-3b": {
        "architectures": ["NanbeigeForCausalLM"],
        "model_type": "nanbeige",
        "hidden_size": 3072,
        "intermediate_size": 10752,
        "num_hidden_layers": 22,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_loops": 2,
        "vocab_size": 166144,
        "rope_theta": 70_000_000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
    },
    "huginn-0125": {
        "architectures": ["RavenForCausalLM"],
        "model_type": "huginn_raven",
        "n_embd": 5280,
        "n_heads": 55,
        "num_key_value_heads": 55,
        "intermediate_size": 17920,
        "vocab_size": 65536,
        "padded_vocab_size": 65536,
        "n_layers_in_prelude": 2,
        "n_layers_in_recurrent_block": 4,
        "n_layers_in_coda": 2,
        "mean_recurrence": 32,
        "qk_bias": True,
        "tie_embeddings": True,
        "norm_eps": 1e-6,
        "rope_base": 50000.0,
        "block_size": 4096,
        "init_values": {"embed_scale": math.sqrt(5280), "std": math.sqrt(2 / (5 * 5280))},
    },
}
CONFIGS["ouro-2.6b"] = {**CONFIGS["ouro-1.4b"], "num_hidden_layers": 48}
MODELS = ("ouro-1.4b", "ouro-2.6b", "nanbeige4.2-3b", "huginn-0125")

# design.md: batch-1 decode floor on H200 (weights re-read every loop, 4.8 TB/s)
YARDSTICK_TOK_S = {"ouro-1.4b": 477.0, "ouro-2.6b": 241.0, "nanbeige4.2-3b": 353.0, "huginn-0125": 44.0}

# parameters the loop body reads once per loop step (the rest is read once per token)
LOOP_PREFIXES = {
    "ouro": ("model.layers.", "model.norm."),
    "nanbeige": ("model.layers.", "model.norm."),
    "huginn": ("transformer.core_block.", "transformer.adapter."),
}
EMBEDDINGS = ("model.embed_tokens.weight", "transformer.wte.weight")


def tiny_bench_config(name: str) -> dict:
    from rlt_compile.tiny import tiny_config

    family = {"ouro-1.4b": "ouro", "ouro-2.6b": "ouro", "nanbeige4.2-3b": "nanbeige", "huginn-0125": "huginn"}[name]
    raw = tiny_config(family)
    raw.pop("torch_dtype", None)
    return raw


def build_random_model(raw: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """The model of ``raw`` with random weights, built on the meta device and materialised on ``device``."""
    from rlt_compile.models.registry import build_model

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = build_model(raw)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    model.tie_weights()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "norm_" in name or "layernorm" in name or name.endswith("ln_f.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.materialize_buffers(device)
    return model.eval().requires_grad_(False)


def bytes_per_token(model, steps: int) -> tuple[int, int]:
    """(bytes of weights read per decode token, total parameter bytes)."""
    loop = LOOP_PREFIXES[model.family]
    per_token, total = 0, 0
    tied = model.ties_embeddings
    for name, p in model.named_parameters():  # tied weights appear once
        size = p.numel() * p.element_size()
        total += size
        if name in EMBEDDINGS and not tied:
            continue  # one row per token
        per_token += size * (steps if name.startswith(loop) else 1)
    return per_token, total


def wall_ms(fn, n: int) -> float:
    """Milliseconds per call of ``fn`` over ``n`` calls after one warm-up, device synchronised."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    n = 10
    start = time.perf_counter()
    for _ in range(n):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    elapsed = (time.perf_counter() - start) / n
    del src, dst
    return 2 * nbytes / elapsed


@dataclass
class Result:
    model: str
    params_b: float
    steps: int
    gb_per_token: float
    floor_ms: float | None = None
    eager_ms: float | None = None
    compiled_ms: float | None = None
    graphs_ms: float | None = None
    compile_s: float | None = None
    first_call_s: float | None = None
    capture_s: float | None = None
    notes: list[str] = field(default_factory=list)
    variants: str | None = None  # --variant's table (bench_variants.py)


class Decoder:
    """One sequence: a prefilled context, then decode steps with inputs prepared ahead."""

    def __init__(self, model, context: int, max_new: int, device, options: dict, seed: int = 0, table: int = 0):
        self.model, self.device, self.options = model, device, options
        self.length = 0
        blocks = -(-max(context + max_new + 1, table) // BLOCK_SIZE)
        self.table = [list(range(blocks))]
        self.blocks = blocks
        self.planes = model.allocate_kv_cache(blocks, BLOCK_SIZE, max_steps=options.get("num_steps"))
        gen = torch.Generator().manual_seed(seed)
        self.prompt = torch.randint(0, model.vocab_size, (context,), generator=gen)
        self.rows = torch.zeros(1, dtype=torch.long, device=device)

    def prefill(self, fn) -> torch.Tensor:
        n = self.prompt.shape[0]
        meta = build_metadata([n], [0], self.table, BLOCK_SIZE, device=self.device)
        last = torch.tensor([n - 1], device=self.device)
        with torch.no_grad():
            logits = fn(
                self.prompt.to(self.device),
                torch.arange(n, device=self.device),
                self.planes,
                meta,
                last,
                **self.options,
            )
        self.length = n
        return logits.argmax(-1)

    def inputs(self, count: int):
        """Positions and metadata of the next ``count`` decode steps, on the device."""
        out = []
        for i in range(count):
            pos = self.length + i
            meta = build_metadata([1], [pos], self.table, BLOCK_SIZE, device=self.device)
            out.append((torch.tensor([pos], device=self.device), meta))
        return out

    def decode(self, step, token: torch.Tensor, count: int, sync) -> tuple[torch.Tensor, float]:
        """Run ``count`` decode steps with ``step(ids, positions, meta)``; returns (last token, s/token)."""
        prepared = self.inputs(count)
        sync()
        start = time.perf_counter()
        for pos, meta in prepared:
            token = step(token, pos, meta).argmax(-1)
        sync()
        elapsed = time.perf_counter() - start
        self.length += count
        return token, elapsed / max(count, 1)

    def measure_from(self, step, token: torch.Tensor, start: int, count: int, sync) -> tuple[float, torch.Tensor]:
        """The logits of one step from ``token`` at position ``start``, then s/token of ``count`` steps
        from that position again (after 3 warm-up steps): the same positions whatever ran before."""
        self.length = start
        ((pos, meta),) = self.inputs(1)
        logits = step(token, pos, meta).clone()  # a graph runner's output buffer is overwritten next step
        self.decode(step, token, 3, sync)
        self.length = start
        _, per = self.decode(step, token, count, sync)
        return per, logits


def bench_model(name: str, args, device: torch.device, bandwidth: float | None) -> Result:
    from rlt_compile.compiler import compile_model
    from rlt_compile.graphs import CudaGraphRunner

    log = logging.getLogger("rlt_compile.bench")
    raw = tiny_bench_config(name) if args.tiny else CONFIGS[name]
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model = build_random_model(raw, dtype, device)
    steps = model.default_steps
    per_token, total = bytes_per_token(model, steps)
    result = Result(name, total / dtype.itemsize / 1e9, steps, per_token / 1e9)
    if bandwidth:
        result.floor_ms = per_token / bandwidth * 1e3
    log.info(
        "%s: built in %.1f s, %.2f B params, %d loop steps", name, time.perf_counter() - t0, result.params_b, steps
    )
    options = {"init_scale": 0.0} if model.family == "huginn" else {}
    options["num_steps"] = steps
    is_gpu = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if is_gpu else (lambda: None)
    max_new = args.eager_steps + args.compiled_steps + args.steps + 8
    dec = Decoder(model, args.context, max_new, device, options, table=args.table)
    if args.batch != 1:
        result.notes.append("only batch 1 is implemented; --batch ignored")

    def plain(fn):
        return lambda ids, pos, meta: fn(ids, pos, dec.planes, meta, dec.rows, **options)

    def graphs(cm):
        """The compiled step captured as CUDA graphs (under the launcher variables now set): the
        runner and a step replaying it."""
        runner = CudaGraphRunner(
            cm.run_compiled, dec.planes, max_num_seqs=1, max_blocks_per_seq=dec.blocks, step_options=options
        ).capture()
        return runner, lambda ids, pos, meta: runner(ids, pos, meta, dec.rows)

    with torch.no_grad():
        token = dec.prefill(model)
        start, first_token = dec.length, token
        if args.eager_steps:
            token, _ = dec.decode(plain(model), token, 1, sync)  # warm-up
            token, per = dec.decode(plain(model), token, args.eager_steps, sync)
            result.eager_ms = per * 1e3
            log.info("%s: eager %.2f ms/token", name, result.eager_ms)
        patches = json.loads(args.inductor_config) if args.inductor_config else None
        passes = args.passes.split(",") if args.passes else None
        cm = compile_model(
            model, platform="cuda" if is_gpu else "cpu", mode=args.mode, inductor_config=patches, passes=passes
        )
        t1 = time.perf_counter()
        token, _ = dec.decode(plain(cm), token, 1, sync)  # compiles every unit
        result.first_call_s = time.perf_counter() - t1
        result.compile_s = cm.compile_seconds()
        log.info("%s: compiled in %.1f s (first call %.1f s)", name, result.compile_s, result.first_call_s)
        if args.code_dir:
            write_inductor_code(cm, Path(args.code_dir), name)
        if args.compiled_steps:
            token, _ = dec.decode(plain(cm), token, 2, sync)
            token, per = dec.decode(plain(cm), token, args.compiled_steps, sync)
            result.compiled_ms = per * 1e3
            log.info("%s: compiled %.2f ms/token", name, result.compiled_ms)
        if is_gpu and args.steps:
            runner, replay = graphs(cm)
            result.capture_s = runner.capture_seconds
            token, _ = dec.decode(replay, token, 3, sync)
            token, per = dec.decode(replay, token, args.steps, sync)
            result.graphs_ms = per * 1e3
            log.info("%s: graphs %.3f ms/token (capture %.2f s)", name, result.graphs_ms, result.capture_s)
            if runner.fallbacks:
                result.notes.append(f"{runner.fallbacks} graph fallbacks")
            if args.profile:
                try:
                    result.notes.append(
                        profile_kernels(lambda: dec.decode(replay, token, 4, sync), 4, args.profile_top)
                    )
                except Exception as e:  # a profiler problem must not lose the timings
                    result.notes.append(f"profile failed: {type(e).__name__}: {e}")
        if args.variant:

            def measure():  # graphs captured afresh under the variant's variable (the compiled step off the GPU)
                step = graphs(cm)[1] if is_gpu else plain(cm)
                per, logits = dec.measure_from(step, first_token, start, args.steps, sync)
                return per * 1e3, logits

            result.variants = variants_table(*run_variants(measure, args.variant, args.rounds))
            log.info("%s: %s", name, result.variants)
    return result


def write_inductor_code(cm, out: Path, name: str) -> None:
    """Inductor's generated code of every compiled unit, one file per model and unit."""
    out.mkdir(parents=True, exist_ok=True)
    for unit_name, unit in cm.units.items():
        code = "\n\n".join("\n".join(r.output_code) for r in unit.backend.records)
        (out / f"{name}.{unit_name}.py").write_text(code)


KERNEL_CLASSES = (
    ("attention", ("paged_attention", "kv_write", "split_reduce")),
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90", "xmma", "splitkreduce", "cublas")),
    ("inductor", ("triton_",)),
)


def profile_kernels(run, tokens: int, path_top: int = 12, top_n: int = 16) -> str:
    """GPU kernel time per token by class (attention / GEMM / Inductor-fused / other) over ``run()``,
    the ``top_n`` kernels by time and the ``path_top`` largest shares of the critical path."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    totals: dict[str, list[float]] = {}
    by_name: dict[str, list[float]] = {}
    events = prof.events()
    for evt in events:
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.name.lower()
        cls = next((c for c, keys in KERNEL_CLASSES if any(k in name for k in keys)), "other")
        if "memcpy" in name or "memset" in name:
            cls = "copy"
        t = totals.setdefault(cls, [0.0, 0])
        us = evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
        t[0] += us
        t[1] += 1
        k = by_name.setdefault(evt.name[:60], [0.0, 0])
        k[0] += us
        k[1] += 1
    critical = critical_path(events, tokens, path_top)
    busy = sum(v[0] for v in totals.values()) / tokens / 1e3
    parts = ", ".join(
        f"{c} {v[0] / tokens / 1e3:.2f} ms ({v[1] // tokens} kernels)"
        for c, v in sorted(totals.items(), key=lambda kv: -kv[1][0])
    )
    top = "; ".join(
        f"{name} x{v[1] // tokens} {v[0] / max(v[1], 1):.1f} us"
        for name, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top_n]
    )
    return (
        f"profile per token (graphs): GPU busy {busy:.2f} ms: {parts}. Top kernels (count per token, mean): {top}. "
        f"Critical path per token (end-to-end gaps): {critical}"
    )


def _short_kernel_name(name: str) -> str:
    return name.strip("_").removesuffix("_kernel").removeprefix("triton_poi_fused_")[:24]


def critical_path(events, tokens: int, top_n: int = 12) -> str:
    """Each kernel's share of the run's time: the gap from the previous kernel's end to its own end.
    Kernels of one stream finish in order, so the shares add up to the run's span; under PDL a
    kernel's own duration also counts the time it spent launched early and waiting, which its share
    does not. A kernel is keyed by its neighbours (``prev > name > next``), so the GEMVs of a layer
    (same kernel, different weights) are told apart by where they sit."""
    kernels = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.end
    )
    shares: dict[str, list[float]] = {}
    names = [_short_kernel_name(e.name) for e in kernels]
    for i in range(1, len(kernels)):
        key = f"{names[i - 1]} > {names[i]} > {names[i + 1] if i + 1 < len(names) else '-'}"
        share = shares.setdefault(key, [0.0, 0])
        share[0] += kernels[i].time_range.end - kernels[i - 1].time_range.end
        share[1] += 1
    span = sum(v[0] for v in shares.values())
    return f"{span / tokens / 1e3:.2f} ms: " + "; ".join(
        f"{key} x{v[1] / tokens:g} {v[0] / max(v[1], 1):.1f} us ({v[0] / span:.0%})"
        for key, v in sorted(shares.items(), key=lambda kv: -kv[1][0])[:top_n]
    )


def _fmt(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def markdown(results: list[Result], bandwidth: float | None, device_name: str, args) -> str:
    bw = f"{bandwidth / 1e12:.2f} TB/s" if bandwidth else "n/a"
    lines = [
        f"Batch-1 decode, {args.dtype}, context {args.context} tokens, on {device_name}; copy bandwidth {bw}.",
        f"passes: {args.passes or 'default'}; mode: {args.mode or 'default'}. "
        f"torch {torch.__version__}; eager {args.eager_steps}, compiled {args.compiled_steps}, "
        f"graphs {args.steps} timed tokens.",
        "",
        "| model | params (B) | loop steps | GB read/token | floor ms (measured bw) | eager tok/s | compiled tok/s "
        "| compiled+graphs tok/s | ms/token (graphs) | % of floor | % of design yardstick | speedup vs eager "
        "(compiled / graphs) | compile s | capture s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:

        def tok_s(ms):
            return None if ms is None else 1e3 / ms

        graphs_tok = tok_s(r.graphs_ms)
        floor_pct = None if (r.floor_ms is None or r.graphs_ms is None) else 100 * r.floor_ms / r.graphs_ms
        yard = YARDSTICK_TOK_S.get(r.model)
        yard_pct = None if (yard is None or graphs_tok is None or args.tiny) else 100 * graphs_tok / yard
        sp_c = None if (r.eager_ms is None or r.compiled_ms is None) else r.eager_ms / r.compiled_ms
        sp_g = None if (r.eager_ms is None or r.graphs_ms is None) else r.eager_ms / r.graphs_ms
        lines.append(
            f"| {r.model} | {r.params_b:.2f} | {r.steps} | {r.gb_per_token:.2f} | {_fmt(r.floor_ms, '.2f')} "
            f"| {_fmt(tok_s(r.eager_ms))} | {_fmt(tok_s(r.compiled_ms))} | {_fmt(graphs_tok)} "
            f"| {_fmt(r.graphs_ms, '.3f')} | {_fmt(floor_pct)}% | {_fmt(yard_pct)}% "
            f"| {_fmt(sp_c)}x / {_fmt(sp_g)}x | {_fmt(r.compile_s)} | {_fmt(r.capture_s, '.2f')} |"
        )
    notes = [f"- {r.model}: {n}" for r in results for n in r.notes]
    lines += ["", *notes] if notes else []
    lines += [line for r in results if r.variants for line in ("", f"{r.model}. {r.variants}")]
    lines += [
        "",
        "Floor: weights read per token (loop weights once per loop step, the rest once) / measured copy "
        "bandwidth. Yardsticks (design.md, 4.8 TB/s): Ouro-1.4B 477, Ouro-2.6B 241, Nanbeige4.2-3B 353, "
        "Huginn-0125 (r=32) 44 tok/s. Compile s: passes + Inductor for all compile units (first call).",
        "",
    ]
    return "\n".join(lines)


def _variant_argument(spec: str):
    try:
        return parse_variant(spec)
    except ValueError as e:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(e)) from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlt_compile.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ouro-1.4b", help=f"one of {', '.join(MODELS)}, a comma list, or all")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64, help="decode tokens timed with CUDA graphs")
    parser.add_argument("--compiled-steps", type=int, default=16, help="decode tokens timed compiled, no graphs")
    parser.add_argument("--eager-steps", type=int, default=4, help="decode tokens timed eager")
    parser.add_argument("--context", type=int, default=128, help="prefilled context length")
    parser.add_argument(
        "--table",
        type=int,
        default=0,
        help="positions the block table describes (default: the context and the decoded tokens; an engine's "
        "tables describe its max model length, which sets the GQA decode attention's split count)",
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--mode", default=None, help="Inductor mode (default | max-autotune-no-cudagraphs)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (smoke test, e.g. with --device cpu)")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    parser.add_argument("--json", default=None, help="write raw results as JSON here")
    parser.add_argument("--passes", default=None, help="comma list of passes (default: compile_model's default)")
    parser.add_argument("--code-dir", default=None, help="write Inductor's generated code per unit here")
    parser.add_argument("--profile", action="store_true", help="add a per-token GPU kernel-time breakdown (graphs)")
    parser.add_argument(
        "--profile-top", type=int, default=12, help="--profile: how many critical-path shares to list (largest first)"
    )
    parser.add_argument(
        "--inductor-config", default=None, help="Inductor config patches as JSON, e.g. '{\"freezing\": true}'"
    )
    parser.add_argument(
        "--engine-profile",
        action="store_true",
        help="engine-level profile instead: sync vs async scheduling, GPU-busy fraction per step, launches per token",
    )
    parser.add_argument(
        "--variant",
        action="append",
        type=_variant_argument,
        default=[],
        metavar="NAME=VALUE",
        help="also time the graphs with RLT_ATTENTION_CONFIG or RLT_GEMV_CONFIG set to VALUE, in this process, "
        "interleaved with the baseline (repeatable; docs/benchmarks.md, 'A/B in one process')",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--variant: rounds over the baseline and variants")
    parser.add_argument("--batches", default="1,32,128", help="--engine-profile batch sizes")
    parser.add_argument("--engine-steps", type=int, default=16, help="--engine-profile: decode steps per run")
    parser.add_argument(
        "--engine-mode",
        default=None,
        choices=("eager", "compiled", "graphs"),
        help="default: graphs (GPU), eager (CPU)",
    )
    args = parser.parse_args(argv)
    if args.variant and (args.steps < 1 or args.rounds < 1):
        parser.error("--variant needs --steps and --rounds of at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("rlt_compile.passes").setLevel(logging.WARNING)
    names = list(MODELS) if args.model == "all" else [m.strip() for m in args.model.split(",")]
    unknown = [m for m in names if m not in CONFIGS]
    if unknown:
        print(f"error: unknown model(s) {unknown}; choose from {', '.join(MODELS)} or all", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "error: --device cuda but no GPU is available (use --device cpu --tiny for a smoke test)", file=sys.stderr
        )
        return 2
    if args.engine_profile:
        from rlt_compile.engine_profile import engine_profile_main

        return engine_profile_main(args, device)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = []
    t0 = time.perf_counter()
    for name in names:
        results.append(bench_model(name, args, device, bandwidth))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the model's weights and KV cache went with bench_model's frame
        print(markdown(results[-1:], bandwidth, device_name, args), flush=True)
    table = markdown(results, bandwidth, device_name, args)
    table += f"Total bench time {time.perf_counter() - t0:.0f} s.\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
