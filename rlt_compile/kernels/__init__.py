"""Kernels: the attention custom ops, their torch references and the Triton paged kernels; the fused
residual-add + RMSNorm ops (``rmsnorm.py``); how every Triton kernel here is launched (``launch.py``)."""

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
