"""fuse_rmsnorm: each RMSNorm, and the residual add and second norm around it, become one Triton kernel.

Pattern 1 (one norm): the nodes Dynamo recorded inside one call of a ``models.layers.RMSNorm``
(innermost ``nn_module_stack`` entry), exactly ::

    xf = x.float(); p = xf.pow(2); m = p.mean(-1, keepdim=True); a = m + eps; r = torch.rsqrt(a)
    n = xf * r; t = n.to(x.dtype); out = weight * t

with ``weight`` a graph input / attribute ``[hidden]`` of ``x``'s dtype and no other user of the
intermediates. Rewrite: ``out = rlt.rmsnorm(x, weight, eps)``. A module whose recorded nodes are
anything else is left alone.

Pattern 2 (a norm fed by a residual add; the add may have other users, which then read ``h``):

* ``h = residual + rlt.rmsnorm(y, w_a)`` (the inner norm used only by the add), ``out =
  rlt.rmsnorm(h, w_b)`` -> ``h, out = rlt.add_rmsnorm2(y, residual, w_a, w_b, eps_a, eps_b)``
  (Ouro's sandwich norms: a sublayer's post-norm + the residual + the next pre-norm / ``model.norm``);
* ``s = y + residual`` (used only by the norm), ``h = rlt.rmsnorm(s, w_a)``, ``out =
  rlt.rmsnorm(h, w_b)`` -> ``rlt.add_rmsnorm_rmsnorm`` (Huginn's blocks: renormalised residual
  stream, then the next sublayer's pre-norm);
* ``h = y + residual``, ``out = rlt.rmsnorm(h, w)`` -> ``h, out = rlt.add_rmsnorm(y, residual, w,
  eps)`` (pre-norm layers: Nanbeige).

Per Ouro layer that is 4 norms -> 2 ``rlt.add_rmsnorm2`` (the loop step's first ``input_layernorm``
stays a ``rlt.rmsnorm``; the last layer's second one takes ``model.norm``). The add operands must
have the same shape and dtype (no broadcasting). Semantics and rounding are the model's exactly
(``kernels/rmsnorm.py``).

Why: at batch-1 decode Inductor splits a norm whose input comes from an extern GEMM into a
sum-of-squares reduction kernel plus a pointwise kernel and does not fuse two dependent norms, so
"GEMM out -> norm -> residual add -> norm" costs 2-4 small kernels; the fused op is one.
Only for CUDA/ROCm (on the CPU Inductor makes one C++ loop of the chain; the pass returns None).
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
from torch import fx

from rlt_compile.passes.manager import PassContext, is_op, node_value

_GPU_KINDS = ("cuda", "rocm")


def _ops():
    import rlt_compile.kernels.rmsnorm  # noqa: F401  (registers torch.ops.rlt.*rmsnorm*)

    rlt = torch.ops.rlt
    return (
        rlt.rmsnorm.default,
        rlt.add_rmsnorm.default,
        rlt.add_rmsnorm2.default,
        rlt.add_rmsnorm_rmsnorm.default,
    )


def _is_rmsnorm_type(t) -> bool:
    from rlt_compile.models.layers import RMSNorm

    if isinstance(t, type):
        return issubclass(t, RMSNorm)
    return isinstance(t, str) and t.rsplit(".", 1)[-1] == "RMSNorm" and "rlt_compile.models.layers" in t


def _norm_instance(node: fx.Node):
    """The key of the innermost module of ``node`` when that module is an RMSNorm, else None."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    key, entry = list(stack.items())[-1]
    typ = entry[1] if isinstance(entry, tuple) and len(entry) > 1 else None
    return key if _is_rmsnorm_type(typ) else None


def _tensor(node) -> torch.Tensor | None:
    v = node_value(node)
    return v if isinstance(v, torch.Tensor) else None


