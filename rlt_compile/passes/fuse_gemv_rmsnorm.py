"""fuse_gemv_rmsnorm: a fused residual-add + RMSNorm folded into the decode GEMV that produces its input.

Pattern (after ``fuse_rmsnorm`` and ``gemv_swap``)::

    y = rlt.linear_small(x, W)                               # an o_proj / down_proj, read only here
    h, out = rlt.<mode>(y, residual, *weights, *eps)         # mode: add_rmsnorm, add_rmsnorm2,
                                                             #       add_rmsnorm_rmsnorm

(for ``add_rmsnorm`` and ``add_rmsnorm_rmsnorm``, whose first step is the commutative ``y +
residual``, ``y`` may also be the second operand). Rewrite: ``h, out = rlt.linear_norm_small(x, W,
residual, weights, eps, mode)``.

Why: at batch-1 decode the norm is a one-row kernel between two GEMVs, twice per layer application
(Ouro-1.4B: 192 launches per token, each latency-bound). In the GEMV the norm runs in the grid's last
program, once every program has stored its columns (an arrival counter, ``kernels/gemv.py``): the
same rounding as ``kernels/rmsnorm.py``, one launch fewer. For more rows or off CUDA the op falls back
to ``rlt.linear_small`` and the norm op, the kernels the graph had.
"""

from __future__ import annotations

import torch
from torch import fx

from rlt_compile.passes.manager import PassContext, is_op

_COMMUTATIVE_ADD_FIRST = ("add_rmsnorm", "add_rmsnorm_rmsnorm")


class FuseGemvRMSNormPass:
    name = "fuse_gemv_rmsnorm"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> str | None:
        import rlt_compile.kernels.gemv  # noqa: F401  (registers torch.ops.rlt.*linear_small)

        rlt = torch.ops.rlt
        linear_small = rlt.linear_small.default
        modes = {"add_rmsnorm": 1, "add_rmsnorm2": 2, "add_rmsnorm_rmsnorm": 2}  # mode -> norm weights
        fused = 0
        for norm in list(gm.graph.nodes):
            mode = next((m for m in modes if is_op(norm, getattr(rlt, m).default)), None)
            if mode is None or norm.kwargs:
                continue
            y, residual = norm.args[:2]
            if mode in _COMMUTATIVE_ADD_FIRST and not is_op(y, linear_small) and is_op(residual, linear_small):
                y, residual = residual, y
            if not is_op(y, linear_small) or len(y.users) != 1 or y.kwargs:
                continue
            count = modes[mode]
            weights, eps = list(norm.args[2 : 2 + count]), [float(e) for e in norm.args[2 + count :]]
            with gm.graph.inserting_before(norm):
                new = gm.graph.call_function(rlt.linear_norm_small.default, (*y.args, residual, weights, eps, mode))
            new.meta = dict(norm.meta)
            norm.replace_all_uses_with(new)
            gm.graph.erase_node(norm)
            gm.graph.erase_node(y)
            fused += 1
        if not fused:
            return None
        gm.recompile()
        return f"{fused} residual-add + RMSNorm folded into rlt.linear_norm_small (the norm in the GEMV's last program)"
