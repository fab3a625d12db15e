"""fuse_linears: one GEMM for the bias-free linears that read the same input (q/k/v, gate/up).

Pattern: two or more ``torch.nn.functional.linear(x, W_i, None)`` nodes with the same input node
``x`` whose weights ``W_i`` are graph inputs (the model's parameters, lifted by Dynamo) of equal
in-features, dtype and device. Ouro and Nanbeige have two such groups per layer: q/k/v projections
and the MLP's gate/up projections; Huginn already fuses both in its checkpoint (``Wqkv``, ``fc``).

Rewrite: ``y = linear(x, W_cat, None)`` with ``W_cat = cat(W_1..W_n)`` built once, at compile
time, from the real parameter tensors (our backend passes them in ``ctx.example_inputs``), held
by the graph module as a constant (``get_attr``); each old node becomes a slice of ``y``
(``narrow`` on the last dim). The model's own parameters are re-pointed at views of ``W_cat``
(``param.data = W_cat[a:b]``), so the weights are stored once and the eager model still works.

Why: at batch-1 decode a linear is a GEMV that reads its weight once; a 2048 x 2048 bf16 GEMV
runs at about half the HBM bandwidth on an H200 while larger ones come close to it, and every GEMM
is also one more kernel in the graph. Inductor does not do this by itself (its concat-linear
pattern needs freezing, which does not apply to Dynamo-lifted parameters). The compiled graph
holds the weights as constants, so the pass is for inference (weights fixed after compile).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from rlt_compile.passes.manager import PassContext, node_value

_LINEAR = (F.linear, torch._C._nn.linear, torch.ops.aten.linear.default)


def _weight_of(node: fx.Node):
    if node.op != "call_function" or node.target not in _LINEAR:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    weight, bias = node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
    if bias is not None or not isinstance(weight, fx.Node) or weight.op != "placeholder":
        return None
    return weight


class FuseLinearsPass:
    name = "fuse_linears"

    def __init__(self, min_group: int = 2):
        self.min_group = min_group
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}
        self._repoint: list[tuple[torch.nn.Parameter, torch.Tensor, int]] = []

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> str | None:
        real = ctx.placeholder_values(gm) if ctx.example_inputs is not None else None
        if real is None:
            return None
        groups: dict[fx.Node, list[fx.Node]] = {}
        for node in gm.graph.nodes:
            if _weight_of(node) is not None:
                groups.setdefault(node.args[0] if node.args else node.kwargs["input"], []).append(node)
        fused = 0
        merged = 0
        for x, nodes in groups.items():
            weights = [real.get(_weight_of(n)) for n in nodes]
            if len(nodes) < self.min_group or not all(
                isinstance(w, torch.nn.Parameter | torch.Tensor) for w in weights
            ):
                continue
            if len({(w.shape[1], w.dtype, w.device, w.dim()) for w in weights}) != 1 or weights[0].dim() != 2:
                continue
            w_cat = self._fused_weight(weights)
            attr = f"_rlt_fused_linear_{fused}"
            gm.register_buffer(attr, w_cat, persistent=False)
            if hasattr(gm, "_param_name_to_source"):  # AOTAutograd lifts buffers by their Dynamo source
                from torch._dynamo.source import ConstantSource

                gm._param_name_to_source[attr] = ConstantSource(attr)
            first = min(nodes, key=lambda n: list(gm.graph.nodes).index(n))
            with gm.graph.inserting_before(first):
                w_node = gm.graph.get_attr(attr)
                w_node.meta["example_value"] = _fake_like(node_value(_weight_of(first)), w_cat)
                y = gm.graph.call_function(F.linear, (x, w_node, None))
                part_value = node_value(first)
                if isinstance(part_value, torch.Tensor):  # later passes read shapes from the meta
                    y.meta["example_value"] = part_value.new_empty((*part_value.shape[:-1], w_cat.shape[0]))
                offset = 0
                for n, w in zip(nodes, weights):
                    part = gm.graph.call_function(torch.narrow, (y, -1, offset, w.shape[0]))
                    part.meta = dict(n.meta)
                    n.replace_all_uses_with(part)
                    offset += w.shape[0]
            for n in nodes:
                gm.graph.erase_node(n)
            fused += 1
            merged += len(nodes)
        if not fused:
            return None
        gm.graph.eliminate_dead_code()
        return f"{merged} linears -> {fused} fused GEMMs (weights concatenated once, params re-pointed to views)"

    def _fused_weight(self, weights: list[torch.Tensor]) -> torch.Tensor:
        key = tuple(id(w) for w in weights)
        if key in self._cache:
            return self._cache[key]
        with torch.no_grad():
            w_cat = torch.cat([w.detach() for w in weights], dim=0)
        offset = 0
        for w in weights:
            if isinstance(w, torch.nn.Parameter):
                self._repoint.append((w, w_cat, offset))
            offset += w.shape[0]
        self._cache[key] = w_cat
        return w_cat

    def after_compile(self) -> None:
        """Store the weights once: re-point the parameters at views of the fused tensors. Called by
        the backend after Inductor compiled the graph (AOTAutograd still reads the original
        parameters while compiling)."""
        with torch.no_grad():
            for w, w_cat, offset in self._repoint:
                w.data = w_cat[offset : offset + w.shape[0]]
        self._repoint.clear()


def _fake_like(template, real: torch.Tensor):
    """A fake tensor shaped like ``real`` in ``template``'s fake mode (for node meta)."""
    mode = getattr(template, "fake_mode", None)
    if mode is None:
        return real
    return mode.from_tensor(real, static_shapes=True)
