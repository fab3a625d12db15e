"""FX passes over the graphs Dynamo captures, one pass per file, run in order by a PassManager.

* ``attention_swap``: ``rlt.attention`` -> the attention backend the Platform selects.
* ``dot_precision``: the ``precision`` argument of ``rlt.attention_triton`` from
  ``Platform.dot_precision`` ("ieee" on ROCm, "tf32" only on CUDA for fp32 when allowed).
* ``fuse_linears``: bias-free linears reading the same input (q/k/v, gate/up) -> one GEMM.
* ``fuse_rmsnorm`` (CUDA/ROCm only): each ``RMSNorm`` -> ``rlt.rmsnorm``, and a residual add
  between two norms -> one fused Triton op (``rlt.add_rmsnorm2`` for Ouro's sandwich norms,
  ``rlt.add_rmsnorm`` for pre-norm layers, ``rlt.add_rmsnorm_rmsnorm`` for Huginn): Inductor
  splits a norm fed by an extern GEMM into two kernels and does not fuse two dependent norms.
"""

from rlt_compile.passes.attention_swap import AttentionSwapPass
from rlt_compile.passes.dot_precision import DotPrecisionPass
from rlt_compile.passes.fuse_rmsnorm import FuseRMSNormPass
from rlt_compile.passes.manager import (
    DEFAULT_PASSES,
    GraphPass,
    PassContext,
    PassManager,
    PassRecord,
    build_passes,
    format_graph,
    pass_registry,
)

__all__ = [
    "DEFAULT_PASSES",
    "AttentionSwapPass",
    "DotPrecisionPass",
    "FuseRMSNormPass",
    "GraphPass",
    "PassContext",
    "PassManager",
    "PassRecord",
    "build_passes",
    "format_graph",
    "pass_registry",
]
