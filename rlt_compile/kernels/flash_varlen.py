"""Causal attention among one step's own tokens through PyTorch's bundled FlashAttention-2 (varlen).

The Triton prefill kernel reaches about half of FlashAttention's TFLOP/s on the H200
(docs/benchmarks.md), and at prefill most of the work is the new tokens attending to each other.
So for prefill and mixed batches the Triton backend splits attention in two
(``triton_attention._attention``): ``self_attention`` runs FlashAttention-2's varlen kernel
(``aten::_flash_attention_forward`` with the batch's ``query_start_loc`` as both cumulative
sequence offsets, causal) on this step's q/k/v, which gives every token's output and log-sum-exp
over the step's own keys; then the paged kernel attends to the cached prefix ``[0, context_len)``
only and merges the two by their sums of exp, in place. Sequences without a cached prefix (a fresh
prompt) skip the second part entirely.

Only PyTorch's own kernel is used (no ``flash_attn`` package): NVIDIA, compute capability >= 8.0,
fp16/bf16, head dims that are multiples of 8 up to 256, and ``torch.backends.cuda.flash_sdp_enabled()``
(``available``). ``self_attention_reference`` is the same computation in plain torch: the CPU
stand-in the interpreter tests use. Grid sizes come from shapes only: the longest sequence is
bounded by the number of tokens.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["available", "self_attention", "self_attention_reference"]


@functools.cache
def _device_ok(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (8, 0)


def available(q: torch.Tensor) -> bool:
    """Whether ``self_attention`` can run on ``q``'s device and dtype."""
    head_dim = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
        and torch.backends.cuda.flash_sdp_enabled()
        and _device_ok(q.device.index or 0)
    )


BACKENDS = {1: "flash", 2: "cudnn"}  # config ``flash_prefill`` values


def self_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    backend: str = "flash",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each sequence's tokens to the same sequence's tokens of this step:
    ``(out [T, H, D] in q's dtype, lse fp32 natural log with lse[h, t] at h * lse.stride(0) + t *
    lse.stride(1))``. Rows past ``query_start_loc[-1]`` (padding) are left unset. ``k``/``v``:
    ``[T, Hkv, D]``. ``backend``: "flash" (FlashAttention-2 varlen) or "cudnn" (cuDNN's ragged SDPA).
    CPU tensors take ``self_attention_reference``."""
    if not q.is_cuda:
        return self_attention_reference(q, k, v, query_start_loc, scale)
    num_tokens = q.shape[0]
    if backend == "cudnn":
        out, lse, *_ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, query_start_loc, query_start_loc, num_tokens, num_tokens, True, 0.0, True, False, scale=scale
        )
        return out, _lse_view(lse, q)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, query_start_loc, query_start_loc, num_tokens, num_tokens, 0.0, True, False, scale=scale
    )
    return out, lse


def _lse_view(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp as a ``[H, T]`` view, whichever of ``[H, T]`` / ``[T, H]`` / ``[T, H, 1]`` it came in."""
    num_tokens, num_heads = q.shape[:2]
    if lse.shape[:2] == (num_tokens, num_heads):
        return lse.reshape(num_tokens, num_heads).t()
    if lse.numel() == num_heads * num_tokens:
        return lse.reshape(num_heads, num_tokens)
    raise RuntimeError(f"unexpected log-sum-exp shape {tuple(lse.shape)} for q {tuple(q.shape)}")


def self_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``self_attention`` in plain torch (fp32 math, one loop over sequences; reads the offsets on
    the host). Padding rows come out as zeros."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((num_heads, num_tokens), float("-inf"), dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for lo, hi in zip(starts[:-1], starts[1:]):
        if hi <= lo:
            continue
        qs = q[lo:hi].float().transpose(0, 1)  # [H, n, D]
        ks = k[lo:hi].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[lo:hi].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * scale
        causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        lse[:, lo:hi] = torch.logsumexp(scores, dim=-1)
        out[lo:hi] = (torch.softmax(scores, dim=-1) @ vs).transpose(0, 1).to(q.dtype)
    return out, lse
