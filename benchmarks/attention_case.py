"""Run one attention case of ``attention_bench`` a few times, outside CUDA graphs, for an external
profiler such as Nsight Compute (the launcher config comes from ``RLT_ATTENTION_CONFIG``)::

    ncu --kernel-name regex:decode --launch-skip 3 --launch-count 1 --set full \\
        python benchmarks/attention_case.py --model Nanbeige --batch 32 --ctx 1024
    python benchmarks/attention_case.py --smoke    # CPU interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Nanbeige", help="a name fragment of attention_bench.MODELS")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--query", type=int, default=1, help="query tokens per sequence (1: decode)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from attention_bench import MODELS, make_paged, step_inputs

    from rlt_compile.kernels.triton_attention import attention_forward

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    (name, (heads, kv_heads, dim)), *_ = [(n, d) for n, d in MODELS.items() if args.model in n]
    if args.smoke:
        heads, kv_heads, dim = heads // 8 or 1, kv_heads // 8 or 1, 16
    q, cache, tables, seq_lens, qsl, *_ = make_paged(
        args.batch, args.ctx, args.query, heads, kv_heads, dim, dtype, device
    )
    slots, k, v = step_inputs(cache, tables, torch.arange(args.ctx - args.query, args.ctx, device=device))
    for _ in range(args.iters):
        out = attention_forward(q, k, v, cache, slots, tables, seq_lens, qsl, dim**-0.5)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"{name}: batch {args.batch}, context {args.ctx}, {args.query} queries: out {tuple(out.shape)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
