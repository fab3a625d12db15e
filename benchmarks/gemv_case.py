"""Run the batch-1 decode GEMVs of one model's layer a few times, outside CUDA graphs, for an external
profiler such as Nsight Compute (each linear alone, with its own weights: what it reaches without the
chain's early launches)::

    ncu --kernel-name regex:gemv --launch-skip 4 --launch-count 4 --section SpeedOfLight \\
        python benchmarks/gemv_case.py --model ouro-1.4b
    python benchmarks/gemv_case.py --smoke    # CPU interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlt_compile.bench import CONFIGS  # noqa: E402


def layer_shapes(model: str) -> tuple[int, int, int]:
    """(hidden, intermediate, q/k/v output columns) of ``model``'s real configuration."""
    cfg = CONFIGS[model]
    heads, kv_heads, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    return cfg["hidden_size"], cfg["intermediate_size"], (heads + 2 * kv_heads) * dim


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ouro-1.4b", choices=("ouro-1.4b", "ouro-2.6b", "nanbeige4.2-3b"))
    parser.add_argument("--iters", type=int, default=2, help="launches of each linear, in layer order")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from rlt_compile.kernels.gemv import linear_gemv

    hidden, inter, qkv = (64, 96, 192) if args.smoke else layer_shapes(args.model)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shapes = {"qkv": (qkv, hidden), "o": (hidden, hidden), "gate/up": (2 * inter, hidden), "down": (hidden, inter)}
    weights = {name: torch.randn(shape, device=device, dtype=dtype) * 0.02 for name, shape in shapes.items()}
    inputs = {name: torch.randn(1, w.shape[1], device=device, dtype=dtype) for name, w in weights.items()}
    refs = {name: inputs[name].float() @ w.float().T for name, w in weights.items()}  # before: only GEMVs below
    for _ in range(args.iters):
        outs = {name: linear_gemv(inputs[name], w) for name, w in weights.items()}
    for name, ref in refs.items():
        err = ((outs[name].float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, (name, err)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"{args.model}: {', '.join(f'{n} {tuple(w.shape)}' for n, w in weights.items())}, relative error < 1e-2")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
