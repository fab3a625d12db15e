"""fuse_rope_gemv: rotate-half rotary of q and k folded into the decode GEMV that produces them.

Pattern (after ``fuse_linears`` and ``gemv_swap``; ``models.layers.Attention`` with
``apply_rope_half``, so Ouro and Nanbeige)::

    y  = rlt.linear_small(x, W)                      # W: the fused q/k/v weight (or q_proj alone)
    q  = narrow(y, -1, lo_q, n_q).view(T, H, D)      # or y.view(T, H, D) when y is q alone
    c  = cos_in[:, None, :].to(q.dtype)              # s likewise from sin_in
    x1, x2 = q.chunk(2, dim=-1)
    q' = cat([x1 * c + (-x2) * s, x2 * c + x1 * s], dim=-1)

for every such ``q'`` (and ``k'``) reading ``y``, the rotated column ranges forming one contiguous
range ``[lo, hi)`` that no un-rotated reader of ``y`` overlaps, every intermediate used only inside
its pattern. Rewrite: ``y = rlt.rope_linear_small(x, W, cos_in, sin_in, lo, hi, D)`` and each ``q'``
replaced by its ``view`` of the (now rotated) columns.

Why: Inductor computes the rotation as one or two small pointwise kernels per layer between the
QKV GEMV and attention; at batch-1 decode each is a latency-bound launch (Ouro-1.4B: 2 of the ~10
kernels per layer application). In the GEMV's epilogue the rotation is free: a program computes
the output columns ``d`` and ``d + D/2`` of a head together (``kernels/gemv.py``). For one CUDA row
the op runs that kernel; for more CUDA rows (batch buckets, prefill) cuBLAS and one rotary kernel in
place, the kernel count Inductor had; on the CPU ``F.linear`` and the eager rotation.
A default pass: H200, Ouro-1.4B batch-1 decode 4.467 -> 4.328 ms/token (docs/benchmarks.md, session 6).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch import fx

from rlt_compile.passes.manager import PassContext, is_op, node_value

_MUL = (operator.mul, torch.mul)
_ADD = (operator.add, torch.add)
_NEG = (operator.neg, torch.neg)
_CAT = (torch.cat, torch.concat)
_HALF_ROWS = (slice(None, None, None), None, slice(None, None, None))


def _call(node, targets, nargs: int | None = None) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target in targets
        and not node.kwargs
        and (nargs is None or len(node.args) == nargs)
    )


def _method(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name


def _table(node, dtype):
    """The placeholder ``P`` of ``P[:, None, :].to(dtype)``, else None."""
    if not (_method(node, "to") and len(node.args) == 2 and node.args[1] == dtype and not node.kwargs):
        return None
    index = node.args[0]
    if not (_call(index, (operator.getitem,), 2) and index.args[1] == _HALF_ROWS):
        return None
    table = index.args[0]
    return table if isinstance(table, fx.Node) and table.op == "placeholder" else None


def _dim_last(node: fx.Node, dim) -> bool:
    value = node_value(node)
    return dim == -1 or (value is not None and dim == value.dim() - 1)


def match_rope(cat: fx.Node):
    """``(src, cos_in, sin_in, nodes)`` when ``cat`` is the end of ``apply_rope_half(src, ...)``
    (``nodes``: the pattern's own intermediates, cat included), else None."""
    if not (isinstance(cat, fx.Node) and cat.op == "call_function" and cat.target in _CAT):
        return None
    if len(cat.args) not in (1, 2) or set(cat.kwargs) - {"dim"}:
        return None
    dim = cat.args[1] if len(cat.args) == 2 else cat.kwargs.get("dim", 0)
    parts = cat.args[0]
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and _dim_last(cat, dim)):
        return None
    a, b = parts
    if not (_call(a, _ADD, 2) and _call(b, _ADD, 2)):
        return None
    mul_x1c, mul_nx2s = a.args
    mul_x2c, mul_x1s = b.args
    if not all(_call(m, _MUL, 2) for m in (mul_x1c, mul_nx2s, mul_x2c, mul_x1s)):
        return None
    x1, c = mul_x1c.args
    neg, s = mul_nx2s.args
    if not _call(neg, _NEG, 1):
        return None
    x2 = neg.args[0]
    if mul_x2c.args != (x2, c) or mul_x1s.args != (x1, s):
        return None
    if not (_call(x1, (operator.getitem,), 2) and _call(x2, (operator.getitem,), 2)):
        return None
    chunk = x1.args[0]
    if x2.args[0] is not chunk or (x1.args[1], x2.args[1]) != (0, 1) or not _method(chunk, "chunk"):
        return None
    if chunk.args[1:] != (2,) or chunk.kwargs.get("dim") != -1 or set(chunk.kwargs) != {"dim"}:
        return None
    src = chunk.args[0]
    value = node_value(src)
    if value is None or value.dim() != 3 or value.shape[-1] % 2:
        return None
    cos_in, sin_in = _table(c, value.dtype), _table(s, value.dtype)
    if cos_in is None or sin_in is None:
        return None
    nodes = {cat, a, b, mul_x1c, mul_nx2s, mul_x2c, mul_x1s, neg, x1, x2, chunk}
    inner = nodes - {cat}
    if any(user not in nodes for n in inner for user in n.users):
        return None
    return src, cos_in, sin_in, nodes


