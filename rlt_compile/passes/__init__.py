"""FX passes over the graphs Dynamo captures, one pass per file, run in order by a PassManager.

* ``attention_swap``: ``rlt.attention`` -> the attention backend the Platform selects.
* ``dot_precision``: the ``precision`` argument of ``rlt.attention_triton`` from
  ``Platform.dot_precision`` ("ieee" on ROCm, "tf32" only on CUDA for fp32 when allowed).

No fusion pass is kept: Inductor already fuses residual add + RMSNorm (docs/compiler.md).
"""

from rlt_compile.passes.attention_swap import AttentionSwapPass
from rlt_compile.passes.dot_precision import DotPrecisionPass
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
    "GraphPass",
    "PassContext",
    "PassManager",
    "PassRecord",
    "build_passes",
    "format_graph",
    "pass_registry",
]
