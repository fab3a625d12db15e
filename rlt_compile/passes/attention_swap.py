"""attention_swap: rewrite every generic ``rlt.attention`` call to the Platform's attention backend.

Pattern: a ``call_function`` node whose target is ``torch.ops.rlt.attention`` (packet or
``.default``), i.e. the one attention op every model calls (design contract 1).
Rewrite: the same node, target ``kernels.backends.backend_op(name)`` where ``name`` is
``ctx.platform.select_attention_backend(ctx.attention_backend)`` ("triton" on CUDA/ROCm, "torch"
on the CPU, "triton" on the CPU under ``TRITON_INTERPRET=1``, or what ``RLT_ATTENTION_BACKEND`` /
the ``attention_backend`` option asks for). Arguments are made positional from the op schema;
backends whose schema has more arguments (the Triton op's trailing ``precision``) get their
defaults; the dot-precision pass then fills ``precision`` in. The node keeps its name and meta, so
users of its output are untouched. Nodes already calling a concrete backend are left alone.
"""

from __future__ import annotations

import torch
from torch import fx

from rlt_compile.kernels.backends import backend_op
from rlt_compile.passes.manager import PassContext, full_args, is_op, op_name


class AttentionSwapPass:
    name = "attention_swap"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> str | None:
        generic = torch.ops.rlt.attention.default
        nodes = [n for n in gm.graph.nodes if is_op(n, generic)]
        if not nodes:
            return None
        backend = ctx.platform.select_attention_backend(ctx.attention_backend)
        target = backend_op(backend)
        if target is generic:
            return None
        for node in nodes:
            args = full_args(node, generic._schema)
            extra = target._schema.arguments[len(args) :]
            for arg in extra:
                if not arg.has_default_value():
                    raise ValueError(f"attention backend {backend!r}: argument {arg.name!r} has no default")
                args.append(arg.default_value)
            node.target = target
            node.args = tuple(args)
            node.kwargs = {}
        return f"{len(nodes)} nodes rlt.attention -> {op_name(target)} (backend {backend!r} on {ctx.platform.kind})"
