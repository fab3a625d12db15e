"""Running a model without the engine: full-sequence forward and greedy generation with a KV cache.

Used by tests, golden parity checks and the tiny examples; the engine (``rlt_compile.engine``)
is the serving path. Each sequence gets its own contiguous run of blocks.
"""

from __future__ import annotations

import torch

from rlt_compile.kernels.metadata import AttentionMetadata, build_metadata
from rlt_compile.models.base import LoopedLM


def _device(model: LoopedLM) -> torch.device:
    return next(model.parameters()).device


class SimpleKVCache:
    """A KV cache for a fixed set of sequences, each owning ``blocks_per_seq`` consecutive blocks."""

    def __init__(self, model: LoopedLM, num_seqs: int, max_len: int, block_size: int = 16, max_steps=None):
        self.block_size = block_size
        self.blocks_per_seq = -(-max_len // block_size)
        self.tables = [list(range(i * self.blocks_per_seq, (i + 1) * self.blocks_per_seq)) for i in range(num_seqs)]
        self.planes = model.allocate_kv_cache(num_seqs * self.blocks_per_seq, block_size, max_steps=max_steps)
        self.lengths = [0] * num_seqs

    def step_metadata(self, query_lens: list[int], device) -> AttentionMetadata:
        meta = build_metadata(query_lens, self.lengths, self.tables, self.block_size, device=device)
        self.lengths = [n + q for n, q in zip(self.lengths, query_lens)]
        return meta


def _flat_inputs(chunks: list[list[int]], starts: list[int], device):
    ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=device)
    pos = torch.tensor([s + i for c, s in zip(chunks, starts) for i in range(len(c))], dtype=torch.long, device=device)
    return ids, pos


@torch.no_grad()
def forward_sequences(model: LoopedLM, sequences: list[list[int]], block_size: int = 16, max_steps=None, **options):
    """Logits for every position of each sequence, run as one batch: (list of [L_i, V], details)."""
    device = _device(model)
    cache = SimpleKVCache(model, len(sequences), max(map(len, sequences)), block_size, max_steps)
    meta = cache.step_metadata([len(s) for s in sequences], device)
    ids, pos = _flat_inputs(sequences, [0] * len(sequences), device)
    out = model(ids, pos, cache.planes, meta, **options)
    logits, details = out if isinstance(out, tuple) else (out, None)
    return list(logits.split([len(s) for s in sequences])), details


@torch.no_grad()
def greedy_generate(
    model: LoopedLM,
    prompt: list[int],
    max_new_tokens: int,
    use_cache: bool = True,
    block_size: int = 16,
    max_steps=None,
    **options,
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits each was chosen from ([max_new_tokens, V]).

    With ``use_cache`` the prompt is prefilled once and each new token is one decode step;
    without it the whole sequence is recomputed for every token (the reference behaviour).
    """
    device = _device(model)
    tokens = list(prompt)
    step_logits = []
    cache = SimpleKVCache(model, 1, len(prompt) + max_new_tokens, block_size, max_steps) if use_cache else None
    for _ in range(max_new_tokens):
        if cache is not None:
            new = tokens[cache.lengths[0] :]
            start = cache.lengths[0]
            meta = cache.step_metadata([len(new)], device)
            planes = cache.planes
        else:
            new, start = tokens, 0
            tmp = SimpleKVCache(model, 1, len(tokens), block_size, max_steps)
            meta, planes = tmp.step_metadata([len(tokens)], device), tmp.planes
        ids, pos = _flat_inputs([new], [start], device)
        last = torch.tensor([len(new) - 1], device=device)
        logits = model(ids, pos, planes, meta, logits_indices=last, **options)
        step_logits.append(logits[0])
        tokens.append(int(logits[0].argmax()))
    return tokens[len(prompt) :], torch.stack(step_logits)
