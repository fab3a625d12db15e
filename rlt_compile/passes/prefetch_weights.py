"""prefetch_weights: each batch-1 decode GEMV asks the L2 cache for the weights of the GEMVs after it.

Pattern: the decode GEMV ops (``rlt.linear_small``, ``rlt.rope_linear_small``,
``rlt.swiglu_linear_small``, ``rlt.silu_mul_linear_small``, after ``gemv_swap`` and the GEMV
fusions) of one graph, in graph order, each with its weight ``W`` (a graph input or attribute).
Their weights, concatenated in that order, form the graph's *weight stream*. Rewrite: GEMV ``i``
gets ``prefetch=[W_j, ...]`` and ``prefetch_ranges=[start, length, ...]`` (bytes): the part of the
stream from the end of its own weight to ``lookahead`` bytes past it that no earlier GEMV has asked
for (``plan_l2_prefetch``). In a loop body (unit ``loop_step``, run again right after itself) the
last GEMVs also ask for the first GEMV's weight, which the next loop step reads first.

Why: at batch-1 decode the kernels between the GEMVs (attention, norms) read almost nothing, so
HBM idles while they run (Ouro-1.4B on the H200: ~16 us of each ~45 us layer application). A bulk
L2 prefetch (``cp.async.bulk.prefetch.L2``, issued by the GEMV's last programs without waiting:
``kernels/gemv.py``) keeps HBM streaming the next weights through those gaps, and the next GEMVs
read them from L2. Only where the GEMV can issue it (NVIDIA sm_90+, PDL on: the pass returns None
elsewhere); the ops ignore the ranges on every other path (more rows, CPU), so one graph still
serves every batch bucket. ``RLT_L2_PREFETCH_MB`` sets ``lookahead`` (default 32 MiB, about half
of the H200's L2; 0 turns the pass off).
"""

from __future__ import annotations

import torch
from torch import fx

from rlt_compile import envs
from rlt_compile.passes.manager import PassContext, is_op, node_value
from rlt_compile.platform import pdl_enabled

LOOP_UNITS = ("loop_step",)
_MIB = 1 << 20


def _gemv_ops() -> tuple:
    import rlt_compile.kernels.gemv  # noqa: F401  (registers torch.ops.rlt.*linear_small)

    rlt = torch.ops.rlt
    return (
        rlt.linear_small.default,
        rlt.rope_linear_small.default,
        rlt.swiglu_linear_small.default,
        rlt.silu_mul_linear_small.default,
    )


def plan_l2_prefetch(
    sizes: list[int], lookahead: int, wrap: bool = False, max_ranges: int = 4
) -> list[list[tuple[int, int, int]]]:
    """Per GEMV of a weight stream (``sizes[i]``: bytes of GEMV ``i``'s weight, in order), the
    ``(weight index, start byte, length)`` ranges it prefetches: stream bytes ``[max(cursor, end_i),
    end_i + lookahead)`` with ``end_i`` the end of its own weight and ``cursor`` the end of what
    earlier GEMVs asked for, cut at ``max_ranges`` pieces. The first weight is asked for by nobody,
    unless ``wrap`` (the stream repeats: a loop body), when the last GEMVs may ask for it."""
    if lookahead <= 0 or not sizes:
        return [[] for _ in sizes]
    total = sum(sizes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    limit = total + (sizes[0] if wrap and len(sizes) > 1 else 0)
    cursor = sizes[0]
    plan = []
    for i, size in enumerate(sizes):
        end = starts[i] + size
        lo, hi = max(cursor, end), min(end + lookahead, limit)
        ranges: list[tuple[int, int, int]] = []
        pos = lo
        while pos < hi and len(ranges) < max_ranges:
            virtual = pos % total
            j = max(k for k, s in enumerate(starts) if s <= virtual)
            length = min(hi - pos, starts[j] + sizes[j] - virtual)
            ranges.append((j, virtual - starts[j], length))
            pos += length
        cursor = max(cursor, pos)
        plan.append(ranges)
    return plan


def _weight_bytes(node: fx.Node) -> int | None:
    value = node_value(node.args[1]) if len(node.args) > 1 and isinstance(node.args[1], fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return None
    return value.numel() * value.element_size()


def _weight_ref(gm: fx.GraphModule, weight: fx.Node, user: fx.Node) -> fx.Node:
    """``weight`` as an argument of ``user``: a graph input as is; an attribute (``fuse_linears``'
    concatenated weights, fetched just before their own GEMV) fetched again just before ``user``."""
    if weight.op != "get_attr":
        return weight
    with gm.graph.inserting_before(user):
        ref = gm.graph.get_attr(weight.target)
    ref.meta = dict(weight.meta)
    return ref


class PrefetchWeightsPass:
    name = "prefetch_weights"

    def __init__(self, lookahead_mb: int | None = None):
        self.lookahead_mb = lookahead_mb

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> str | None:
        lookahead_mb = envs.rlt_l2_prefetch_mb() if self.lookahead_mb is None else self.lookahead_mb
        platform = ctx.platform
        hopper = platform.kind == "cuda" and platform.capability is not None and platform.capability[0] >= 9
        if lookahead_mb <= 0 or not hopper or not pdl_enabled(platform):
            return None
        ops = _gemv_ops()
        gemvs = [n for n in gm.graph.nodes if any(is_op(n, op) for op in ops) and _weight_bytes(n)]
        if not gemvs:
            return None
        sizes = [_weight_bytes(n) for n in gemvs]
        plan = plan_l2_prefetch(sizes, lookahead_mb * _MIB, wrap=ctx.unit in LOOP_UNITS)
        asked = 0
        for node, ranges in zip(gemvs, plan):
            if not ranges:
                continue
            node.kwargs = {
                **node.kwargs,
                "prefetch": [_weight_ref(gm, gemvs[j].args[1], node) for j, _, _ in ranges],
                "prefetch_ranges": [v for _, start, length in ranges for v in (start, length)],
            }
            asked += sum(length for _, _, length in ranges)
        if not asked:
            return None
        return (
            f"{sum(1 for r in plan if r)} of {len(gemvs)} GEMVs prefetch later weights into L2 "
            f"({asked / _MIB:.1f} MiB of {sum(sizes) / _MIB:.1f} MiB, lookahead {lookahead_mb} MiB)"
        )
