"""Sampler: next tokens for a batch of logits rows, each row with its own SamplingParams.

Order of transforms (``adjust_logits``): repetition penalty (HF rule: positive logits divided,
negative multiplied, over every token of prompt and output), frequency and presence penalties
(OpenAI rule, over output tokens only: ``logit -= frequency * count + presence * (count > 0)``),
logit bias (added); then greedy rows take the argmax; random rows are divided
by their temperature, filtered by top-k, top-p and min-p, and sampled with the exponential race
``argmax(p / q), q ~ Exp(1)``. A seeded request draws its noise from its own ``torch.Generator``
(one draw of vocabulary size per token), so its tokens do not depend on what else is in the batch;
unseeded rows share the engine's generator. Logprobs, when asked for, are the model's
log-softmax (before penalties and temperature): the sampled token and the top ``logprobs``
(``logprob_entries``, which also gives the prompt tokens' logprobs of ``prompt_logprobs``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from rlt_compile.engine.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: {token id: logprob}, sampled token included


class Sampler:
    def __init__(self, device: torch.device | str, seed: int = 0):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def generator_for(self, seq: Sequence) -> torch.Generator:
        """The request's own generator when seeded, else the engine's shared one."""
        return self._seq_generator(seq) if seq.params.seed is not None else self.generator

    def _seq_generator(self, seq: Sequence) -> torch.Generator:
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed + seq.index)
        return seq.generator

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        logits = logits.float()
        params = [s.params for s in seqs]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        for row, seq in enumerate(seqs):
            if seq.params.adjusts_logits:
                logits[row] = adjust_logits(logits[row], seq)
        greedy = [p.temperature == 0.0 for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, seqs, greedy)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, logprob_entries(raw_logprobs, token_list, [p.logprobs for p in params]))

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool], make=None) -> torch.Tensor:
        """``make(values, dtype)`` builds the small per-row tensors (the async engine's device
        sampler passes a pinned, non-blocking one)."""
        make = make or _maker(logits.device)
        probs = filtered_probs(logits, [s.params for s in seqs], make)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seq in enumerate(seqs):
            if seq.params.seed is not None and not greedy[row]:
                noise[row].exponential_(generator=self._seq_generator(seq))
        sampled = (probs / noise.clamp_min(1e-20)).argmax(dim=-1)
        if any(greedy):
            sampled = torch.where(make(greedy, torch.bool), logits.argmax(dim=-1), sampled)
        return sampled


def logprob_entries(
    raw: torch.Tensor | None, tokens: list[int], counts: list[int | None]
) -> list[dict[int, float] | None]:
    """Per row of the log-softmax ``raw``: ``{token: logprob}`` of ``tokens[row]`` and the top
    ``counts[row]`` alternatives, or None where ``counts[row]`` is None."""
    if raw is None:
        return [None] * len(tokens)
    rows = [i for i, n in enumerate(counts) if n is not None]
    if not rows:
        return [None] * len(tokens)
    k = max(counts[i] for i in rows)
    sub = raw[rows]
    chosen = sub.gather(1, torch.tensor([tokens[i] for i in rows], device=raw.device)[:, None]).squeeze(1).tolist()
    top_vals, top_ids = sub.topk(k, dim=-1) if k > 0 else (sub[:, :0], sub[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out: list[dict[int, float] | None] = [None] * len(tokens)
    for j, i in enumerate(rows):
        n = counts[i]
        entry = {tokens[i]: chosen[j]}
        for tid, val in zip(top_ids[j][:n], top_vals[j][:n]):
            entry.setdefault(tid, val)
        out[i] = entry
    return out


def _maker(device: torch.device):
    return lambda values, dtype=None: torch.tensor(values, dtype=dtype, device=device)


def filtered_probs(logits: torch.Tensor, params: list, make=None) -> torch.Tensor:
    """Temperature, top-k, top-p, then min-p, one row per ``params`` entry (not renormalized after
    min-p: sampling by ``probs / exponential noise`` does not need it)."""
    make = make or _maker(logits.device)
    temps = make([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32)
    scaled = logits / temps[:, None]
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p for p in params]
    if any(top_k) or any(p < 1.0 for p in top_p):
        scaled = filter_top_k_top_p(scaled, top_k, top_p, make)
    probs = scaled.softmax(dim=-1)
    min_p = [p.min_p for p in params]
    if any(min_p):
        threshold = make(min_p, torch.float32)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def sampling_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """The distribution random sampling draws from (``filtered_probs`` renormalized), one row per
    ``params`` entry. Self-speculation applies it to draft and target rows."""
    probs = filtered_probs(logits.float(), params)
    return probs / probs.sum(dim=-1, keepdim=True)


def adjust_logits(row: torch.Tensor, seq: Sequence, make=None) -> torch.Tensor:
    """One row's logits after ``seq``'s penalties and logit bias (a new tensor); ``make`` as in
    ``filtered_probs``."""
    make = make or _maker(row.device)
    p = seq.params
    row = row.clone()
    if p.repetition_penalty != 1.0:
        ids = make(sorted(set(seq.token_ids)), torch.long)
        seen = row.index_select(0, ids)
        row.index_copy_(0, ids, torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty))
    counts = Counter(seq.output_token_ids) if p.presence_penalty or p.frequency_penalty else None
    if counts:
        ids = make(list(counts), torch.long)
        times = make(list(counts.values()), torch.float32)
        row.index_add_(0, ids, -(p.frequency_penalty * times + p.presence_penalty))
    if p.logit_bias:
        row.index_add_(0, make(list(p.logit_bias), torch.long), make(list(p.logit_bias.values()), torch.float32))
    return row


def filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float], make=None) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus to -inf (0 in ``top_k`` and 1.0 in ``top_p``: off)."""
    make = make or _maker(logits.device)
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = make([kk if 0 < kk < vocab else vocab for kk in top_k], torch.long)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    p = make(top_p, torch.float32)[:, None]
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    drop = before >= p
    drop[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
