"""Ouro (ByteDance LoopLM): the whole decoder stack applied ``total_ut_steps`` times.

Each layer uses "sandwich" norms (pre- and post-norm on both sublayers, inside the residual
branch). ``model.norm`` runs at the end of every loop step and its output feeds the next step and
the early-exit gate. Exit selection follows the reference: ``exit_at_step`` picks one step's hidden
state; otherwise the per-token cumulative exit probability is compared with ``exit_threshold``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlt_compile.kernels.metadata import AttentionMetadata
from rlt_compile.models.base import StackLoopedLM
from rlt_compile.models.config import LlamaKeys, config_from_dict, is_null
from rlt_compile.models.depth import check_kv_layout, fill_skipped_kv, is_decode_only, per_row
from rlt_compile.models.layers import Attention, RMSNorm, SwiGLU


@dataclass(frozen=True)
class OuroConfig(LlamaKeys):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 65536
    total_ut_steps: int = 4
    early_exit_threshold: float | None = 1.0
    early_exit_step: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, raw: dict) -> OuroConfig:
        cfg = config_from_dict(
            cls,
            raw,
            rejected={
                "rope_scaling": is_null,
                "use_sliding_window": False,
                "hidden_act": "silu",
            },
        )
        return cfg

    loops = property(lambda self: self.total_ut_steps)


class OuroDecoderLayer(nn.Module):
    def __init__(self, cfg: OuroConfig):
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = Attention(d, cfg.num_attention_heads, cfg.kv_heads, cfg.dim_per_head, cfg.attention_bias)
        self.mlp = SwiGLU(d, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.input_layernorm_2 = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm_2 = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, kv_cache, attn: AttentionMetadata):
        h = h + self.input_layernorm_2(self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, attn))
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class OuroModel(nn.Module):
    def __init__(self, cfg: OuroConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(OuroDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1, bias=True)


def exit_distribution(gate_logits: torch.Tensor, total_steps: int | None = None) -> torch.Tensor:
    """Per-step exit probabilities [steps, N] from gate logits [steps, N].

    Step ``t`` exits with ``sigmoid(gate_t)`` times the probability of surviving so far; the last of
    ``total_steps`` (default: all given) takes the remainder. Passing the gates of the first few
    steps with ``total_steps`` gives exactly the prefix of the full distribution.
    """
    steps = gate_logits.shape[0]
    total_steps = total_steps or steps
    pdf, remaining = [], torch.ones_like(gate_logits[0])
    for t in range(steps):
        lam = torch.sigmoid(gate_logits[t])
        if t < total_steps - 1:
            pdf.append(lam * remaining)
            remaining = remaining * (1.0 - lam)
        else:
            pdf.append(remaining)
    return torch.stack(pdf)


def threshold_exit_steps(pdf: torch.Tensor, threshold) -> torch.Tensor:
    """First step whose cumulative exit probability reaches ``threshold`` (else the last), per row.

    ``threshold`` is a float or a per-row tensor; it is compared in the pdf's dtype, as the
    reference compares its (model-dtype) cumulative sum with a Python float.
    """
    if isinstance(threshold, torch.Tensor):
        threshold = threshold.to(pdf.dtype)
    reached = torch.cumsum(pdf, dim=0) >= threshold
    first = torch.argmax(reached.float(), dim=0)
    return torch.where(reached.any(dim=0), first, torch.full_like(first, pdf.shape[0] - 1))


def batch_exit_step(exit_at_step, steps: int) -> int | None:
    """The step a whole "last-exited" decode batch exits at when the caller fixed one for every row
    (an int in range: no host reads, graph-safe), else None (each row exits where its policy says)."""
    return exit_at_step if isinstance(exit_at_step, int) and 0 <= exit_at_step < steps else None


def choose_exit_steps(gate_logits: torch.Tensor, fixed: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """The reference's rule per row: a valid fixed step wins, else the threshold rule (inf = never)."""
    steps = gate_logits.shape[0]
    by_threshold = threshold_exit_steps(exit_distribution(gate_logits), threshold)
    return torch.where((fixed >= 0) & (fixed < steps), fixed, by_threshold)


