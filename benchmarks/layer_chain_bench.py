"""Ouro-1.4B batch-1 decode chain: today's kernel sequence vs the one-launch decode layer.

Replays one token's layer stack (``--layers`` applications, default 96 = 24 layers x 4 loop steps,
distinct weights, ~9.9 GB: nothing stays in L2) as one CUDA graph, in two forms:

* ``ops``: what the default passes run per layer (``rmsnorm`` / ``add_rmsnorm2``, the q/k/v GEMV
  with its rotary epilogue, the decode attention with the KV write fused, the o GEMV,
  ``add_rmsnorm2``, the gate/up GEMV with its SwiGLU epilogue, the down GEMV);
* ``layer``: ``kernels/decode_layer.py``, one launch per layer (``phased=1``: its five phases as
  five launches), for each config of ``--configs``.

Each loop step ends with ``add_rmsnorm2`` into ``model.norm`` in both. Reports ms per chain, the
weights' bandwidth, the fraction of the design floor (2.10 ms per Ouro-1.4B token at 4.8 TB/s) and
the relative error of the chain's output against ``ops``::

    python benchmarks/layer_chain_bench.py --out FILE       # H200: ~1 minute
    python benchmarks/layer_chain_bench.py --smoke          # CPU (interpreter), tiny shapes
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

DESIGN_FLOOR_MS = 2.10  # docs: Ouro-1.4B batch-1 decode floor at 4.8 TB/s
DEFAULT_CONFIGS = (
    "default;depth=2;rows=8;rows=32,warps=16;rows=8,block_k=2048;rows=32,block_k=512;"
    "rows=16,warps=16;nprog=128;block_n=16;block_n=64;phased=1"
)


def build(n_layers, hidden, inter, heads, dim, ctx, block_size, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape, scale):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).mul_(scale).to(dtype)

    def norm_w():
        return (1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(dtype)

    layers = [
        {
            "w_qkv": w(3 * heads * dim, hidden, scale=hidden**-0.5),
            "w_o": w(hidden, heads * dim, scale=(heads * dim) ** -0.5),
            "w_gu": w(2 * inter, hidden, scale=hidden**-0.5),
            "w_down": w(hidden, inter, scale=inter**-0.5),
            "w_in": norm_w(),
            "w_in2": norm_w(),
            "w_post": norm_w(),
            "w_post2": norm_w(),
        }
        for _ in range(n_layers)
    ]
    blocks = ctx // block_size + 2
    caches = [
        torch.randn(2, blocks, block_size, heads, dim, generator=g, device=device).to(dtype) for _ in range(n_layers)
    ]
    meta = {
        "slot_mapping": torch.tensor([ctx], device=device, dtype=torch.int64),
        "block_tables": torch.arange(blocks, device=device, dtype=torch.int32)[None],
        "seq_lens": torch.tensor([ctx + 1], device=device, dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 1], device=device, dtype=torch.int32),
    }
    inv = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device=device).float() / dim))
    angle = torch.tensor([[float(ctx)]], device=device) * inv[None]
    return layers, caches, meta, angle.cos(), angle.sin(), norm_w()


def ops_chain(h, layers, caches, meta, cos, sin, w_norm, heads, dim, per_step):
    from rlt_compile.kernels import gemv
    from rlt_compile.kernels.rmsnorm import add_rmsnorm2_triton, rmsnorm_triton
    from rlt_compile.kernels.triton_attention import attention_forward

    rope = gemv.RopeColumns(cos, sin, 0, 2 * heads * dim, dim)
    for i, p in enumerate(layers):
        if i % per_step == 0:
            res, x = h, rmsnorm_triton(h, p["w_in"], 1e-6)
        else:
            res, x = add_rmsnorm2_triton(d, res, layers[i - 1]["w_post2"], p["w_in"], 1e-6, 1e-6)  # noqa: F821
        qkv = gemv.linear_gemv(x, p["w_qkv"], rope=rope).view(1, 3, heads, dim)
        a = attention_forward(qkv[:, 0], qkv[:, 1], qkv[:, 2], caches[i], scale=dim**-0.5, **meta)
        o = gemv.linear_gemv(a.reshape(1, heads * dim), p["w_o"])
        res, x = add_rmsnorm2_triton(o, res, p["w_in2"], p["w_post"], 1e-6, 1e-6)
        d = gemv.linear_gemv(gemv.linear_gemv(x, p["w_gu"], swiglu=True), p["w_down"])
        if i % per_step == per_step - 1:
            _, h = add_rmsnorm2_triton(d, res, p["w_post2"], w_norm, 1e-6, 1e-6)
    return h


def layer_chain(h, layers, caches, meta, cos, sin, w_norm, heads, dim, per_step, config, timings=None):
    from rlt_compile.kernels.decode_layer import sandwich_layer_triton
    from rlt_compile.kernels.rmsnorm import add_rmsnorm2_triton

    meta = {k: v for k, v in meta.items() if k != "query_start_loc"}
    for i, p in enumerate(layers):
        first = i % per_step == 0
        res, d = sandwich_layer_triton(
            None if first else d,  # noqa: F821
            h if first else res,  # noqa: F821
            None if first else layers[i - 1]["w_post2"],
            p["w_in"],
            1e-6,
            1e-6,
            p["w_qkv"],
            cos,
            sin,
            caches[i],
            meta["slot_mapping"],
            meta["block_tables"],
            meta["seq_lens"],
            dim**-0.5,
            p["w_o"],
            p["w_in2"],
            p["w_post"],
            1e-6,
            1e-6,
            p["w_gu"],
            p["w_down"],
            config=config,
            timing=None if timings is None else timings[i],
        )
        if i % per_step == per_step - 1:
            _, h = add_rmsnorm2_triton(d, res, p["w_post2"], w_norm, 1e-6, 1e-6)
    return h


SEGMENTS = (
    "PDL wait",
    "prologue + q/k/v GEMV",
    "barrier 1",
    "attention",
    "barrier 2",
    "o GEMV",
    "barrier 3",
    "prologue + gate/up GEMV",
    "barrier 4",
    "down GEMV",
)


def timeline(text, x, layers, caches, meta, cos, sin, w_norm, fixed, reps) -> list[str]:
    """Per phase of the fused layer: the median over programs of its duration (global timer),
    averaged over layers, from one graph replay; and the gap from one layer's last program to the
    next layer's first."""
    from gemv_chain_bench import time_graph

    (_, cfg), *_ = parse_configs(text)
    nprog = cfg.get("nprog", torch.cuda.get_device_properties(0).multi_processor_count)
    stamps = torch.zeros(len(layers), nprog, 16, dtype=torch.int64, device="cuda")
    ms = time_graph(lambda: layer_chain(x, layers, caches, meta, cos, sin, w_norm, *fixed, cfg, stamps), reps)
    t = stamps[:, :, :11].double()
    seg = (t[:, :, 1:] - t[:, :, :-1]).median(dim=1).values.mean(dim=0) / 1e3
    span = (t[:, :, 10].max(dim=1).values - t[:, :, 0].min(dim=1).values).mean() / 1e3
    gap = (t[1:, :, 0].min(dim=1).values - t[:-1, :, 10].max(dim=1).values).mean() / 1e3
    out = [
        f"Timeline of `{text}` ({ms:.3f} ms per chain; us per layer, median over programs, mean over layers):",
        "",
        "| segment | us |",
        "|---|---|",
    ]
    out += [f"| {name} | {v:.2f} |" for name, v in zip(SEGMENTS, seg.tolist())]
    out += [f"| layer span (first start to last end) | {span:.2f} |", f"| gap to the next layer | {gap:.2f} |"]
    print("\n".join(out), flush=True)
    return out


