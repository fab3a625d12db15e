"""Attention metadata: the batch description every attention call receives as tensors.

A batch is a flat list of tokens from several sequences ("varlen" layout). Sequence ``i`` owns the
query rows ``query_start_loc[i]:query_start_loc[i+1]``; its context (cached tokens plus the new ones)
has ``seq_lens[i]`` tokens, so its first new token sits at position ``seq_lens[i] - query_len_i``.
Token ``t`` writes its K/V to the flat cache slot ``slot_mapping[t] = block * block_size + offset``
(negative = padding row, nothing written). ``block_tables[i, j]`` is the physical block holding the
sequence's tokens ``j*block_size .. (j+1)*block_size-1``; the same table serves every (loop step,
layer) KV plane. Padding sequences have query length 0 and ``seq_lens == 0``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class AttentionMetadata(NamedTuple):
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query offsets

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def to(self, device: torch.device | str) -> AttentionMetadata:
        return AttentionMetadata(*(t.to(device, non_blocking=True) for t in self))


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    pad_tokens_to: int | None = None,
    pad_seqs_to: int | None = None,
    pad_blocks_to: int | None = None,
) -> AttentionMetadata:
    """Build metadata on the host from per-sequence lists.

    ``context_lens[i]`` is the number of tokens already cached before this step; the sequence's
    new tokens occupy positions ``context_lens[i] .. context_lens[i] + query_lens[i] - 1``.
    Optional padding makes the tensors a fixed size (padding rows get slot -1, padding sequences
    query length 0).
    """
    if not (len(query_lens) == len(context_lens) == len(block_tables)):
        raise ValueError("query_lens, context_lens and block_tables must have one entry per sequence")
    slots: list[int] = []
    for q, c, table in zip(query_lens, context_lens, block_tables):
        for pos in range(c, c + q):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    num_tokens = len(slots)
    if pad_tokens_to is not None:
        if pad_tokens_to < num_tokens:
            raise ValueError(f"pad_tokens_to={pad_tokens_to} < {num_tokens} tokens")
        slots += [-1] * (pad_tokens_to - num_tokens)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    width = max([len(t) for t in block_tables] + [1])
    if pad_blocks_to is not None:
        width = max(width, pad_blocks_to)
    tables = [list(t) + [0] * (width - len(t)) for t in block_tables]
    if pad_seqs_to is not None:
        extra = pad_seqs_to - len(seq_lens)
        if extra < 0:
            raise ValueError(f"pad_seqs_to={pad_seqs_to} < {len(seq_lens)} sequences")
        seq_lens += [0] * extra
        starts += [starts[-1]] * extra
        tables += [[0] * width] * extra
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device).reshape(len(tables), width),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
    )