class OuroForCausalLM(StackLoopedLM):
    family = "ouro"
    compile_units = ("embed", "loop_step", "head")

    def __init__(self, cfg: OuroConfig):
        super().__init__(cfg, OuroModel(cfg))

    # -- compile units -------------------------------------------------------------------------

    def loop_step(self, h, cos, sin, kv_caches: list[torch.Tensor], attn: AttentionMetadata):
        """One pass of the shared stack, then the per-loop final norm."""
        return self.model.norm(self.run_layers(h, cos, sin, kv_caches, attn))

    def head(self, hs: torch.Tensor, exit_fixed: torch.Tensor, exit_threshold: torch.Tensor):
        """hs [steps, N, hidden], per-row fixed exit step (-1: none) and threshold (inf: none)
        -> (fp32 logits [N, V], gate logits [steps, N], chosen exit step [N])."""
        gate_logits = self.model.early_exit_gate(hs).squeeze(-1)
        exit_steps = choose_exit_steps(gate_logits, exit_fixed, exit_threshold)
        chosen = hs.gather(0, exit_steps[None, :, None].expand(1, -1, hs.shape[-1])).squeeze(0)
        return self.lm_head(chosen).float(), gate_logits, exit_steps

    def exit_policy(self, n: int, device, exit_at_step, exit_threshold) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row (fixed step, threshold) tensors; None falls back to the config like the reference."""
        if exit_at_step is None:
            exit_at_step = self.config.early_exit_step
        if exit_threshold is None:
            exit_threshold = self.config.early_exit_threshold
        fixed = per_row(exit_at_step, n, torch.long, device, fill=-1)
        threshold = per_row(exit_threshold, n, torch.float32, device, fill=float("inf"))
        return fixed, threshold

    # -- orchestration -------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
        *,
        num_steps: int | None = None,
        exit_at_step: int | torch.Tensor | None = None,
        exit_threshold: float | torch.Tensor | None = None,
        kv_layout: str = "delayed",
        return_details: bool = False,
    ):
        """``exit_at_step`` / ``exit_threshold`` may be per-row tensors (one value per logits row).

        ``kv_layout="delayed"`` computes every step (the reference's behaviour); ``"last-exited"``
        stops each decode row at its exit step and copies that step's K/V into the later slots;
        ``"shared"`` uses one K/V plane per layer for all steps (changes outputs; models/depth.py).
        """
        steps = num_steps or self.config.total_ut_steps
        check_kv_layout(kv_layout)
        shared = kv_layout == "shared"
        self.check_steps(1 if shared else steps, kv_caches)
        n_rows = input_ids.shape[0] if logits_indices is None else logits_indices.shape[0]
        fixed, threshold = self.exit_policy(n_rows, input_ids.device, exit_at_step, exit_threshold)
        if kv_layout == "last-exited":
            if not is_decode_only(input_ids, attn.seq_lens):
                raise ValueError("kv_layout='last-exited' needs a decode-only batch (one token per sequence)")
            if batch_exit_step(exit_at_step, steps) is not None:
                logits = self._forward_fixed_exit(input_ids, positions, kv_caches, attn, steps, exit_at_step)
                return (logits, {"exit_steps": torch.full_like(fixed, exit_at_step)}) if return_details else logits
            return self._forward_last_exited(
                input_ids, positions, kv_caches, attn, steps, fixed, threshold, return_details
            )
        h, cos, sin = self.embed(input_ids, positions)
        per_step = []
        for t in range(steps):
            h = self.loop_step(h, cos, sin, self.step_caches(kv_caches, t, shared), attn)
            per_step.append(self.select_rows(h, logits_indices))
        hs = torch.stack(per_step)
        logits, gate_logits, exit_steps = self.head(hs, fixed, threshold)
        if not return_details:
            return logits
        return logits, self._details(hs, gate_logits, exit_steps, steps)

    def _details(self, hs, gate_logits, exit_steps, total_steps) -> dict:
        return {
            "hidden_per_step": hs,
            "logits_per_step": self.lm_head(hs).float(),
            "gate_logits": gate_logits,
            "exit_pdf": exit_distribution(gate_logits, total_steps),
            "exit_steps": exit_steps,
        }

    def _forward_fixed_exit(self, input_ids, positions, kv_caches, attn, steps: int, k: int):
        """The whole decode batch exits at step ``k``: ``k + 1`` steps, no host reads (graph-safe)."""
        n = self.config.num_hidden_layers
        h, cos, sin = self.embed(input_ids, positions)
        for t in range(k + 1):
            h = self.loop_step(h, cos, sin, self.step_caches(kv_caches, t), attn)
        fill_skipped_kv(kv_caches, lambda step, layer: step * n + layer, n, k, steps, attn.slot_mapping)
        return self.lm_head(h).float()

    def _forward_last_exited(self, input_ids, positions, kv_caches, attn, steps, fixed, threshold, return_details):
        """Decode rows stop at their exit step; the loop ends once every row has exited."""
        n = self.config.num_hidden_layers
        h, cos, sin = self.embed(input_ids, positions)
        per_step, gates = [], []
        exit_steps = torch.full_like(fixed, steps - 1)
        active = torch.ones_like(fixed, dtype=torch.bool)
        for t in range(steps):
            h = self.loop_step(h, cos, sin, self.step_caches(kv_caches, t), attn)
            per_step.append(h)
            gates.append(self.model.early_exit_gate(h).squeeze(-1))
            pdf = exit_distribution(torch.stack(gates), steps)
            hit = torch.cumsum(pdf, dim=0)[-1] >= threshold.to(pdf.dtype) if t < steps - 1 else torch.ones_like(active)
            exits = active & torch.where((fixed >= 0) & (fixed < steps), fixed == t, hit)
            exit_steps = torch.where(exits, torch.full_like(exit_steps, t), exit_steps)
            active = active & ~exits
            # Stop once every row has exited: a host read, so not while capturing a graph (the
            # graph runs every step; rows past their exit are masked, the same result).
            capturing = h.is_cuda and torch.cuda.is_current_stream_capturing()
            if not capturing and not bool(active.any()):
                break
        hs = torch.stack(per_step)
        slot_of = lambda step, layer: step * n + layer  # noqa: E731
        fill_skipped_kv(kv_caches, slot_of, n, exit_steps, steps, attn.slot_mapping)
        chosen = hs.gather(0, exit_steps[None, :, None].expand(1, -1, hs.shape[-1])).squeeze(0)
        logits = self.lm_head(chosen).float()
        if not return_details:
            return logits
        return logits, self._details(hs, torch.stack(gates), exit_steps, steps)
