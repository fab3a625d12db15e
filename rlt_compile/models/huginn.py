"""Huginn-0125 (RavenForCausalLM): prelude, a core block iterated r times, coda.

Blocks are "sandwich" blocks: the residual stream is renormalised after each sublayer. The
prelude output ``e`` is re-injected at every recurrence through ``adapter(cat[state, e])``. The
initial state is random (truncated normal, as the reference draws it) unless ``init_scale == 0``
or ``input_states`` is given. ``r`` is chosen per call. KV slots: prelude layers first, then coda
layers, then ``core_layers * r`` core slots (step s, core layer j -> P + Cd + s * C + j).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from rlt_compile.kernels.metadata import AttentionMetadata
from rlt_compile.models.base import KVLayout, LoopedLM
from rlt_compile.models.config import config_from_dict
from rlt_compile.models.depth import check_kv_layout, fill_skipped_kv, is_decode_only
from rlt_compile.models.layers import FusedQKVAttention, FusedSwiGLU, RMSNorm, rope_cos_sin, rope_inv_freq

EXIT_CRITERIA = ("latent-diff", "kl")


@dataclass(frozen=True)
class HuginnConfig:
    n_embd: int
    n_heads: int
    intermediate_size: int
    vocab_size: int
    n_layers_in_prelude: int
    n_layers_in_recurrent_block: int
    n_layers_in_coda: int
    padded_vocab_size: int | None = None
    mean_recurrence: int = 32
    qk_bias: bool = True
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    rope_base: float = 50_000.0
    block_size: int = 4096
    init_values: dict = field(default_factory=dict)
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, raw: dict) -> HuginnConfig:
        return config_from_dict(
            cls,
            raw,
            rejected={
                "injection_type": "linear",
                "bias": False,
                "test_time_noise": lambda v: not v,
                "nonlin_name": "SiLU",
                "num_key_value_heads": lambda v: v == raw.get("n_heads"),
            },
        )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_heads

    @property
    def vocab_rows(self) -> int:
        return self.padded_vocab_size or self.vocab_size

    @property
    def embed_scale(self) -> float:
        return float(self.init_values.get("embed_scale", math.sqrt(self.n_embd)))

    @property
    def init_std(self) -> float:
        return float(self.init_values.get("std", math.sqrt(2 / (5 * self.n_embd))))

    # the names LoopedLM reads (see models/base.py)
    context_length = property(lambda self: self.block_size)
    loops = property(lambda self: self.mean_recurrence)
    tied = property(lambda self: self.tie_embeddings)
    rope = property(lambda self: (self.head_dim, self.rope_base))


class SandwichBlock(nn.Module):
    def __init__(self, cfg: HuginnConfig):
        super().__init__()
        d = cfg.n_embd
        self.norm_1 = RMSNorm(d, cfg.norm_eps)
        self.attn = FusedQKVAttention(d, cfg.n_heads, cfg.head_dim, cfg.qk_bias)
        self.norm_2 = RMSNorm(d, cfg.norm_eps)
        self.mlp = FusedSwiGLU(d, cfg.intermediate_size)
        self.norm_3 = RMSNorm(d, cfg.norm_eps)
        self.norm_4 = RMSNorm(d, cfg.norm_eps)

    def forward(self, x, cos, sin, kv_cache, attn: AttentionMetadata):
        x = self.norm_2(self.attn(self.norm_1(x), cos, sin, kv_cache, attn) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)


class HuginnTransformer(nn.Module):
    def __init__(self, cfg: HuginnConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_rows, cfg.n_embd)
        self.prelude = nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_layers_in_prelude))
        self.adapter = nn.Linear(2 * cfg.n_embd, cfg.n_embd, bias=False)
        self.core_block = nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_layers_in_recurrent_block))
        self.coda = nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_layers_in_coda))
        self.ln_f = RMSNorm(cfg.n_embd, cfg.norm_eps)


class HuginnForCausalLM(LoopedLM):
    embedding_name = "transformer.wte.weight"
    family = "huginn"
    compile_units = ("prelude", "loop_step", "coda")

    def __init__(self, cfg: HuginnConfig):
        super().__init__()
        self.config = cfg
        self.transformer = HuginnTransformer(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_rows, bias=False)
        self.tie_weights()
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_base), persistent=False)

    def slot_steps(self, max_steps: int | None = None) -> list[tuple[int, int]]:
        c = self.config
        fixed = c.n_layers_in_prelude + c.n_layers_in_coda
        core = c.n_layers_in_recurrent_block
        steps = max_steps or c.mean_recurrence
        return [(i, 0) for i in range(fixed)] + [(fixed + j, i) for i in range(steps) for j in range(core)]

    def full_kv_layout(self, max_steps: int | None = None) -> KVLayout:
        c = self.config
        steps = max_steps or c.mean_recurrence
        slots = c.n_layers_in_prelude + c.n_layers_in_coda + c.n_layers_in_recurrent_block * steps
        return KVLayout(slots, c.n_heads, c.head_dim)

    def initial_state(self, e: torch.Tensor, init_scale: float) -> torch.Tensor:
        """The reference's draw: randn, then a truncated normal at ±3 std, scaled by the embed scale."""
        std = self.config.init_std * init_scale
        if std <= 0:
            return torch.zeros_like(e)
        x = torch.randn_like(e)
        torch.nn.init.trunc_normal_(x, mean=0.0, std=std, a=-3 * std, b=3 * std)
        return x * self.config.embed_scale

    # -- compile units -------------------------------------------------------------------------
    def prelude(self, input_ids, positions, kv_caches: list[torch.Tensor], attn: AttentionMetadata):
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        e = self.transformer.wte(input_ids) * self.config.embed_scale
        for block, kv_cache in zip(self.transformer.prelude, kv_caches):
            e = block(e, cos, sin, kv_cache, attn)
        return e, cos, sin

    def loop_step(self, s, e, cos, sin, kv_caches: list[torch.Tensor], attn: AttentionMetadata):
        """One recurrence: inject the prelude output, then the core block."""
        s = self.transformer.adapter(torch.cat([s, e], dim=-1))
        for block, kv_cache in zip(self.transformer.core_block, kv_caches):
            s = block(s, cos, sin, kv_cache, attn)
        return s

    def coda(self, s, cos, sin, kv_caches: list[torch.Tensor], attn: AttentionMetadata, logits_indices):
        latent = self.transformer.ln_f(s)
        x = latent
        for block, kv_cache in zip(self.transformer.coda, kv_caches):
            x = block(x, cos, sin, kv_cache, attn)
        x = self.transformer.ln_f(self.select_rows(x, logits_indices))
        return self.lm_head(x).float(), latent

    # -- orchestration -------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
        *,
        num_steps: int | torch.Tensor | None = None,
        init_scale: float = 1.0,
        input_states: torch.Tensor | None = None,
        exit_criterion: str | None = None,
        exit_threshold: float | None = None,
        min_steps: int = 1,
        kv_layout: str = "last-exited",
        return_details: bool = False,
    ):
        """``num_steps`` is the recurrence count r: an int, or one value per token (per-request r).

        With ``exit_criterion`` ("latent-diff": relative change of the state; "kl": KL divergence
        between successive output distributions) a decode token stops recurring once the criterion
        falls below ``exit_threshold`` (after at least ``min_steps``); ``kv_layout`` says what its
        skipped core slots hold (see ``models/depth.py``).
        """
        c = self.config
        per_token = isinstance(num_steps, torch.Tensor)
        steps = int(num_steps.max()) if per_token else (num_steps or c.mean_recurrence)
        check_kv_layout(kv_layout)
        shared = kv_layout == "shared"
        self.check_steps(1 if shared else steps, kv_caches)
        if exit_criterion is not None:
            if exit_criterion not in EXIT_CRITERIA:
                raise ValueError(f"exit_criterion: must be one of {EXIT_CRITERIA}, got {exit_criterion!r}")
            if exit_threshold is None or exit_threshold <= 0:
                raise ValueError(f"exit_threshold: must be > 0 with an exit criterion, got {exit_threshold!r}")
            if not is_decode_only(input_ids, attn.seq_lens):
                raise ValueError("exit_criterion needs a decode-only batch (prompt tokens run every recurrence)")
        p, cd, core = c.n_layers_in_prelude, c.n_layers_in_coda, c.n_layers_in_recurrent_block
        e, cos, sin = self.prelude(input_ids, positions, kv_caches[:p], attn)
        s = self.initial_state(e, init_scale) if input_states is None else input_states.to(e.dtype)
        base = p + cd
        coda_caches = kv_caches[p : p + cd]

        def core_caches(i: int) -> list[torch.Tensor]:
            first = base + (0 if shared else i * core)
            return kv_caches[first : first + core]

        if not per_token and exit_criterion is None:  # the plain path: every token runs r steps
            for i in range(steps):
                s = self.loop_step(s, e, cos, sin, core_caches(i), attn)
            logits, latent = self.coda(s, cos, sin, coda_caches, attn, logits_indices)
            return (logits, {"latent_states": latent}) if return_details else logits

        rows = input_ids.shape[0]
        row_steps = num_steps.to(input_ids.device).reshape(rows) if per_token else torch.full_like(input_ids, steps)
        exit_steps = row_steps - 1
        active = torch.ones_like(input_ids, dtype=torch.bool)
        output = s  # the state each row's coda reads (its state at its exit step)
        prev_logprobs = None
        for i in range(steps):
            new = self.loop_step(s, e, cos, sin, core_caches(i), attn)
            done = active & (row_steps == i + 1)
            if exit_criterion is not None and i + 1 >= min_steps:
                if exit_criterion == "latent-diff":
                    change = (new - s).float().norm(dim=-1) / new.float().norm(dim=-1).clamp_min(1e-30)
                else:
                    logprobs = torch.log_softmax(self.coda(new, cos, sin, coda_caches, attn, None)[0], dim=-1)
                    if prev_logprobs is None:
                        prev_logprobs = torch.full_like(logprobs, -math.log(logprobs.shape[-1]))
                    change = (prev_logprobs.exp() * (prev_logprobs - logprobs)).sum(-1)
                    prev_logprobs = logprobs
                done = done | (active & (change < exit_threshold))
            output = torch.where(active[:, None], new, output)
            exit_steps = torch.where(done, torch.full_like(exit_steps, i), exit_steps)
            # "delayed": exited rows keep recurring only to write their K/V; "last-exited": they stop.
            s = new if kv_layout == "delayed" else torch.where(active[:, None], new, s)
            active = active & ~done
            if not bool(active.any()):
                break
        if kv_layout == "last-exited" and exit_criterion is not None and not shared:
            slot_of = lambda step, layer: base + step * core + layer  # noqa: E731
            fill_skipped_kv(kv_caches, slot_of, core, exit_steps, steps, attn.slot_mapping)
        logits, latent = self.coda(output, cos, sin, coda_caches, attn, logits_indices)
        if not return_details:
            return logits
        return logits, {"latent_states": latent, "exit_steps": exit_steps}
