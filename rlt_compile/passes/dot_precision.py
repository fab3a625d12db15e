"""dot_precision: set the ``tl.dot`` input precision of every Triton attention call.

Pattern: a ``call_function`` node calling ``torch.ops.rlt.attention_triton`` (as left by the
attention-swap pass); its last argument is ``precision``.
Rewrite: ``precision = ctx.platform.dot_precision(dtype)`` where ``dtype`` is the KV cache's dtype
(the kernel casts q to it before every dot). That is "ieee" on ROCm always (ROCm's Triton rejects
tf32) and on the CPU interpreter, "tf32" only on CUDA for fp32 caches when
``torch.get_float32_matmul_precision()`` allows it, "ieee" otherwise. The decision lives in
``Platform.dot_precision`` (design contract 5); this pass only applies it per node.
"""

from __future__ import annotations

import torch
from torch import fx

from rlt_compile.passes.manager import PassContext, full_args, is_op, node_value


class DotPrecisionPass:
    name = "dot_precision"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> str | None:
        op = torch.ops.rlt.attention_triton.default
        schema = op._schema
        index = [a.name for a in schema.arguments].index("precision")
        settings: dict[tuple[str, str], int] = {}
        for node in gm.graph.nodes:
            if not is_op(node, op):
                continue
            args = full_args(node, schema)
            cache = node_value(args[3])
            dtype = cache.dtype if isinstance(cache, torch.Tensor) else torch.float32
            args[index] = ctx.platform.dot_precision(dtype)
            node.args = tuple(args)
            node.kwargs = {}
            key = (str(dtype).replace("torch.", ""), args[index])
            settings[key] = settings.get(key, 0) + 1
        if not settings:
            return None
        parts = [f"{n} nodes ({dt} cache) precision={p!r}" for (dt, p), n in sorted(settings.items())]
        return f"rlt.attention_triton on {ctx.platform.kind}: " + ", ".join(parts)
