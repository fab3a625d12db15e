"""Nanbeige4.2: a Llama-shaped GQA decoder whose layers run ``num_loops`` times.

Every loop has its own KV slots (slot = loop * num_hidden_layers + layer) and ends with
``model.norm`` (unless ``skip_loop_final_norm``, in which case the norm runs once at the end).
Positions are the same in every loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from rlt_compile.kernels.metadata import AttentionMetadata
from rlt_compile.models.base import StackLoopedLM
from rlt_compile.models.config import LlamaKeys, config_from_dict, is_null
from rlt_compile.models.depth import check_kv_layout
from rlt_compile.models.layers import Attention, RMSNorm, SwiGLU


def _empty_list(value) -> bool:
    """an empty list (the research flag is off)"""
    return not value


@dataclass(frozen=True)
class NanbeigeConfig(LlamaKeys):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    num_loops: int = 2
    loop_loss_weights: list = field(default_factory=list)
    skip_loop_final_norm: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, raw: dict) -> NanbeigeConfig:
        return config_from_dict(
            cls,
            raw,
            rejected={
                "rope_scaling": lambda v: (
                    v is None or (isinstance(v, dict) and v.get("rope_type", v.get("type")) == "default")
                ),
                "hidden_act": "silu",
                "mlp_bias": False,
                "qk_layernorm": False,
                "loop_share_kv": False,
                "enable_double_loop_split": False,
                "use_sliding_window": False,
                "sliding_window": is_null,
            },
        )

    @property
    def loops(self) -> int:
        return len(self.loop_loss_weights) + 1 if self.loop_loss_weights else self.num_loops


class NanbeigeDecoderLayer(nn.Module):
    def __init__(self, cfg: NanbeigeConfig):
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = Attention(d, cfg.num_attention_heads, cfg.kv_heads, cfg.dim_per_head, cfg.attention_bias)
        self.mlp = SwiGLU(d, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, kv_cache, attn: AttentionMetadata):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class NanbeigeModel(nn.Module):
    def __init__(self, cfg: NanbeigeConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(NanbeigeDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class NanbeigeForCausalLM(StackLoopedLM):
    family = "nanbeige"
    compile_units = ("embed", "loop_step", "head")

    def __init__(self, cfg: NanbeigeConfig):
        super().__init__(cfg, NanbeigeModel(cfg))

    def loop_step(self, h, cos, sin, kv_caches: list[torch.Tensor], attn: AttentionMetadata):
        h = self.run_layers(h, cos, sin, kv_caches, attn)
        return h if self.config.skip_loop_final_norm else self.model.norm(h)

    def head(self, h: torch.Tensor):
        if self.config.skip_loop_final_norm:
            h = self.model.norm(h)
        return self.lm_head(h).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
        *,
        num_steps: int | None = None,
        kv_layout: str = "delayed",
        return_details: bool = False,
    ):
        """``kv_layout="shared"``: one K/V plane per layer for every loop (changes outputs)."""
        steps = num_steps or self.config.loops
        check_kv_layout(kv_layout)
        if kv_layout == "last-exited":
            raise ValueError("kv_layout: Nanbeige has no early exit; use 'delayed' or 'shared'")
        shared = kv_layout == "shared"
        self.check_steps(1 if shared else steps, kv_caches)
        h, cos, sin = self.embed(input_ids, positions)
        per_step = []
        for loop in range(steps):
            h = self.loop_step(h, cos, sin, self.step_caches(kv_caches, loop, shared), attn)
            if return_details:
                per_step.append(self.select_rows(h, logits_indices))
        logits = self.head(self.select_rows(h, logits_indices))
        if not return_details:
            return logits
        return logits, {"hidden_per_step": torch.stack(per_step)}
