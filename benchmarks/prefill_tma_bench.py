"""Prefill attention through ``rlt::attention_triton``'s op path (KV write + attention): the TMA
kernel (``kernels/prefill_tma.py``) per tile config, with the KV write inside it or separate, against the unified paged kernel (the op with
``prefill_tma=0``) and SDPA on the same data (on pre-gathered K/V, gather + SDPA, write + gather + SDPA).

Cases: fresh causal prompts (8 x 1k, 1 x 8k; SDPA on pre-gathered K/V, ``is_causal``), chunks after a
cached prefix (2 x 512 queries at the end of 2560 tokens) and a decode-heavy mix (one 512-token
prompt and 31 decode rows at context 2048; below ``MIN_AVERAGE_QUERY`` the rule keeps the unified
kernel, and this times both). Medians of CUDA-graph replays with the L2 flushed (``attention_bench``)::

    python benchmarks/prefill_tma_bench.py --out FILE        # H200, ~2 minutes
    python benchmarks/prefill_tma_bench.py --smoke           # CPU interpreter: parity of every case, tiny shapes
    python benchmarks/prefill_tma_bench.py --extra "fold_scale=1;rescale_slack=8" --default-tile-only
        # launcher configs on the default tile (one per ';'), against it and the unified op
    python benchmarks/prefill_tma_bench.py --mixes "128,31,2048;1024,31,2048" --default-tile-only
        # only mixes of one prompt and decode rows (prompt, decode rows, context; one per ';'):
        # where ``MIN_AVERAGE_QUERY`` should send a mixed batch
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (block_m, block_n, warps, stages, KV write inside the kernel, more launcher config); the first is the default.
TILES = [(64, 64, 4, 3, True, {}), (64, 64, 4, 3, False, {}), (128, 64, 8, 3, True, {}), (128, 128, 8, 3, True, {})]


def mixed_inputs(heads, kv_heads, dim, dtype, device, prompt, decodes, ctx):
    """One fresh prompt of ``prompt`` tokens and ``decodes`` decode rows at context ``ctx``, as the op
    gets them (q/k/v rows, paged cache with shuffled blocks, metadata)."""
    from rlt_compile.kernels.metadata import build_metadata

    gen = torch.Generator().manual_seed(0)
    query_lens = [prompt] + [1] * decodes
    context_lens = [0] + [ctx - 1] * decodes
    needed = [-(-(q + c) // 16) for q, c in zip(query_lens, context_lens)]
    perm = torch.randperm(sum(needed), generator=gen).tolist()
    tables, i = [], 0
    for n in needed:
        tables.append(perm[i : i + n])
        i += n
    md = build_metadata(query_lens, context_lens, tables, 16, device=device)
    t = sum(query_lens)
    q = torch.randn(t, heads, dim, device=device, dtype=dtype)
    k = torch.randn(t, kv_heads, dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    cache = torch.randn(2, sum(needed), 16, kv_heads, dim, device=device, dtype=dtype)
    return q, k, v, cache, md.slot_mapping, md.block_tables, md.seq_lens, md.query_start_loc


def paged_inputs(heads, kv_heads, dim, dtype, device, batch, ctx, q_len):
    """``batch`` sequences of ``ctx`` tokens whose last ``q_len`` are this step's queries."""
    from attention_bench import make_paged, step_inputs

    q, cache, tables, seq_lens, qsl, q_s, k_s, v_s = make_paged(batch, ctx, q_len, heads, kv_heads, dim, dtype, device)
    slots, k, v = step_inputs(cache, tables, torch.arange(ctx - q_len, ctx, device=device))
    return (q, k, v, cache, slots, tables, seq_lens, qsl), (q_s, k_s, v_s)


