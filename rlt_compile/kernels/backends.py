"""Attention backends: backend name -> the custom-op overload the attention-swap pass installs.

Every backend op has the signature of ``rlt::attention`` (the Triton one adds a trailing
``precision`` argument). "flash" is only a name here: it needs the ``flash_attn`` package (NVIDIA
only) and a registered ``rlt::attention_flash`` op; asking for it without them is a clear error.
"""

from __future__ import annotations

import importlib.util

import torch

from rlt_compile.kernels import (
    ops,  # noqa: F401  (registers rlt::attention_torch)
    triton_attention,  # noqa: F401  (registers rlt::attention_triton)
)

ATTENTION_BACKENDS: dict[str, torch._ops.OpOverload] = {
    "torch": torch.ops.rlt.attention_torch.default,
    "triton": torch.ops.rlt.attention_triton.default,
}

# Backends that exist only when an optional package is importable: name -> package.
OPTIONAL_BACKENDS: dict[str, str] = {"flash": "flash_attn"}

BACKEND_NAMES: tuple[str, ...] = (*ATTENTION_BACKENDS, *OPTIONAL_BACKENDS)


class BackendUnavailableError(ValueError):
    """A known backend that cannot run here (its package is missing)."""


def backend_op(name: str) -> torch._ops.OpOverload:
    """The op overload of backend ``name``; ValueError for unknown names, BackendUnavailableError
    for "flash" without ``flash_attn`` (checked with ``find_spec``, nothing is imported)."""
    if name in ATTENTION_BACKENDS:
        return ATTENTION_BACKENDS[name]
    if name in OPTIONAL_BACKENDS:
        package = OPTIONAL_BACKENDS[name]
        if importlib.util.find_spec(package) is None:
            raise BackendUnavailableError(
                f"attention backend {name!r} needs the {package!r} package (NVIDIA GPUs only), which is not "
                f"installed; use one of {sorted(ATTENTION_BACKENDS)}"
            )
        try:
            return getattr(torch.ops.rlt, f"attention_{name}").default
        except (AttributeError, RuntimeError) as exc:
            raise BackendUnavailableError(
                f"attention backend {name!r}: {package!r} is installed but no rlt::attention_{name} op is registered"
            ) from exc
    raise ValueError(f"unknown attention backend {name!r}; valid: {list(BACKEND_NAMES)}")
