"""Kernels: the attention custom ops (``ops.py``; the backends the swap pass installs:
``backends.py``), their torch references (``reference.py``) and the Triton paged kernels
(``triton_attention.py``: the launchers and the unified kernel; ``decode_attention.py``,
``prefill_tma.py``, ``attention_common.py``; their shape rules in ``attention_config.py``, all in
docs/kernels.md); the decode GEMV (``gemv.py``); the fused residual-add + RMSNorm ops
(``rmsnorm.py``); how every Triton kernel here is launched (``launch.py``) and compiled ahead of
time for a GPU this machine lacks (``aot.py``)."""

from rlt_compile.kernels import (
    ops,  # noqa: F401  (registers torch.ops.rlt.*)
    rmsnorm,  # noqa: F401  (registers torch.ops.rlt.*rmsnorm*)
)
from rlt_compile.kernels.metadata import AttentionMetadata, build_metadata
from rlt_compile.kernels.triton_attention import (
    kv_write_triton,
    paged_attention_triton,
)  # registers rlt::attention_triton

__all__ = ["AttentionMetadata", "build_metadata", "kv_write_triton", "paged_attention_triton"]
