"""A list-scheduling model of the Gluon prefill kernel's work items (no GPU): the most loaded
program's key tiles, against the ideal (total / programs), for one program per item (the hardware's
greedy order), persistent programs in stride order and in snake order.

Items run as the kernel orders them: heads first within a query tile, each sequence's causally
heaviest tile first. An item's weight is its key tiles plus a fixed cost per item (``--fixed``, in
key tiles)::

    python benchmarks/schedule_model.py [--programs 264] [--fixed 1.5]
"""

from __future__ import annotations

import argparse
import heapq
import sys

CASES = [("Ouro 8 x 1k", 8, 1024, 16), ("Ouro 1 x 8k", 1, 8192, 16), ("Nanbeige 8 x 1k", 8, 1024, 48),
         ("Nanbeige 1 x 8k", 1, 8192, 48)]  # fmt: skip


def item_weights(batch: int, seq_len: int, heads: int, fixed: float, block: int = 64) -> list[float]:
    tiles = -(-seq_len // block)
    return [tile + 1 + fixed for _ in range(batch) for tile in reversed(range(tiles)) for _ in range(heads)]


def greedy(weights: list[float], programs: int) -> float:
    """Each item to the program that frees first (one program per item, or a shared counter)."""
    loads = [0.0] * programs
    for weight in weights:
        heapq.heapreplace(loads, loads[0] + weight)
    return max(loads)


def static(weights: list[float], programs: int, snake: bool) -> float:
    """Program p takes items p, p + P, ... (``snake``: every other round reversed)."""
    loads = [0.0] * programs
    for i, weight in enumerate(weights):
        turn, p = divmod(i, programs)
        loads[programs - 1 - p if snake and turn % 2 else p] += weight
    return max(loads)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=264, help="programs at once (2 per SM on 132 SMs)")
    parser.add_argument("--fixed", type=float, default=1.5, help="fixed cost per item, in key tiles")
    args = parser.parse_args(argv)
    print("| case | ideal | greedy | stride | snake |\n|---|---|---|---|---|")
    for name, batch, seq_len, heads in CASES:
        w = item_weights(batch, seq_len, heads, args.fixed)
        loads = (sum(w) / args.programs, greedy(w, args.programs), static(w, args.programs, False),
                 static(w, args.programs, True))  # fmt: skip
        print(f"| {name} | " + " | ".join(f"{load:.0f}" for load in loads) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
