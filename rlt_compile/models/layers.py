"""Layers shared by every model family: RMSNorm, rotary embeddings, gated MLPs, paged attention.

Attention projects q/k/v, applies rotary, and calls the one attention op
(``torch.ops.rlt.attention``) with the KV plane of its (loop step, layer) slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import rlt_compile.kernels  # noqa: F401  (registers torch.ops.rlt.attention)
from rlt_compile.kernels.metadata import AttentionMetadata
from rlt_compile.kernels.reference import apply_rope_half


class RMSNorm(nn.Module):
    """``weight * normalize(x in fp32).to(dtype)``: the weight multiplies after the cast back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin of ``positions * inv_freq``, each [T, head_dim // 2]."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotary (Huginn): pairs (x[2i], x[2i+1]) rotate together, in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    c, s = cos[:, None, :], sin[:, None, :]
    real = pairs[..., 0] * c - pairs[..., 1] * s
    imag = pairs[..., 1] * c + pairs[..., 0] * s
    return torch.stack([real, imag], dim=-1).flatten(-2).to(x.dtype)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with separate gate/up projections (Ouro, Nanbeige)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedSwiGLU(nn.Module):
    """The same gated MLP with one fused ``fc`` (gate half first) and ``proj`` (Huginn)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(dim, 2 * hidden, bias=False)
        self.proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The single attention call every model makes (design contract 1)."""
    return torch.ops.rlt.attention(
        q, k, v, kv_cache, attn.slot_mapping, attn.block_tables, attn.seq_lens, attn.query_start_loc, scale
    )


class Attention(nn.Module):
    """Separate q/k/v/o projections, rotate-half rotary, paged attention (Ouro, Nanbeige)."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=bias)

    def forward(self, x, cos, sin, kv_cache, attn: AttentionMetadata):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rope_half(q, cos, sin), apply_rope_half(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, attn, self.scale)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class FusedQKVAttention(nn.Module):
    """Fused ``Wqkv``, learned additive q/k bias, interleaved rotary, ``proj`` (Huginn)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, qk_bias: bool):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = head_dim**-0.5
        self.Wqkv = nn.Linear(dim, 3 * num_heads * head_dim, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, num_heads, head_dim)) if qk_bias else None
        self.proj = nn.Linear(num_heads * head_dim, dim, bias=False)

    def forward(self, x, cos, sin, kv_cache, attn: AttentionMetadata):
        T = x.shape[0]
        q, k, v = self.Wqkv(x).view(T, 3, self.num_heads, self.head_dim).unbind(1)
        if self.qk_bias is not None:
            q, k = q + self.qk_bias[0], k + self.qk_bias[1]
        q, k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, attn, self.scale)
        return self.proj(out.reshape(T, self.num_heads * self.head_dim))
