"""gemv_swap: bias-free linears on fixed 16-bit weights -> ``rlt.linear_small`` (prefetching GEMV).

Pattern: ``torch.nn.functional.linear(x, W, None)`` whose weight ``W`` is a graph input (a
parameter lifted by Dynamo) or a graph attribute (``fuse_linears``' concatenated weights), 2-D,
bf16 or fp16, and ``x`` of the same dtype.
Rewrite: ``rlt.linear_small(x, W)``. At run time the op takes the Triton GEMV of
``kernels/gemv.py`` for up to 16 rows (batch-1..16 decode) and ``F.linear`` otherwise, so one
graph still serves every token count.

Why: in a CUDA graph with PDL the GEMV is launched while its predecessor runs and reads its first
weight tile before waiting for its input, which cuBLAS cannot do; on an H200 the Ouro-1.4B decode
chain (96 layer applications) runs 1.18x faster than with cuBLAS GEMVs
(``benchmarks/gemv_chain_bench.py``). Without PDL the kernel is no faster than cuBLAS, so the pass
changes nothing unless ``Platform.supports_pdl`` (NVIDIA sm_90+) holds and ``RLT_PDL`` allows it.
Must run after ``fuse_linears`` (it rewrites the same nodes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from rlt_compile.passes.manager import PassContext, node_value
from rlt_compile.platform import pdl_enabled

_LINEAR = (F.linear, torch._C._nn.linear, torch.ops.aten.linear.default)
_DTYPES = (torch.bfloat16, torch.float16)


def _swappable(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _LINEAR:
        return False
    args = list(node.args) + [None] * (3 - len(node.args))
    x, weight, bias = (
        node.kwargs.get("input", args[0]),
        node.kwargs.get("weight", args[1]),
        node.kwargs.get("bias", args[2]),
    )
    if bias is not None or not isinstance(weight, fx.Node) or weight.op not in ("placeholder", "get_attr"):
        return False
    w, xv = node_value(weight), node_value(x)
    if not isinstance(w, torch.Tensor) or not isinstance(xv, torch.Tensor):
        return False
    return w.dim() == 2 and w.dtype in _DTYPES and xv.dtype == w.dtype


class GemvSwapPass:
    name = "gemv_swap"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> str | None:
        if not pdl_enabled(ctx.platform):
            return None
        import rlt_compile.kernels.gemv  # noqa: F401  (registers torch.ops.rlt.linear_small)

        op = torch.ops.rlt.linear_small.default
        swapped = 0
        for node in list(gm.graph.nodes):
            if not _swappable(node):
                continue
            args = list(node.args) + [None] * (2 - len(node.args))
            x, weight = node.kwargs.get("input", args[0]), node.kwargs.get("weight", args[1])
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(op, (x, weight))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            swapped += 1
        if not swapped:
            return None
        return f"{swapped} linears -> rlt.linear_small (Triton GEMV up to 16 rows, F.linear above)"
