"""Self-speculative decoding: a looped model's first loop steps are its own draft model.

Each round drafts ``num_draft`` tokens with ``draft_steps`` loop steps (Ouro/Nanbeige loop steps,
Huginn recurrences), then verifies the last accepted token plus all drafts with full depth in one
pass. Greedy mode accepts the longest prefix on which draft and target argmax agree; sampled mode
uses speculative rejection sampling, so the output distribution is the full model's. Drafting
only writes K/V for steps below ``draft_steps`` and the verify pass rewrites every step for its
positions; rejected positions are rolled back by shortening the sequence (their K/V is simply
overwritten later).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlt_compile.kernels.metadata import build_metadata
from rlt_compile.models.base import LoopedLM


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def draft_options(model: LoopedLM, draft_steps: int) -> dict:
    """Forward options that make the model its own draft: run only ``draft_steps`` steps."""
    if not 1 <= draft_steps < model.default_steps:
        raise ValueError(f"draft_steps must be in [1, {model.default_steps - 1}], got {draft_steps}")
    options = {"num_steps": draft_steps}
    if model.family == "ouro":
        options["exit_at_step"] = draft_steps - 1
    return options


def speculative_accept(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator=None
) -> list[int]:
    """Rejection sampling: K drafted tokens with draft probs [K, V] and target probs [K + 1, V] ->
    the emitted tokens (the accepted drafts, then one token from the residual or the bonus row)."""
    out: list[int] = []
    for i, token in enumerate(draft_tokens.tolist()):
        p, q = target_probs[i, token], draft_probs[i, token]
        u = torch.rand((), generator=generator, device=target_probs.device)
        if q > 0 and u <= torch.clamp(p / q, max=1.0):
            out.append(token)
            continue
        residual = torch.clamp(target_probs[i] - draft_probs[i], min=0)
        total = residual.sum()
        dist = residual / total if total > 0 else target_probs[i]
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[-1], 1, generator=generator)))
    return out


@torch.no_grad()
def self_speculative_generate(
    model: LoopedLM,
    prompt: list[int],
    max_new_tokens: int,
    num_draft: int = 4,
    draft_steps: int = 1,
    temperature: float = 0.0,
    seed: int | None = None,
    block_size: int = 16,
    **options,
) -> tuple[list[int], SpecStats]:
    """Generate ``max_new_tokens`` tokens; greedy when ``temperature == 0``."""
    device = next(model.parameters()).device
    draft_opts = {**options, **draft_options(model, draft_steps)}
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    max_len = len(prompt) + max_new_tokens + num_draft + 1
    table = list(range(-(-max_len // block_size)))
    planes = model.allocate_kv_cache(len(table), block_size)
    stats = SpecStats()

    def run(tokens: list[int], start: int, opts: dict) -> torch.Tensor:
        meta = build_metadata([len(tokens)], [start], [table], block_size, device=device)
        ids = torch.tensor(tokens, device=device)
        return model(ids, torch.arange(start, start + len(tokens), device=device), planes, meta, **opts)

    def probs(logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits / temperature, dim=-1)

    def pick(logits: torch.Tensor) -> int:
        if temperature == 0:
            return int(logits.argmax())
        return int(torch.multinomial(probs(logits), 1, generator=generator))

    out = [pick(run(prompt, 0, options)[-1])]
    computed = len(prompt)  # tokens whose K/V (every step) is in the cache
    while len(out) < max_new_tokens:
        stats.rounds += 1
        drafts, draft_logits = [], []
        last, pos = out[-1], computed
        for _ in range(num_draft):
            logits = run([last], pos, draft_opts)[0]
            last = pick(logits)
            drafts.append(last)
            draft_logits.append(logits)
            pos += 1
        verify = run([out[-1], *drafts], computed, options)  # [K + 1, V], full depth
        if temperature == 0:
            targets = verify.argmax(-1).tolist()
            n = 0
            while n < num_draft and drafts[n] == targets[n]:
                n += 1
            emitted = drafts[:n] + [targets[n]]
        else:
            emitted = speculative_accept(
                torch.tensor(drafts), probs(torch.stack(draft_logits)), probs(verify), generator
            )
            n = len(emitted) - 1
        stats.drafted += num_draft
        stats.accepted += n
        computed += n + 1  # the verified last token plus the accepted drafts
        out.extend(emitted)
    return out[:max_new_tokens], stats
