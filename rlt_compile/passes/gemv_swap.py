"""gemv_swap: bias-free linears on fixed 16-bit weights -> the Triton decode GEMV ops.

Pattern 1: ``torch.nn.functional.linear(x, W, None)`` whose weight ``W`` is a graph input (a
parameter lifted by Dynamo) or a graph attribute (``fuse_linears``' concatenated weights), 2-D,
bf16 or fp16, and ``x`` of the same dtype. Rewrite: ``rlt.linear_small(x, W)``.

Pattern 2 (opt-in: ``GemvSwapPass(fold_swiglu=True)``, pass name ``gemv_swap_swiglu``; a SwiGLU's
down projection, after pattern 1)::

    g = narrow(y, -1, 0, I)   u = narrow(y, -1, I, I)      # or: g, u = y.chunk(2, dim=-1)
    d = rlt.linear_small(silu(g) * u, W_down)

with ``y.shape[-1] == 2 * I`` and ``g``, ``u``, ``silu(g)`` and the product used nowhere else.
Rewrite: ``d = rlt.silu_mul_linear_small(y, W_down)``: the GEMV forms ``silu(g) * u`` itself, so
the SiLU-gate kernel between the two GEMVs disappears. Measured slower on the H200 (Ouro-1.4B
decode 227 -> 204 tok/s: every program of the down GEMV re-reads and re-gates the whole gate/up row
from L2, which costs more than the launch it saves), hence not in the default list.

At run time both ops take the Triton GEMV of ``kernels/gemv.py`` for up to ``gemv.OP_MAX_ROWS``
rows (one: batch-1 decode; more rows measured slower than cuBLAS) and the torch path otherwise, so
one graph still serves every token count.

Why: in a CUDA graph with PDL the GEMV is launched while its predecessor runs and reads its first
weight tile before waiting for its input; on an H200 the Ouro-1.4B decode chain runs 1.18x faster
than with cuBLAS GEMVs (docs/benchmarks.md). Without PDL the kernel is no faster than cuBLAS, so
the pass changes nothing unless ``pdl_enabled`` holds for the platform (NVIDIA sm_90+, ``RLT_PDL``).
Must run after ``fuse_linears`` (which rewrites the same linears).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from rlt_compile.passes.manager import PassContext, is_op, node_value
from rlt_compile.platform import pdl_enabled

_LINEAR = (F.linear, torch._C._nn.linear, torch.ops.aten.linear.default)
_SILU = (F.silu, torch._C._nn.silu, torch.ops.aten.silu.default)
_MUL = (operator.mul, torch.mul, torch.ops.aten.mul.Tensor)
_DTYPES = (torch.bfloat16, torch.float16)


def _linear_args(node: fx.Node):
    """(x, W) of a swappable linear node, else None."""
    if node.op != "call_function" or node.target not in _LINEAR:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x = node.kwargs.get("input", args[0])
    weight, bias = node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
    if bias is not None or not isinstance(weight, fx.Node) or weight.op not in ("placeholder", "get_attr"):
        return None
    w, xv = node_value(weight), node_value(x)
    if not isinstance(w, torch.Tensor) or not isinstance(xv, torch.Tensor):
        return None
    if w.dim() != 2 or w.dtype not in _DTYPES or xv.dtype != w.dtype:
        return None
    return x, weight


def _only_user(node, user) -> bool:
    return isinstance(node, fx.Node) and list(node.users) == [user]


def _half_of(node) -> tuple[fx.Node, int] | None:
    """(y, 0 or 1) when ``node`` is the first or second half of ``y``'s last dim, else None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function" and node.target is torch.narrow and len(node.args) == 4:
        y, dim, start, length = node.args
        yv = node_value(y)
        if not isinstance(yv, torch.Tensor) or dim not in (-1, yv.dim() - 1) or yv.shape[-1] != 2 * length:
            return None
        return (y, 0) if start == 0 else (y, 1) if start == length else None
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] in (0, 1):
        chunk = node.args[0]
        if not isinstance(chunk, fx.Node) or chunk.op != "call_method" or chunk.target != "chunk":
            return None
        y = chunk.args[0]
        chunks = chunk.args[1] if len(chunk.args) > 1 else chunk.kwargs.get("chunks")
        dim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
        yv = node_value(y)
        if chunks != 2 or not isinstance(yv, torch.Tensor) or dim not in (-1, yv.dim() - 1) or yv.shape[-1] % 2:
            return None
        return y, node.args[1]
    return None


def swiglu_source(product) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """``(y, gate, up)`` when ``product`` is ``silu(gate) * up`` with ``gate`` / ``up`` the first / second
    half of ``y`` (the halves and the SiLU used by nothing else), else None."""
    if not isinstance(product, fx.Node) or product.op != "call_function" or product.target not in _MUL:
        return None
    a, b = product.args[:2]
    for act, up in ((a, b), (b, a)):
        if not (isinstance(act, fx.Node) and act.op == "call_function" and act.target in _SILU):
            continue
        gate = act.args[0]
        g, u = _half_of(gate), _half_of(up)
        if g is None or u is None or g[0] is not u[0] or (g[1], u[1]) != (0, 1):
            continue
        if _only_user(act, product) and _only_user(gate, act) and _only_user(up, product):
            return g[0], gate, up
    return None


class GemvSwapPass:
    name = "gemv_swap"

    def __init__(self, fold_swiglu: bool = False):
        self.fold_swiglu = fold_swiglu

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> str | None:
        if not pdl_enabled(ctx.platform):
            return None
        import rlt_compile.kernels.gemv  # noqa: F401  (registers torch.ops.rlt.*linear_small)

        linear_small = torch.ops.rlt.linear_small.default
        silu_mul_linear = torch.ops.rlt.silu_mul_linear_small.default
        swapped = folded = 0
        for node in list(gm.graph.nodes):
            args = _linear_args(node)
            if args is None:
                continue
            self._replace(gm, node, linear_small, args)
            swapped += 1
        for node in list(gm.graph.nodes) if self.fold_swiglu else ():
            if not is_op(node, linear_small):
                continue
            product = node.args[0]
            source = swiglu_source(product)
            if source is None or not _only_user(product, node):
                continue
            y = source[0]
            self._replace(gm, node, silu_mul_linear, (y, node.args[1]))
            gm.graph.erase_node(product)
            folded += 1
        if not swapped:
            return None
        gm.graph.eliminate_dead_code()
        message = f"{swapped} linears -> rlt.linear_small (Triton GEMV for one row, F.linear above)"
        if folded:
            message += f", {folded} with the SwiGLU gate folded in (rlt.silu_mul_linear_small)"
        return message

    @staticmethod
    def _replace(gm: fx.GraphModule, node: fx.Node, op, args: tuple) -> None:
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(op, tuple(args))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)


class GemvSwapSwiGLUPass(GemvSwapPass):
    """``gemv_swap`` with pattern 2 (the SwiGLU gate folded into the down GEMV) on."""

    name = "gemv_swap_swiglu"

    def __init__(self):
        super().__init__(fold_swiglu=True)
