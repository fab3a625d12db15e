"""Decode-GEMV chains: cuBLAS vs the prefetching Triton GEMV (``rlt_compile.kernels.gemv``) in the
sequence of kernels one Ouro-1.4B token really runs, as one CUDA graph.

A GEMV measured alone cannot show what the Triton kernel is for (reading its weights while the
previous kernel still runs, through PDL), so this replays the batch-1 decode chain of a looped
layer stack: per layer application ``add_rmsnorm2 -> q/k/v GEMV -> decode attention (KV write
fused) -> o GEMV -> add_rmsnorm2 -> gate/up GEMV -> SiLU-gate -> down GEMV``, with distinct
weights per application (``--layers``, default 96 = 24 layers x 4 loop steps, ~9.9 GB: nothing
stays in L2). ``--gemv-only`` drops the other kernels (a pure chain of dependent GEMVs).

Reports ms per chain, the weights' effective bandwidth, and per config the speedup over cuBLAS in
the same run::

    python benchmarks/gemv_chain_bench.py --out FILE            # H200: ~1 minute
    python benchmarks/gemv_chain_bench.py --smoke               # CPU (interpreter), tiny shapes
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rlt_compile.kernels import gemv as gemv_mod
from rlt_compile.kernels import rmsnorm as rmsnorm_mod
from rlt_compile.kernels.launch import interpreter_scope, is_interpreted, kernel_for, pdl_launch_options, pdl_mode
from rlt_compile.kernels.rmsnorm import add_rmsnorm2_triton
from rlt_compile.kernels.triton_attention import attention_forward


def _silu_mul_kernel(gu_ptr, out_ptr, N, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL == 2:  # RLT_PDL_TRIGGER=early, like the library's kernels
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(gu_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + N + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    n = gu.shape[-1] // 2
    out = torch.empty((*gu.shape[:-1], n), dtype=gu.dtype, device=gu.device)
    interpret = is_interpreted(gu)
    pdl = pdl_mode(gu)
    with interpreter_scope(interpret):
        kernel_for(_silu_mul_kernel, interpret)[(triton.cdiv(n, 1024),)](
            gu, out, n, BLOCK=1024, USE_PDL=pdl, **pdl_launch_options(pdl)
        )
    return out


def make_layers(n_layers, hidden, inter, heads, dim, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)

    def w(n, k):
        return torch.randn(n, k, generator=g, device=device, dtype=dtype) * k**-0.5

    return [
        {
            "qkv": w(3 * heads * dim, hidden),
            "o": w(hidden, heads * dim),
            "gu": w(2 * inter, hidden),
            "down": w(hidden, inter),
            "n1": torch.ones(hidden, device=device, dtype=dtype),
            "n2": torch.ones(hidden, device=device, dtype=dtype),
        }
        for _ in range(n_layers)
    ]


def make_attention(n_layers, heads, dim, ctx, block_size, dtype, device, table):
    blocks = triton.cdiv(max(ctx + 1, table), block_size)
    caches = [torch.randn(2, blocks, block_size, heads, dim, device=device, dtype=dtype) for _ in range(n_layers)]
    meta = {
        "slot_mapping": torch.tensor([ctx], device=device, dtype=torch.int64),
        "block_tables": torch.arange(blocks, device=device, dtype=torch.int32)[None],
        "seq_lens": torch.tensor([ctx + 1], device=device, dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 1], device=device, dtype=torch.int32),
    }
    return caches, meta


def chain(x, layers, linear, caches, meta, heads, dim, gemv_only, fold=None, variant=None, rope=None):
    """One token through the layer applications. ``variant`` (``variant_candidates``): ``attention``
    config for the attention op, ``swiglu``: the gate in the gate/up GEMV's epilogue (what the
    compiled model runs), ``norm_warps``: the norm kernels' warps, ``late_residual`` / ``late_rope``:
    the norms' residual / the rotary's cos and sin loaded late, the orders before session 18 (all
    three set by ``main``). ``rope`` (``RopeColumns``): q and k rotated in the q/k/v GEMV's epilogue,
    as the compiled model runs (cuBLAS: the reference rotation after ``F.linear``)."""
    variant = variant or {}
    h = x
    residual = torch.zeros_like(x)
    for i, p in enumerate(layers):
        if gemv_only:
            qkv = linear(h, p["qkv"])
            o = linear(qkv[:, : heads * dim], p["o"])
            gu = linear(o, p["gu"])
            h = linear(gu[:, : p["down"].shape[1]], p["down"])
            continue
        no_norms = variant.get("no_norms")  # what any norm fusion could win at most (wrong outputs)
        residual, n = (residual, h) if no_norms else add_rmsnorm2_triton(h, residual, p["n2"], p["n1"], 1e-6, 1e-6)
        if rope is None:
            qkv = linear(n, p["qkv"])
        elif linear is F.linear:
            qkv = gemv_mod.rope_columns_reference(F.linear(n, p["qkv"]), rope)
        else:
            qkv = gemv_mod.linear_gemv(n, p["qkv"], variant.get("qkv"), rope=rope)
        qkv = qkv.view(1, 3, heads, dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        if variant.get("no_attention"):  # what any attention change could win at most (wrong outputs)
            a = q
        else:
            a = attention_forward(q, k, v, caches[i], scale=dim**-0.5, config=variant.get("attention"), **meta)
        o = linear(a.reshape(1, heads * dim), p["o"])
        residual, n = (residual, o) if no_norms else add_rmsnorm2_triton(o, residual, p["n1"], p["n2"], 1e-6, 1e-6)
        if variant.get("swiglu"):  # the gate in the gate/up GEMV's epilogue
            h = linear(gemv_mod.linear_gemv(n, p["gu"], variant.get("gate_up"), swiglu=True), p["down"])
            continue
        gu = linear(n, p["gu"])
        h = fold(gu, p["down"]) if fold else linear(silu_mul(gu), p["down"])
    return h


def variant_candidates():
    """The default Triton chain, then one change each: the SwiGLU gate epilogue, the norms' warps,
    decode-attention tiles (the chain's default is the op's own choice), no norm kernels at all (a
    bound on what any norm fusion can win, not a model). (Sessions 11 and 12 also ran the norms
    inside the next GEMV, in its prologue and accumulated in its loop: slower, removed;
    docs/benchmarks.md.)"""
    yield "cublas", None
    yield "gemv default", {}
    yield "swiglu epilogue", {"variant": {"swiglu": True}}
    model = {"swiglu": True, "rope": True}  # the epilogues the compiled model runs
    yield "model epilogues", {"variant": model}
    yield "model epilogues, norm residual loaded after norm a", {"variant": {**model, "late_residual": True}}
    yield "model epilogues, rope cos/sin loaded after the loop", {"variant": {**model, "late_rope": True}}
    old_attention = {"attention": {"early_q": 0}}  # split 0: k, its store, v, its store, then q
    yield "model epilogues, attention q loaded after the KV row's stores", {"variant": {**model, **old_attention}}
    yield (
        "model epilogues, all three loaded late (the chain before session 18)",
        {"variant": {**model, "late_residual": True, "late_rope": True, **old_attention}},
    )
    acc = {"acc_2d": True}
    yield "model epilogues, gemv acc_2d", {**acc, "variant": {**model, "qkv": acc, "gate_up": acc}}
    for warps in (1, 2, 4):
        yield f"swiglu epilogue, norm warps {warps}", {"variant": {"swiglu": True, "norm_warps": warps}}
    for attention in ATTENTION_VARIANTS:
        name = " ".join(f"{key}={value}" for key, value in attention.items())
        yield f"swiglu epilogue, attention {name}", {"variant": {"swiglu": True, "attention": attention}}
    yield "no norm kernels (bound)", {"variant": {"swiglu": True, "no_norms": True}}
    yield "no attention kernels (bound)", {"variant": {"swiglu": True, "no_attention": True}}


# Decode-attention launcher configs of ``--variants`` (the op's own choice at context 128 since session
# 20: 32 splits of 16-key tiles, 9 of them with keys, the 16-row tl.dot tile, 4 warps, 2 stages,
# merged in the kernel, the first tile prefetched into L2).
ATTENTION_VARIANTS = (
    {"warps": 1},
    {"warps": 2},
    {"warps": 8},
    {"l2_prefetch": 1},
    {"l2_prefetch": 1, "warps": 8},
    {"l2_prefetch": 1, "use_dot": True},
    {"l2_prefetch": 2, "splits": 2},
    {"l2_prefetch": 2, "splits": 2, "warps": 8},
    {"l2_prefetch": 4, "splits": 1},
    {"l2_prefetch": 4, "splits": 1, "warps": 8},
    {"l2_prefetch": 2, "splits": 1, "warps": 8, "block_n": 128},
    {"l2_prefetch": 4, "splits": 1, "use_dot": True},
    # fewer splits: 4 is what the 208-position table allowed before session 16 (slower than 32, whose
    # empty splits exit at once)
    {"splits": 4},
    {"splits": 8},
)


def time_graph(fn, reps):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2]


def candidates(smoke: bool, grid: str):
    """cuBLAS, the default config, no prefetch, then every ``block_n:block_k:warps:stages`` combination
    of ``grid`` (comma-separated values per field)."""
    yield "cublas", None
    yield "gemv default", {}
    yield "gemv no prefetch", {"prefetch": False}
    for block_n in (2, 4, 8):  # the SwiGLU gate folded into the down GEMV (gemv_swap's pattern 2)
        yield f"gemv + silu fold (down n{block_n})", {"fold": {"block_n": block_n}}
    if smoke:
        return
    fields = [[int(v) for v in part.split(",")] for part in grid.split(":")]
    for block_n, block_k, warps, stages in itertools.product(*fields):
        if block_n * block_k <= 16384:
            yield (
                f"n{block_n} k{block_k} w{warps} s{stages}",
                {
                    "block_n": block_n,
                    "block_k": block_k,
                    "warps": warps,
                    "stages": stages,
                },
            )


def shape_candidates(hidden: int, inter: int):
    """The default config, then tiles for one GEMV alone: o ``[hidden, hidden]``, down ``[hidden,
    inter]``, q/k/v ``[3 hidden, hidden]`` or the gate/up GEMV with its SwiGLU epilogue (every other
    GEMV keeps the default; the chain runs the SwiGLU epilogue, as the compiled model does)."""
    yield "cublas", None
    yield "gemv default", {"variant": {"swiglu": True}}
    tiles = ((2, 2048, 4, 3), (4, 1024, 4, 3), (4, 2048, 8, 3), (1, 2048, 4, 3), (2, 1024, 4, 4), (2, 512, 4, 4))
    configs = [
        (f"n{n} k{k} w{w} s{st}", {"block_n": n, "block_k": k, "warps": w, "stages": st}) for n, k, w, st in tiles
    ]
    for label, shape in (("o", (hidden, hidden)), ("down", (hidden, inter)), ("qkv", (3 * hidden, hidden))):
        for name, cfg in configs:
            yield f"{label} {name}", {"shapes": {shape: cfg}, "variant": {"swiglu": True}}
    for name, cfg in configs:
        yield f"gate/up {name}", {"variant": {"swiglu": True, "gate_up": cfg}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--gemv-only", action="store_true")
    parser.add_argument(
        "--grid", default="1,2,4:1024,2048:2,4:2,3,4", help="block_n:block_k:warps:stages values to sweep"
    )
    parser.add_argument(
        "--shape-sweep",
        action="store_true",
        help="vary the o and down GEMVs' tiles alone (the tiles of shape_candidates), the rest at the default",
    )
    parser.add_argument(
        "--variants",
        action="store_true",
        help="one change each to the default chain: SwiGLU epilogue, norm warps, attention tiles",
    )
    parser.add_argument(
        "--table", type=int, default=0, help="positions the block table describes (default: context + 80, as bench)"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated name fragments (or =exact names): run only matching candidates"
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, dtype = torch.device("cpu"), torch.float32
        hidden, inter, heads, dim, n_layers = 64, 96, 4, 16, 2
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        hidden, inter, heads, dim, n_layers = 2048, 5632, 16, 128, args.layers
    layers = make_layers(n_layers, hidden, inter, heads, dim, dtype, device)
    caches, meta = make_attention(n_layers, heads, dim, args.ctx, 16, dtype, device, args.table or args.ctx + 80)
    x = torch.randn(1, hidden, device=device, dtype=dtype)
    weight_bytes = sum(t.numel() * t.element_size() for p in layers for t in p.values())
    ref = chain(x, layers, F.linear, caches, meta, heads, dim, args.gemv_only)
    cos = torch.randn(1, dim // 2, device=device)
    rope = gemv_mod.RopeColumns(cos, torch.randn_like(cos), 0, 2 * heads * dim, dim)  # q and k columns
    ref_rope = chain(x, layers, F.linear, caches, meta, heads, dim, args.gemv_only, rope=rope)

    rows = []
    if args.variants:
        sweep = variant_candidates()
    elif args.shape_sweep:
        sweep = shape_candidates(hidden, inter)
    else:
        sweep = candidates(args.smoke, args.grid)
    only = [part for part in args.only.split(",") if part]
    for name, cfg in sweep:
        if only and name != "cublas" and not any(name == p[1:] if p[0] == "=" else p in name for p in only):
            continue
        fold = None
        variant = (cfg or {}).get("variant")
        if cfg is None:
            linear = F.linear
        else:
            cfg = dict(cfg)
            cfg.pop("variant", None)
            fold_cfg = cfg.pop("fold", None)

            shaped = cfg.pop("shapes", None)

            def linear(a, w, cfg=cfg, shaped=shaped):
                if shaped is not None:
                    return gemv_mod.linear_gemv(a, w, shaped.get(tuple(w.shape), {}))
                return gemv_mod.linear_gemv(a, w, cfg)

            if fold_cfg is not None:

                def fold(gu, w, cfg=fold_cfg):
                    return gemv_mod.linear_gemv(gu, w, cfg, silu_mul=True)

        def run(linear=linear, fold=fold, variant=variant):
            variant = variant or {}
            saved = rmsnorm_mod._num_warps, rmsnorm_mod._EARLY_RESIDUAL, gemv_mod._EARLY_ROPE
            if variant.get("norm_warps"):
                rmsnorm_mod._num_warps = lambda block: variant["norm_warps"]
            rmsnorm_mod._EARLY_RESIDUAL = not variant.get("late_residual")  # the orders before session 18
            gemv_mod._EARLY_ROPE = not variant.get("late_rope")
            try:
                used = rope if variant.get("rope") else None
                return chain(x, layers, linear, caches, meta, heads, dim, args.gemv_only, fold, variant, used)
            finally:
                rmsnorm_mod._num_warps, rmsnorm_mod._EARLY_RESIDUAL, gemv_mod._EARLY_ROPE = saved

        try:
            out = run()
            want = ref_rope if (variant or {}).get("rope") else ref
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            ms = time_graph(run, args.reps) if device.type == "cuda" else _cpu_time(run)
        except Exception as exc:  # a config that does not compile: report and go on
            print(f"{name}: failed ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
            continue
        rows.append((name, ms, err))
        print(f"{name:24s} {ms:8.3f} ms  {weight_bytes / ms / 1e9:6.2f} TB/s  rel err {err:.1e}", flush=True)

    base = rows[0][1]
    lines = [
        f"# GEMV chain: {n_layers} layer applications, {'GEMVs only' if args.gemv_only else 'Ouro decode chain'}, "
        f"weights {weight_bytes / 1e9:.2f} GB, context {args.ctx}",
        "",
        "| linear | ms / chain | weight TB/s | vs cuBLAS | rel err vs cuBLAS chain |",
        "|---|---|---|---|---|",
    ]
    for name, ms, err in sorted(rows, key=lambda r: r[1]):
        lines.append(f"| {name} | {ms:.3f} | {weight_bytes / ms / 1e9:.2f} | {base / ms:.2f}x | {err:.1e} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


def _cpu_time(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


if __name__ == "__main__":
    sys.exit(main())
