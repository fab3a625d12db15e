"""fuse_swiglu_gemv: a SwiGLU's gate folded into the epilogue of the decode GEMV of its gate/up projection.

Pattern (after ``fuse_linears`` and ``gemv_swap``; ``models.layers.SwiGLU`` and ``FusedSwiGLU``)::

    y = rlt.linear_small(x, W)                       # W: the fused gate/up weight [2I, K], gate rows first
    g = narrow(y, -1, 0, I)   u = narrow(y, -1, I, I)   # or: g, u = y.chunk(2, dim=-1)
    p = silu(g) * u

with ``y`` read by nothing but its two halves and ``g``, ``u``, ``silu(g)`` by nothing but the
pattern. Rewrite: ``p = rlt.swiglu_linear_small(x, W)``.

Why: Inductor computes the gate as one pointwise kernel between the gate/up GEMV and the down
GEMV; at batch-1 decode that is a latency-bound launch per layer application (Ouro-1.4B: 96 per
token) and a round trip of the ``2I`` row through memory. In the GEMV the gate is free: a program
computes output ``j`` of the gate half and of the up half together (``kernels/gemv.py``) and writes
``silu(gate_j) * up_j`` only. For one CUDA row the op runs that kernel; for more CUDA rows
(batch buckets, prefill) cuBLAS then one gating kernel, the kernel count Inductor had; on the CPU
``F.linear`` and the eager gate. (Folding the gate into the *down* GEMV instead, ``gemv_swap_swiglu``,
made every program re-read the whole gate/up row and was slower.) A default pass since its H200
measurement: batch-1 decode even (Ouro-1.4B 4.386 -> 4.381 ms/token), the engine's async decode steps
1-2.4% faster at batch 1 / 32 / 128 (docs/benchmarks.md, session 8).
"""

from __future__ import annotations

import torch
from torch import fx

from rlt_compile.passes.gemv_swap import swiglu_source
from rlt_compile.passes.manager import PassContext, is_op


def _read_only_by(y: fx.Node, halves: set[fx.Node]) -> bool:
    """Whether ``y``'s readers are ``halves`` only, directly (narrow) or through one ``chunk``."""
    for user in y.users:
        if user in halves:
            continue
        if user.op == "call_method" and user.target == "chunk" and set(user.users) <= halves:
            continue
        return False
    return True


class FuseSwiGLUGemvPass:
    name = "fuse_swiglu_gemv"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> str | None:
        import rlt_compile.kernels.gemv  # noqa: F401  (registers torch.ops.rlt.*linear_small)

        linear_small = torch.ops.rlt.linear_small.default
        fused = 0
        for product in list(gm.graph.nodes):
            source = swiglu_source(product)
            if source is None:
                continue
            y, gate, up = source
            if not is_op(y, linear_small) or not _read_only_by(y, {gate, up}):
                continue
            with gm.graph.inserting_before(product):
                new = gm.graph.call_function(torch.ops.rlt.swiglu_linear_small.default, tuple(y.args))
            new.meta = dict(product.meta)
            product.replace_all_uses_with(new)
            gm.graph.erase_node(product)
            fused += 1
        if not fused:
            return None
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return f"{fused} SwiGLU gates folded into rlt.swiglu_linear_small (the gate in the GEMV's epilogue)"