def _same(a, b) -> bool:
    """Statically equal sizes (ints or SymInts), without adding guards."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(_same(x, y) for x, y in zip(a.shape, b.shape))


def _call(node, op: str, target) -> bool:
    return isinstance(node, fx.Node) and node.op == op and node.target == target


def _users_are(node: fx.Node, *users: fx.Node) -> bool:
    return set(node.users) == set(users)


def _match_norm(out: fx.Node, group: set[fx.Node]):
    """``(x, weight, eps, chain nodes)`` when ``out`` ends an exact RMSNorm chain inside ``group``."""
    if not _call(out, "call_function", operator.mul) or len(out.args) != 2 or out.kwargs:
        return None
    a, b = out.args
    weight, t = (a, b) if _call(b, "call_method", "to") else (b, a)
    if not (isinstance(weight, fx.Node) and weight.op in ("placeholder", "get_attr")):
        return None
    if not _call(t, "call_method", "to") or len(t.args) != 2 or t.kwargs or not isinstance(t.args[1], torch.dtype):
        return None
    n = t.args[0]
    if not _call(n, "call_function", operator.mul) or len(n.args) != 2 or n.kwargs:
        return None
    xf, r = n.args if _call(n.args[1], "call_function", torch.rsqrt) else n.args[::-1]
    if not _call(r, "call_function", torch.rsqrt) or len(r.args) != 1 or r.kwargs:
        return None
    add = r.args[0]
    if not _call(add, "call_function", operator.add) or len(add.args) != 2 or add.kwargs:
        return None
    m, eps = add.args if isinstance(add.args[0], fx.Node) else add.args[::-1]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None
    if not _call(m, "call_method", "mean") or len(m.args) != 2 or m.kwargs != {"keepdim": True}:
        return None
    p = m.args[0]
    if not _call(p, "call_method", "pow") or p.args[1:] != (2,) or p.kwargs or p.args[0] is not xf:
        return None
    if not _call(xf, "call_method", "float") or len(xf.args) != 1 or xf.kwargs:
        return None
    x = xf.args[0]
    chain = [xf, p, m, add, r, n, t, out]
    if not isinstance(x, fx.Node) or x in group or not all(c in group for c in chain):
        return None
    users_ok = (
        _users_are(xf, p, n)
        and _users_are(p, m)
        and _users_are(m, add)
        and _users_are(add, r)
        and _users_are(r, n)
        and _users_are(n, t)
        and _users_are(t, out)
    )
    xv, wv, ov = _tensor(x), _tensor(weight), _tensor(out)
    if not users_ok or xv is None or wv is None or ov is None or xv.dim() < 1:
        return None
    dims = m.args[1]
    if dims not in (-1, xv.dim() - 1, [-1], (-1,)):
        return None
    if not (t.args[1] == xv.dtype == wv.dtype == ov.dtype and xv.dtype.is_floating_point):
        return None
    if wv.dim() != 1 or not _same(wv.shape[0], xv.shape[-1]) or not _same_shape(ov, xv):
        return None
    return x, weight, float(eps), chain


class FuseRMSNormPass:
    name = "fuse_rmsnorm"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> str | None:
        if ctx.platform.kind not in _GPU_KINDS:
            return None
        norms = self._replace_norms(gm)
        if not norms:
            return None
        counts = self._fuse(gm)
        adds = sum(counts.values())
        rmsnorm = _ops()[0]
        counts["rlt.rmsnorm"] = sum(1 for n in gm.graph.nodes if is_op(n, rmsnorm))
        detail = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
        return f"{norms} RMSNorms + {adds} residual adds -> {sum(counts.values())} fused ops ({detail})"

    # -- pattern 1 ---------------------------------------------------------------------------
    def _replace_norms(self, gm: fx.GraphModule) -> int:
        groups: dict[str, list[fx.Node]] = {}
        for node in gm.graph.nodes:
            if node.op not in ("call_function", "call_method") or _tensor(node) is None:
                continue  # parameters and size assertions also carry the module's stack
            key = _norm_instance(node)
            if key is not None:
                groups.setdefault(key, []).append(node)
        rmsnorm = _ops()[0]
        replaced = 0
        for nodes in groups.values():
            group = set(nodes)
            matches = [m for m in (_match_norm(n, group) for n in nodes) if m is not None]
            covered = {c for m in matches for c in m[3]}
            if not matches or covered != group:
                continue  # not exactly the expected arithmetic (one or more calls): leave it alone
            for x, weight, eps, chain in matches:
                out = chain[-1]
                with gm.graph.inserting_before(out):
                    new = gm.graph.call_function(rmsnorm, (x, weight, eps))
                new.meta = dict(out.meta)
                out.replace_all_uses_with(new)
                for c in reversed(chain):
                    gm.graph.erase_node(c)
                replaced += 1
        return replaced

    # -- pattern 2 ---------------------------------------------------------------------------
    def _fuse(self, gm: fx.GraphModule) -> Counter:
        rmsnorm, add_rmsnorm, add_rmsnorm2, add_rmsnorm_rmsnorm = _ops()
        counts: Counter = Counter({"rlt.add_rmsnorm2": 0, "rlt.add_rmsnorm_rmsnorm": 0, "rlt.add_rmsnorm": 0})

        def norms() -> list[fx.Node]:
            return [n for n in gm.graph.nodes if is_op(n, rmsnorm)]

        def residual_add(node) -> tuple[fx.Node, fx.Node] | None:
            """The two tensor operands of ``node`` when it is a same-shape, same-dtype add."""
            if not _call(node, "call_function", operator.add) or len(node.args) != 2 or node.kwargs:
                return None
            a, b = node.args
            av, bv, sv = _tensor(a), _tensor(b), _tensor(node)
            if av is None or bv is None or sv is None:
                return None
            if not (av.dtype == bv.dtype == sv.dtype and _same_shape(av, bv) and _same_shape(av, sv)):
                return None
            return a, b

        # add -> norm_a -> norm_b (Huginn); the sum is only the norm's input.
        for nb in norms():
            na = nb.args[0]
            if not is_op(na, rmsnorm) or na is nb:
                continue
            s = na.args[0]
            operands = residual_add(s)
            if operands is None or not _users_are(s, na):
                continue
            y, residual = operands
            args = (y, residual, na.args[1], nb.args[1], na.args[2], nb.args[2])
            if self._emit(gm, s, add_rmsnorm_rmsnorm, args, h_node=na, out_node=nb, dead=(s,)):
                counts["rlt.add_rmsnorm_rmsnorm"] += 1

        # residual + norm_a(y) -> norm_b (Ouro); the inner norm is only the add's input.
        for nb in norms():
            h = nb.args[0]
            operands = residual_add(h)
            if operands is None:
                continue
            a, b = operands
            na, residual = (b, a) if is_op(b, rmsnorm) and _users_are(b, h) else (a, b)
            if not (is_op(na, rmsnorm) and _users_are(na, h)):
                continue
            args = (na.args[0], residual, na.args[1], nb.args[1], na.args[2], nb.args[2])
            if self._emit(gm, h, add_rmsnorm2, args, h_node=h, out_node=nb, dead=(na,)):
                counts["rlt.add_rmsnorm2"] += 1

        # y + residual -> norm (Nanbeige, and the norms left over above)
        for nb in norms():
            h = nb.args[0]
            operands = residual_add(h)
            if operands is None:
                continue
            y, residual = operands
            if self._emit(gm, h, add_rmsnorm, (y, residual, nb.args[1], nb.args[2]), h_node=h, out_node=nb):
                counts["rlt.add_rmsnorm"] += 1
        return counts

    @staticmethod
    def _emit(gm, before: fx.Node, op, args: tuple, h_node: fx.Node, out_node: fx.Node, dead=()) -> bool:
        """Insert ``h, out = op(*args)`` before ``before`` (the chain's first node); the users of
        ``h_node`` / ``out_node`` read ``h`` / ``out``; those two and ``dead`` are erased."""
        if not all(_defined_before(a, before) for a in args):
            return False  # e.g. a weight attribute fetched later in the graph
        with gm.graph.inserting_before(before):
            fused = gm.graph.call_function(op, args)
            h = gm.graph.call_function(operator.getitem, (fused, 0))
            out = gm.graph.call_function(operator.getitem, (fused, 1))
        fused.meta = {k: v for k, v in out_node.meta.items() if k != "example_value"}
        fused.meta["example_value"] = (node_value(h_node), node_value(out_node))
        h.meta = dict(h_node.meta)
        out.meta = dict(out_node.meta)
        out_node.replace_all_uses_with(out)
        gm.graph.erase_node(out_node)
        h_node.replace_all_uses_with(h)
        gm.graph.erase_node(h_node)
        for node in dead:
            gm.graph.erase_node(node)
        for item in (h, out):
            if not item.users:
                gm.graph.erase_node(item)
        return True


def _defined_before(arg, node: fx.Node) -> bool:
    if not isinstance(arg, fx.Node) or arg.op == "placeholder":
        return True
    cur = node.prev
    while cur.op != "root":
        if cur is arg:
            return True
        cur = cur.prev
    return False