def parse_configs(text: str) -> list[tuple[str, dict]]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        cfg = {}
        if item != "default":
            for kv in item.split(","):
                key, _, value = kv.partition("=")
                cfg[key.strip()] = int(value)
        out.append((item, cfg))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--per-step", type=int, default=24, help="layers per loop step")
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="';'-separated key=int,... configs")
    parser.add_argument("--timeline", help="a config to time phase by phase (global timer stamps)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, dtype = torch.device("cpu"), torch.float32
        hidden, inter, heads, dim, n_layers, per_step = 64, 96, 4, 16, 4, 2
        configs = [("default", {}), ("rows=2,depth=2", {"rows": 2, "depth": 2})]
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        hidden, inter, heads, dim, n_layers, per_step = 2048, 5632, 16, 128, args.layers, args.per_step
        configs = parse_configs(args.configs)
    from gemv_chain_bench import _cpu_time, time_graph

    layers, caches, meta, cos, sin, w_norm = build(n_layers, hidden, inter, heads, dim, args.ctx, 16, dtype, device)
    x = torch.randn(1, hidden, device=device, dtype=dtype)
    weight_bytes = sum(t.numel() * t.element_size() for p in layers for t in p.values())
    fixed = (heads, dim, per_step)

    def run_ops():
        return ops_chain(x, layers, caches, meta, cos, sin, w_norm, *fixed)

    ref = run_ops().float()
    rows = []
    for name, cfg in [("ops", None), *configs]:
        if cfg is None:
            fn = run_ops
        else:

            def fn(cfg=cfg):
                return layer_chain(x, layers, caches, meta, cos, sin, w_norm, *fixed, cfg)

        try:
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            ms = time_graph(fn, args.reps) if device.type == "cuda" else _cpu_time(fn)
        except Exception as exc:  # a config that does not compile or launch: report and go on
            print(f"{name}: failed ({type(exc).__name__}: {str(exc)[:300]})", flush=True)
            continue
        rows.append((name, ms, err))
        print(f"{name:28s} {ms:8.3f} ms  {weight_bytes / ms / 1e9:6.2f} TB/s  rel err {err:.1e}", flush=True)

    scale = n_layers / 96
    base = rows[0][1]
    lines = [
        f"# Ouro-1.4B decode chain: {n_layers} layer applications, weights {weight_bytes / 1e9:.2f} GB, "
        f"context {args.ctx}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}",
        "",
        "| chain | ms / chain | weight TB/s | % of design floor | vs ops | rel err vs ops |",
        "|---|---|---|---|---|---|",
    ]
    for name, ms, err in rows:
        floor = 100 * DESIGN_FLOOR_MS * scale / ms
        lines.append(
            f"| {name} | {ms:.3f} | {weight_bytes / ms / 1e9:.2f} | {floor:.1f}% | {base / ms:.2f}x | {err:.1e} |"
        )
    if args.timeline is not None:
        lines += ["", *timeline(args.timeline, x, layers, caches, meta, cos, sin, w_norm, fixed, args.reps)]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
