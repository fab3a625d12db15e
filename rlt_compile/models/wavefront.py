"""Passes whose rows sit at different loop steps, and wavefront chunked prefill (WCPB) on them.

With a step-folded KV cache (``allocate_kv_cache(fold_steps=True)``) one layer's planes for every
loop step live in one tensor, step ``t`` owning blocks ``t * num_blocks ..``. A row at step ``t``
then reaches its step's plane through block ids offset by ``t * num_blocks`` (``step_metadata``),
so a single call of the shared loop body serves rows at any mix of steps: the weights are read
once for all of them.

Wavefront chunked prefill splits a prompt into chunks and runs pass ``p`` over every chunk ``c``
at step ``p - c``: chunk ``c`` at step ``j`` shares a pass with chunk ``c + 1`` at step ``j - 1``.
Chunk ``c + 1`` at step ``j - 1`` reads chunk ``c``'s step ``j - 1`` K/V, written one pass earlier,
so the result is the plain prefill's; ``C + T - 1`` larger passes replace ``C * T`` small ones.
"""

from __future__ import annotations

import torch

from rlt_compile.kernels.metadata import AttentionMetadata, build_metadata
from rlt_compile.models.base import LoopedLM


def step_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    steps: list[int],
    blocks_per_step: int,
    block_size: int,
    device,
) -> AttentionMetadata:
    """Metadata for rows at different loop steps of a step-folded cache (one entry per row group)."""
    tables = [[b + step * blocks_per_step for b in table] for table, step in zip(block_tables, steps)]
    return build_metadata(query_lens, context_lens, tables, block_size, device=device)


def folded_layers(kv_caches: list[torch.Tensor], first_slots: list[int]) -> list[torch.Tensor]:
    """The step-folded layer tensors behind the planes of ``first_slots`` (one slot per layer)."""
    layers = [kv_caches[slot]._base for slot in first_slots]
    if any(t is None for t in layers):
        raise ValueError("mixed-step passes need a step-folded cache: allocate_kv_cache(..., fold_steps=True)")
    return layers


@torch.no_grad()
def wavefront_prefill(
    model: LoopedLM,
    kv_caches: list[torch.Tensor],
    prompt: list[int],
    block_table: list[int],
    chunk_size: int,
    num_steps: int | None = None,
    start: int = 0,
    **options,
) -> torch.Tensor:
    """Prefill ``prompt`` in wavefront order; returns fp32 logits of its last token.

    ``prompt[:start]`` must already have K/V of every loop step in the cache (a prefix-cache hit or
    an earlier chunk); ``prompt[start:]`` is computed. ``kv_caches`` must be step-folded;
    ``options`` are the model's forward options (Ouro's exit policy, Huginn's ``init_scale``).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not 0 <= start < len(prompt):
        raise ValueError(f"start must be in [0, {len(prompt)}), got {start}")
    device = kv_caches[0].device
    num_blocks = kv_caches[0].shape[1]
    block_size = kv_caches[0].shape[2]
    steps = num_steps or model.default_steps
    model.check_steps(steps, kv_caches)
    n = len(prompt) - start  # rows below are relative to ``start``
    ids = torch.tensor(prompt[start:], device=device)
    positions = torch.arange(start, len(prompt), device=device)
    bounds = [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]
    whole = build_metadata([n], [start], [block_table], block_size, device=device)
    last = torch.tensor([n - 1], device=device)

    if model.family == "huginn":
        c = model.config
        p, cd, core = c.n_layers_in_prelude, c.n_layers_in_coda, c.n_layers_in_recurrent_block
        e, cos, sin = model.prelude(ids, positions, kv_caches[:p], whole)
        s0 = model.initial_state(e, options.get("init_scale", 1.0))
        layers = folded_layers(kv_caches, [p + cd + j for j in range(core)])
        final, _ = _wavefront(
            lambda h, rows, meta: model.loop_step(h, e[rows], cos[rows], sin[rows], layers, meta),
            s0, bounds, start, steps, block_table, num_blocks, block_size, device,
        )  # fmt: skip
        logits, _ = model.coda(final, cos, sin, kv_caches[p : p + cd], whole, last)
        return logits[0]

    layers = folded_layers(kv_caches, list(range(len(model.slot_steps(1)))))
    h0, cos, sin = model.embed(ids, positions)
    final, per_step_last = _wavefront(
        lambda h, rows, meta: model.loop_step(h, cos[rows], sin[rows], layers, meta),
        h0, bounds, start, steps, block_table, num_blocks, block_size, device,
    )  # fmt: skip
    if model.family == "ouro":
        fixed, threshold = model.exit_policy(1, device, options.get("exit_at_step"), options.get("exit_threshold"))
        hs = torch.stack(per_step_last)[:, None, :]
        return model.head(hs, fixed, threshold)[0][0]
    return model.head(final[last])[0]


def _wavefront(step_fn, h0, bounds, start, steps, table, num_blocks, block_size, device):
    """Run every (chunk, step) pair along wavefronts; returns (final states, last row per step).

    ``bounds`` are row ranges of ``h0``; row ``r`` sits at position ``start + r``."""
    state = {}  # chunk -> its rows' hidden state after its latest step
    final = torch.empty_like(h0)
    per_step_last: list[torch.Tensor] = [None] * steps
    last_chunk = len(bounds) - 1
    for wave in range(len(bounds) + steps - 1):
        active = [(c, wave - c) for c in range(len(bounds)) if 0 <= wave - c < steps]
        rows = torch.cat([torch.arange(*bounds[c], device=device) for c, _ in active])
        h = torch.cat([h0[slice(*bounds[c])] if step == 0 else state[c] for c, step in active])
        meta = step_metadata(
            [bounds[c][1] - bounds[c][0] for c, _ in active],
            [start + bounds[c][0] for c, _ in active],
            [table] * len(active),
            [step for _, step in active],
            num_blocks,
            block_size,
            device,
        )
        out = step_fn(h, rows, meta)
        offset = 0
        for c, step in active:
            size = bounds[c][1] - bounds[c][0]
            state[c] = out[offset : offset + size]
            if c == last_chunk:
                per_step_last[step] = state[c][-1]
            if step == steps - 1:
                final[slice(*bounds[c])] = state.pop(c)
            offset += size
    return final, per_step_last


__all__ = ["folded_layers", "step_metadata", "wavefront_prefill"]
