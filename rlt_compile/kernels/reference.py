"""Plain-torch reference implementations: paged KV write, paged attention, rotary.

These define the semantics every fast kernel is tested against (see ``metadata.py`` for the batch
layout). They read the metadata on the host, so they are for eager CPU runs and tests, not graphs.
"""

from __future__ import annotations

import torch


def kv_write_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``k``/``v`` rows [T, Hkv, D] into ``kv_cache`` [2, blocks, block_size, Hkv, D]."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat[0].index_copy_(0, slots, k[valid].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v[valid].to(kv_cache.dtype))


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` cached K and V rows of one sequence, each [length, Hkv, D]."""
    block_size = kv_cache.shape[2]
    positions = torch.arange(length, device=kv_cache.device)
    blocks = block_table.long()[positions // block_size]
    offsets = positions % block_size
    return kv_cache[0, blocks, offsets], kv_cache[1, blocks, offsets]


def paged_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its cached context (fp32 math)."""
    out = torch.zeros_like(q)
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0 or seq_len == 0:
            continue
        k, v = gather_context(kv_cache, block_tables[i], seq_len)
        k = k.float().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.float().repeat_interleave(group, dim=1)
        qi = q[q_start:q_end].float()  # [Q, H, D]
        scores = torch.einsum("qhd,shd->hqs", qi, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[q_start:q_end] = torch.einsum("hqs,shd->qhd", probs, v).to(q.dtype)
    return out


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend (the semantics of ``rlt::attention``)."""
    kv_write_reference(k, v, kv_cache, slot_mapping)
    return paged_attention_reference(q, kv_cache, block_tables, seq_lens, query_start_loc, scale)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary (Llama/Ouro/Nanbeige) on x [T, H, D], computed in x's dtype like HF.

    HF's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`` written per half: the same products
    and sums element by element, without concatenating cos/sin (Inductor materialises such a cat
    of graph inputs as separate kernels, four per layer)."""
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + (-x2) * sin, x2 * cos + x1 * sin], dim=-1)
