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
from rlt_compile.models.base import KVLayout, LoopedLM
from rlt_compile.models.config import config_from_dict, is_null
from rlt_compile.models.layers import Attention, RMSNorm, SwiGLU, rope_cos_sin, rope_inv_freq


@dataclass(frozen=True)
class OuroConfig:
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

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


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


def exit_distribution(gate_logits: torch.Tensor) -> torch.Tensor:
    """Per-step exit probabilities [steps, N] from gate logits [steps, N] (last step takes the rest)."""
    pdf, remaining = [], torch.ones_like(gate_logits[0])
    steps = gate_logits.shape[0]
    for t in range(steps):
        lam = torch.sigmoid(gate_logits[t])
        if t < steps - 1:
            pdf.append(lam * remaining)
            remaining = remaining * (1.0 - lam)
        else:
            pdf.append(remaining)
    return torch.stack(pdf)


def threshold_exit_steps(pdf: torch.Tensor, threshold: float) -> torch.Tensor:
    """First step whose cumulative exit probability reaches ``threshold`` (else the last), per row."""
    reached = torch.cumsum(pdf, dim=0) >= threshold
    first = torch.argmax(reached.float(), dim=0)
    return torch.where(reached.any(dim=0), first, torch.full_like(first, pdf.shape[0] - 1))


class OuroForCausalLM(LoopedLM):
    embedding_name = "model.embed_tokens.weight"
    family = "ouro"
    compile_units = ("embed", "loop_step", "head")

    def __init__(self, cfg: OuroConfig):
        super().__init__()
        self.config = cfg
        self.model = OuroModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("inv_freq", rope_inv_freq(cfg.dim_per_head, cfg.rope_theta), persistent=False)

    @property
    def ties_embeddings(self) -> bool:
        return self.config.tie_word_embeddings

    def rope_params(self) -> tuple[int, float]:
        return (self.config.dim_per_head, self.config.rope_theta)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    @property
    def default_steps(self) -> int:
        return self.config.total_ut_steps

    def kv_layout(self, max_steps: int | None = None) -> KVLayout:
        steps = max_steps or self.config.total_ut_steps
        return KVLayout(steps * self.config.num_hidden_layers, self.config.kv_heads, self.config.dim_per_head)

    # -- compile units -------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        return self.model.embed_tokens(input_ids), cos, sin

    def loop_step(self, h, cos, sin, kv_caches: list[torch.Tensor], attn: AttentionMetadata):
        """One pass of the shared stack, then the per-loop final norm."""
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer(h, cos, sin, kv_cache, attn)
        return self.model.norm(h)

    def head(self, hs: torch.Tensor, exit_at_step: int | None, exit_threshold: float | None):
        """hs: [steps, N, hidden] -> (fp32 logits [N, V], gate logits [steps, N], exit step [N])."""
        steps = hs.shape[0]
        gate_logits = self.model.early_exit_gate(hs).squeeze(-1)
        if exit_at_step is not None and 0 <= exit_at_step < steps:
            exit_steps = torch.full_like(gate_logits[0], exit_at_step, dtype=torch.long)
        elif exit_threshold is not None:
            exit_steps = threshold_exit_steps(exit_distribution(gate_logits), exit_threshold)
        else:
            exit_steps = torch.full_like(gate_logits[0], steps - 1, dtype=torch.long)
        chosen = hs.gather(0, exit_steps[None, :, None].expand(1, -1, hs.shape[-1])).squeeze(0)
        return self.lm_head(chosen).float(), gate_logits, exit_steps

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
        exit_at_step: int | None = None,
        exit_threshold: float | None = None,
        return_details: bool = False,
    ):
        steps = num_steps or self.config.total_ut_steps
        self.check_steps(steps, kv_caches)
        if exit_at_step is None:
            exit_at_step = self.config.early_exit_step
        if exit_threshold is None:
            exit_threshold = self.config.early_exit_threshold
        n = self.config.num_hidden_layers
        h, cos, sin = self.embed(input_ids, positions)
        per_step = []
        for t in range(steps):
            h = self.loop_step(h, cos, sin, kv_caches[t * n : (t + 1) * n], attn)
            per_step.append(self.select_rows(h, logits_indices))
        hs = torch.stack(per_step)
        logits, gate_logits, exit_steps = self.head(hs, exit_at_step, exit_threshold)
        if not return_details:
            return logits
        return logits, {
            "hidden_per_step": hs,
            "logits_per_step": self.lm_head(hs).float(),
            "gate_logits": gate_logits,
            "exit_pdf": exit_distribution(gate_logits),
            "exit_steps": exit_steps,
        }