def _is_narrow(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is torch.narrow


def _narrow_range(node: fx.Node, linear: fx.Node):
    """``(start, end)`` when ``node`` is ``narrow(linear, -1, start, length)`` with constant bounds."""
    if not (_is_narrow(node) and node.args[0] is linear and len(node.args) == 4 and node.args[1] in (-1, 1)):
        return None
    start, length = node.args[2], node.args[3]
    return (start, start + length) if isinstance(start, int) and isinstance(length, int) else None


def _rotated_source(view: fx.Node):
    """``(linear, (lo, hi))``: the ``rlt.linear_small`` node whose output columns ``[lo, hi)``
    ``view`` (``[T, H, D]``, read only by the rotation) reshapes, directly or through one narrow."""
    if not _method(view, "view") or len(view.users) != 1:
        return None
    src = view.args[0]
    linear = src.args[0] if _is_narrow(src) else src
    if not (isinstance(linear, fx.Node) and is_op(linear, torch.ops.rlt.linear_small.default)):
        return None
    if src is linear:
        return linear, (0, node_value(linear).shape[-1])
    columns = _narrow_range(src, linear)
    return (linear, columns) if columns is not None and len(src.users) == 1 else None


class _Rotary(NamedTuple):
    columns: tuple[int, int]
    cat: fx.Node  # the rotation's output
    view: fx.Node  # its input: a [T, H, D] view of the GEMV's columns
    cos_in: fx.Node
    sin_in: fx.Node


class FuseRopeGemvPass:
    name = "fuse_rope_gemv"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> str | None:
        import rlt_compile.kernels.gemv  # noqa: F401  (registers torch.ops.rlt.*linear_small)

        groups: dict[fx.Node, list[_Rotary]] = {}
        for cat in list(gm.graph.nodes):
            match = match_rope(cat)
            source = match and _rotated_source(match[0])
            if source:
                view, cos_in, sin_in, _ = match
                linear, columns = source
                groups.setdefault(linear, []).append(_Rotary(columns, cat, view, cos_in, sin_in))
        fused = rotated = 0
        for linear, found in groups.items():
            rewrite = self._plan(linear, found)
            if rewrite is None:
                continue
            lo, hi, head_dim = rewrite
            tables = (found[0].cos_in, found[0].sin_in)
            with gm.graph.inserting_before(linear):
                new = gm.graph.call_function(
                    torch.ops.rlt.rope_linear_small.default, (*linear.args, *tables, lo, hi, head_dim)
                )
            new.meta = dict(linear.meta)
            linear.replace_all_uses_with(new)
            gm.graph.erase_node(linear)
            for rotary in found:
                rotary.cat.replace_all_uses_with(rotary.view)
            fused += 1
            rotated += len(found)
        if not fused:
            return None
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return f"{rotated} rotaries folded into {fused} rlt.rope_linear_small (rotation in the GEMV's epilogue)"

    @staticmethod
    def _plan(linear: fx.Node, found: list[_Rotary]):
        """``(lo, hi, head_dim)`` when the rotated ranges are contiguous, share cos/sin and head size,
        and no other reader of ``linear`` overlaps them; else None."""
        tables = {(r.cos_in, r.sin_in) for r in found}
        dims = {node_value(r.view).shape[-1] for r in found}
        if len(tables) != 1 or len(dims) != 1:
            return None
        ranges = sorted(r.columns for r in found)
        if any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
            return None
        lo, hi = ranges[0][0], ranges[-1][1]
        views = {r.view for r in found}
        for user in linear.users:
            if user in views or (_is_narrow(user) and set(user.users) <= views):
                continue
            start, end = _narrow_range(user, linear) or (0, node_value(linear).shape[-1])
            if start < hi and lo < end:
                return None
        (head_dim,) = dims
        return lo, hi, head_dim
