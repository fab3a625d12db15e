"""The Gluon prefill kernel alone (issue 3): fresh causal prompts, tile configs against SDPA.

``rlt_compile/kernels/prefill_gluon.py`` grew from this probe (sessions 24-25), which had its own
copy of the kernel over ``[B, S, H, D]`` prompts; it now times the package's kernel on the same
prompts, packed as a varlen batch (``[B * S, H, D]``, ``query_start_loc`` every ``S`` tokens, no
cached prefix, no KV write), so the kernel's time is seen without the op's KV write
(``prefill_tma_bench.py --extra gluon_prefill=1`` times the op). For each case of the attention table
(Ouro / Nanbeige, 8 x 1k and 1 x 8k) it checks parity with SDPA (bf16), then times each tile config
and SDPA with the attention table's timer (median CUDA-graph replay, L2 flushed).

    python benchmarks/gluon_prefill_probe.py [--tiles "64,64,3,4;64,64,2,4"]   # Hopper GPU

Configs are ``block_m,block_n,stages,warps``, then any more ``GLUON_TILE`` options as ``key=value``
(``64,64,3,4,persistent=2``).
Session 25 (H100, the probe's own kernel with each head's tiles launched in turn): 64 x 64 tiles,
3 stages and 4 warps (one warp group per program, two programs per SM) were 0.81-0.89x SDPA, and
every config that left one program per SM (more stages, 128-row tiles) 20-40% slower. The offline sm_90 compile (registers, spills, the loop's
``wgmma`` order) is ``tests/test_prefill_gluon.py``'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_bench import MODELS, bench  # noqa: E402  (the attention table's models and timer)


def model_cases(shapes: list[tuple[int, int]]) -> list[tuple]:
    """(label, batch, length, heads, kv heads) of each prompt shape for each of the attention table's models."""
    return [
        (f"{name.split()[0]} {b} x {f'{s // 1024}k' if s % 1024 == 0 else s}", b, s, heads, kv_heads)
        for name, (heads, kv_heads, _) in MODELS.items()
        for b, s in shapes
    ]


CASES = model_cases([(8, 1024), (1, 8192)])


def parse_tile(text: str) -> dict | None:
    """``"64,64,3,4,persistent=2"`` -> the tile dict; ``None`` when malformed. Keys not given: GLUON_TILE's."""
    fields = [f.strip() for f in text.split(",")]
    plain = [f for f in fields if "=" not in f]
    if len(plain) != 4 or not all(f.isdigit() for f in plain):
        return None
    tile = dict(zip(("block_m", "block_n", "stages", "warps"), map(int, plain)))
    for field in fields[len(plain) :]:
        key, _, value = field.partition("=")
        if "=" not in field or not value.isdigit():
            return None
        tile[key] = int(value)
    return tile


def parse_cases(text: str) -> list[tuple] | None:
    """``"8x1024,1x8192"`` -> those prompt shapes (batch x length) for Ouro and Nanbeige; ``None`` when malformed."""
    shapes = []
    for field in text.split(","):
        batch, _, seq = field.strip().partition("x")
        if not (batch.isdigit() and seq.isdigit()) or int(batch) < 1 or int(seq) < 1:
            return None
        shapes.append((int(batch), int(seq)))
    return model_cases(shapes)


def run_gpu(cases, tiles: list[dict]) -> int:
    from rlt_compile.kernels.prefill_gluon import launch_gluon_prefill

    names = [" ".join(f"{key}={value}" for key, value in tile.items()) for tile in tiles]
    print("| case | " + " | ".join(f"{name} us (TFLOP/s)" for name in names) + " | SDPA us (TFLOP/s) | best vs SDPA |")
    print("|---|" + "---|" * (len(tiles) + 2))
    worst, device = 0.0, torch.device("cuda")
    for label, batch, seq, heads, kv_heads in cases:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(batch, seq, h, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
            for h in (heads, kv_heads, kv_heads)
        )
        scale = 128**-0.5
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def sdpa(qt=qt, kt=kt, vt=vt, scale=scale, gqa=heads != kv_heads):
            return torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa
            )

        ref = sdpa().transpose(1, 2).float()
        packed = [x.reshape(batch * seq, x.shape[2], 128) for x in (q, k, v)]
        cache = torch.empty(2, 1, 16, kv_heads, 128, device="cuda", dtype=torch.bfloat16)  # no KV write
        tables = torch.zeros(batch, 1, device="cuda", dtype=torch.int32)  # no cached prefix
        seq_lens = torch.full((batch,), seq, device="cuda", dtype=torch.int32)
        starts = torch.arange(0, batch * seq + 1, seq, device="cuda", dtype=torch.int32)
        out = torch.empty_like(packed[0])
        flops = 4 * batch * heads * 128 * seq * seq / 2  # causal: half the score matrix
        cells, best = [], float("inf")
        for tile in tiles:

            def run(tile=tile, out=out, packed=packed, cache=cache, tables=tables, seq_lens=seq_lens, starts=starts,
                    scale=scale):  # fmt: skip
                launch_gluon_prefill(*packed, cache, tables, seq_lens, starts, out, scale, tile=tile)

            out.zero_()
            try:
                run()
            except Exception as exc:  # a tile the GPU cannot launch (shared memory): say so, time the others
                cells.append(f"FAIL {type(exc).__name__}")
                print(f"{label}, {tile}: {exc}", file=sys.stderr)
                continue
            err = (out.view(batch, seq, heads, 128).float() - ref).abs().max().item()
            worst = max(worst, err)
            us = 1e3 * bench(run, device)
            best = min(best, us)
            cells.append(f"{us:.1f} ({flops / us / 1e6:.0f})" + (f" ERR {err:.1e}" if err > 3e-2 else ""))
        t_sdpa = 1e3 * bench(sdpa, device)
        print(f"| {label} | {' | '.join(cells)} | {t_sdpa:.1f} ({flops / t_sdpa / 1e6:.0f}) | {t_sdpa / best:.2f}x |")
    print(f"bf16 max abs error against SDPA, every config: {worst:.2e}")
    return 0 if worst < 3e-2 else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiles",
        default="64,64,3,4;64,64,3,4,persistent=2",
        help="configs 'block_m,block_n,stages,warps[,key=value...];...' (key=value: more GLUON_TILE options)",
    )
    parser.add_argument("--cases", default="", help="prompt shapes 'BxS,...' for both models (default: 8x1024,1x8192)")
    args = parser.parse_args(argv)
    cases = parse_cases(args.cases) if args.cases else CASES
    if cases is None:
        parser.error(f"--cases takes 'BxS,...' entries such as 8x1024, got {args.cases!r}")
    tiles = [parse_tile(t) for t in args.tiles.split(";") if t.strip()]
    if not all(tiles):
        parser.error(f"--tiles takes block_m,block_n,stages,warps[,key=value...] entries, got {args.tiles!r}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("error: needs a Hopper GPU (the offline compile: tests/test_prefill_gluon.py)", file=sys.stderr)
        return 2
    return run_gpu(cases, tiles)


if __name__ == "__main__":
    sys.exit(main())
