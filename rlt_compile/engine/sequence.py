"""Sequence: one completion being generated (a request with ``n > 1`` owns ``n`` of them).

A sequence holds its tokens (prompt then output), how many of them already have K/V in the cache
(``num_computed_tokens``), its block table, its incremental-detokenizer state and its private
``torch.Generator`` when the request is seeded. Preemption resets ``num_computed_tokens`` and the
block table but keeps the tokens: the sequence is recomputed later from prompt + output.
"""

from __future__ import annotations

import enum
import itertools

from rlt_compile.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class Sequence:
    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival: int = 0,
        parent: Sequence | None = None,
    ):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.arrival = arrival  # engine-wide admission counter: FCFS order
        self.parent = parent  # n > 1: siblings wait until the first one has its prompt cached
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at the last admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full, computed blocks registered so far
        self.num_preemptions = 0
        self.generator = None  # torch.Generator for seeded requests, made by the sampler on first use
        self.logprobs: list[dict[int, float]] = []
        # prompt_logprobs: one entry per prompt token computed so far, None for the first token, which
        # nothing predicts (every completion of the request computes them: whichever emits first has them)
        wants_prompt = params.prompt_logprobs is not None
        self.prompt_logprobs: list[dict[int, float] | None] | None = [None] if wants_prompt else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # incremental detokenization / streaming state
        self.text = ""
        self.prefix_offset = self.read_offset = -1  # indices into token_ids, set by the first detokenize_step
        self.sent_tokens = 0
        self.sent_text = 0
        self.sent_logprobs = 0
        self.sent_finish = False

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Whether prompt tokens still need their logprobs (such a sequence takes no prefix-cache hit:
        the cached positions' logits would never be computed)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.index}, {self.status.value}, tokens={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def ready(self) -> bool:
        """Whether the scheduler may admit it (a sibling waits for the first one's prompt KV)."""
        p = self.parent
        return p is None or p.is_finished or p.num_computed_tokens >= p.num_prompt_tokens

    def policy_key(self, policy: str) -> tuple:
        """Sort key: smaller is more urgent (priority value first under the priority policy)."""
        if policy == "priority":
            return (self.priority, self.arrival, self.index, self.seq_id)
        return (self.arrival, self.index, self.seq_id)
