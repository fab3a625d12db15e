"""Scheduler: which sequences run in the next step, and how many of their tokens.

Continuous batching under a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``). Running sequences go first, in policy order: a decode costs one token, an
unfinished (chunked) prefill takes as much of the remaining budget as it needs. Waiting sequences
are then admitted in policy order (FCFS: arrival; priority: lower value first, then arrival),
starting after any prefix-cache hit, their prefill chunked to fit the budget. Under FCFS with
``admission_batch = k`` they wait until ``k`` slots are free (or fewer wait, or nothing runs), so
their prefills share a step (depth batching frees slots one by one).

When the pool runs out of blocks, the least urgent running sequence is preempted by recompute:
its blocks are freed and it goes back to the waiting queue keeping its generated tokens, to be
prefilled again (from prompt + output, often partly from the prefix cache) later. Under the
priority policy a waiting sequence also preempts a strictly less urgent running one when there is
no room for it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from rlt_compile.engine.block_manager import BlockManager
from rlt_compile.engine.config import EngineConfig
from rlt_compile.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens computed for each sequence this step
    preempted: list[Sequence] = field(default_factory=list)
    # self-speculation: seq_id -> draft tokens whose KV slots were reserved this step (decodes only)
    lookahead: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_tokens)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)

    def remove(self, seq: Sequence) -> int:
        i = self.seqs.index(seq)
        self.seqs.pop(i)
        return self.num_tokens.pop(i)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int | None = None):
        self.config = config
        self.max_model_len = max_model_len
        self.policy = config.scheduling_policy
        self.bm = block_manager
        self.waiting: list[Sequence] = []  # kept sorted by policy key
        self.running: list[Sequence] = []
        self.admission_batch = config.admission_batch or (
            max(1, config.max_num_seqs // 4) if config.depth_batching else 1
        )

    # -- queues --------------------------------------------------------------------------------
    def _key(self, seq: Sequence) -> tuple:
        return seq.policy_key(self.policy)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence from the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.num_preemptions += 1
        batch.preempted.append(seq)
        self.add(seq)

    def lookahead(self, seq: Sequence) -> int:
        """Draft tokens ``seq`` may speculate this step (0: plain decode).

        Only decodes (one uncomputed token) of requests without logprobs, penalties, logit bias or
        per-request depth options speculate; never past ``max_tokens`` or ``max_model_len``.
        """
        k = self.config.speculative_num_draft
        if not k or seq.num_uncomputed_tokens != 1:
            return 0
        p = seq.params
        if p.logprobs is not None or p.adjusts_logits or p.has_depth_options:
            return 0
        k = min(k, p.max_tokens - seq.num_output_tokens - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - len(seq))
        return max(k, 0)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=self._key)
        queue = list(self.running)  # still to consider, most urgent first
        while queue and budget > 0:
            seq = queue.pop(0)
            n = min(seq.num_uncomputed_tokens, budget)
            target = seq.num_computed_tokens + n
            k = self.lookahead(seq)
            if k and self.bm.can_grow(seq, target + k):
                self.bm.grow(seq, target + k)  # KV slots for the drafts (rejected ones are overwritten later)
                batch.lookahead[seq.seq_id] = k
            while not self.bm.can_grow(seq, target):
                victim = queue.pop() if queue else seq
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                self.bm.grow(seq, target)
                batch.add(seq, n)
                budget -= n
        if not batch.preempted:
            budget = self._admit(batch, budget)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> int:
        """Move waiting sequences into the batch while budget, sequence slots and blocks last."""
        chunked = self.config.enable_chunked_prefill
        if self.policy == "fcfs" and self.running and self.admission_batch > 1:
            free = self.config.max_num_seqs - len(self.running)
            if free < min(self.admission_batch, sum(seq.ready() for seq in self.waiting)):
                return budget
        i = 0
        while i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            if not seq.ready():
                i += 1
                continue
            matched = [] if seq.prompt_logprobs_pending else self.bm.match_prefix(seq.token_ids)
            remaining = len(seq) - len(matched) * self.bm.block_size
            if remaining > budget and not chunked and batch.seqs:
                break  # whole prefills only; an empty batch takes it even over budget
            n = min(remaining, budget) if chunked else remaining
            if len(self.running) >= self.config.max_num_seqs or not self.bm.can_admit(seq, matched, n):
                refund = self._preempt_for(seq, batch)
                if refund is None:
                    break
                budget += refund
                continue  # room, budget and matches changed: retry the same sequence
            self.waiting.pop(i)
            self.bm.admit(seq, matched)
            self.bm.grow(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        return budget

    def _preempt_for(self, seq: Sequence, batch: ScheduledBatch) -> int | None:
        """Priority policy: preempt the least urgent running sequence if it is less urgent than ``seq``.

        Returns the budget tokens given back (the victim may already be in this step's batch), or
        None when nothing was preempted.
        """
        if self.policy != "priority" or not self.running:
            return None
        victim = max(self.running, key=self._key)
        if victim.priority <= seq.priority:
            return None
        refund = batch.remove(victim) if victim in batch.seqs else 0
        self._preempt(victim, batch)
        return refund