def run_case(name, dims, label, inputs, dense, tiles, smoke, ctx=None) -> list[str]:
    """Rows of one case; with ``dense`` (fresh prompts of ``ctx`` tokens) also SDPA on pre-gathered K/V,
    gather + SDPA (the gather out of the paged cache timed with it, ``attention_bench``'s) and write +
    gather + SDPA (the step's K/V rows scattered into the cache first, as the op does: what a paged
    runtime without its own attention kernel runs)."""
    from attention_bench import bench, gathered_sdpa, sdpa

    from rlt_compile.kernels.triton_attention import attention_forward

    device = inputs[0].device
    scale = dims[2] ** -0.5

    def op(config):
        return attention_forward(*inputs, scale, config=config)

    ref = op({"prefill_tma": False})
    if dense is not None:
        q_s, k_s, v_s = dense
        ref = sdpa(q_s, k_s, v_s, scale, True).transpose(1, 2).reshape_as(ref)
    rows = []
    t_unified = None if smoke else bench(lambda: op({"prefill_tma": False}), device)
    t_sdpa = None if smoke or dense is None else bench(lambda: sdpa(*dense, scale, True), device)
    t_gathered = t_written = None
    if not smoke and dense is not None:
        k, v, cache, slots, tables = inputs[1], inputs[2], inputs[3], inputs[4], inputs[5]

        def written():
            for plane, rows in ((cache[0], k), (cache[1], v)):
                plane.view(-1, *plane.shape[-2:]).index_copy_(0, slots, rows)
            return gathered_sdpa(dense[0], cache, tables, ctx, scale, True)

        t_gathered = bench(lambda: gathered_sdpa(dense[0], cache, tables, ctx, scale, True), device)
        t_written = bench(written, device)
    for block_m, block_n, warps, stages, fuse_write, extra in tiles:
        cfg = {"prefill_tma": True, "block_m": block_m, "block_n": block_n, "warps": warps, "stages": stages}
        cfg |= {"fuse_write": fuse_write, **extra}
        tile = f"m{block_m} n{block_n} w{warps} s{stages}" + ("" if fuse_write else ", separate KV write")
        tile += "".join(f", {key}={value}" for key, value in extra.items())
        try:
            err = (op(cfg).float() - ref.float()).abs().max().item()
            t = None if smoke else bench(lambda cfg=cfg: op(cfg), device)
        except Exception as exc:  # a tile that does not compile or fit: report and go on
            print(f"{name} {label} {tile}: failed {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            continue
        if smoke:
            assert err < 1e-4, (name, label, tile, err)
            rows.append(f"| {name} | {label} | {tile} | - | - | - | - | - | - | - | - | {err:.1e} |")
            continue
        baselines = [
            (f"{base * 1e3:.0f}", f"{base / t:.2f}x") if base else ("-", "-")
            for base in (t_sdpa, t_gathered, t_written)
        ]
        rows.append(
            f"| {name} | {label} | {tile} | {t * 1e3:.0f} | {t_unified * 1e3:.0f} | {t_unified / t:.2f}x | "
            + " | ".join(" | ".join(pair) for pair in baselines)
            + f" | {err:.1e} |"
        )
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--extra", default="", help="launcher configs on the default tile, 'key=int,key=int;key=int'")
    parser.add_argument("--default-tile-only", action="store_true", help="no other tiles (--extra still adds)")
    parser.add_argument("--mixes", default="", help="only these mixes, 'prompt,decodes,context;...'")
    args = parser.parse_args(argv)
    from rlt_compile import envs

    extras = [envs.parse_config(item) for item in filter(None, args.extra.split(";"))]
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, dtype = torch.device("cpu"), torch.float32
        models = {"MHA 4x16": (4, 4, 16), "GQA 6/2x16": (6, 2, 16)}
        fresh, chunk, mix, tiles = (
            [(2, 40)],
            (2, 70, 24),
            (30, 5, 50),
            [(32, 16, 4, 1, True, {}), (32, 16, 4, 1, False, {})],
        )
    else:
        from attention_bench import MODELS

        device, dtype = torch.device("cuda"), torch.bfloat16
        models, fresh, chunk, mix, tiles = MODELS, [(8, 1024), (1, 8192)], (2, 2560, 512), (512, 31, 2048), TILES
    mixes = [tuple(int(n) for n in item.split(",")) for item in filter(None, args.mixes.split(";"))]
    if mixes:
        fresh, chunk = [], None
    tiles = tiles[:1] + [(*tiles[0][:5], extra) for extra in extras] + ([] if args.default_tile_only else tiles[1:])
    lines = [
        "| model | case | TMA tile | op us | unified op us | vs unified | SDPA us | vs SDPA | gather + SDPA us "
        "| vs gather + SDPA | write + gather + SDPA us | vs write + gather + SDPA | max err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, dims in models.items():
        for batch, ctx in fresh:
            inputs, dense = paged_inputs(*dims, dtype, device, batch, ctx, ctx)
            lines += run_case(name, dims, f"fresh {batch} x {ctx}", inputs, dense, tiles, args.smoke, ctx)
        if chunk is not None:
            batch, ctx, q_len = chunk
            inputs, _ = paged_inputs(*dims, dtype, device, batch, ctx, q_len)
            label = f"{batch} chunks of {q_len} after {ctx - q_len}"
            lines += run_case(name, dims, label, inputs, None, tiles, args.smoke)
        for prompt, decodes, ctx in mixes or [mix]:
            inputs = mixed_inputs(*dims, dtype, device, prompt, decodes, ctx)
            label = (
                f"{prompt}-token prompt + {decodes} decodes at {ctx} (average {(prompt + decodes) / (decodes + 1):.0f})"
            )
            lines += run_case(name, dims, label, inputs, None, tiles[: 1 + len(extras)], args.smoke)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
