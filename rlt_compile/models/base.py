"""What every looped model exposes to the compiler and the engine.

A model's ``forward`` takes a flat batch of tokens (``input_ids``, ``positions``), the list of KV
planes (one per (loop step, layer) slot, each ``[2, num_blocks, block_size, kv_heads, head_dim]``),
the batch's ``AttentionMetadata`` and the rows to produce logits for, and returns fp32 logits.
It is plain Python that calls a few *compile units* (methods named in ``compile_units``): the
per-loop body is one of them and is called once per loop step, so ``compile_model`` compiles it
once however many steps run (design contract 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn


@dataclass(frozen=True)
class KVLayout:
    """Shape of a model's paged KV cache: one plane per slot, all sharing block ids."""

    num_slots: int
    num_kv_heads: int
    head_dim: int


class LoopedLM(nn.Module):
    """Base of every model family: forward over a flat batch and a paged KV cache (module docstring)."""

    family: ClassVar[str]
    compile_units: ClassVar[tuple[str, ...]]
    embedding_name: ClassVar[str]  # the input embedding weight that a tied lm_head shares

    config: object
    tokenizer: object | None = None

    # Each family's config exposes vocab_size, context_length, loops, tied and rope (dim, theta).
    @property
    def ties_embeddings(self) -> bool:
        return self.config.tied

    def rope_params(self) -> tuple[int, float]:
        """(rotary dim, theta) from which the non-persistent ``inv_freq`` buffer is rebuilt."""
        return self.config.rope

    def tied_names(self) -> set[str]:
        return {"lm_head.weight"} if self.ties_embeddings else set()

    def tie_weights(self) -> None:
        if self.ties_embeddings:
            self.lm_head.weight = self.get_parameter(self.embedding_name)

    def materialize_buffers(self, device: torch.device) -> None:
        from rlt_compile.models.layers import rope_inv_freq

        self.inv_freq = rope_inv_freq(*self.rope_params(), device=device)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_context(self) -> int:
        return self.config.context_length

    @property
    def default_steps(self) -> int:
        """Loop steps (or recurrences) a forward runs when the caller does not say."""
        return self.config.loops

    tp_size: int = 1  # tensor-parallel ranks sharing the heads (see rlt_compile/distributed.py)

    def full_kv_layout(self, max_steps: int | None = None) -> KVLayout:
        """The KV layout of the whole model (all heads)."""
        raise NotImplementedError

    def kv_layout(self, max_steps: int | None = None) -> KVLayout:
        """The KV layout this process holds: its share of the KV heads under tensor parallelism."""
        full = self.full_kv_layout(max_steps)
        return KVLayout(full.num_slots, full.num_kv_heads // self.tp_size, full.head_dim)

    def slot_steps(self, max_steps: int | None = None) -> list[tuple[int, int]]:
        """(layer, loop step) of every KV slot, in slot order; one layer's slots differ by step."""
        raise NotImplementedError

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        max_steps: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fold_steps: bool = False,
    ) -> list[torch.Tensor]:
        """One zeroed ``[2, num_blocks, block_size, kv_heads, head_dim]`` plane per slot.

        With ``fold_steps`` the planes of one layer are views into a single
        ``[2, steps * num_blocks, ...]`` tensor (step ``t`` owns blocks ``t*num_blocks ..``), so a pass
        whose rows sit at different loop steps can address every step's plane through block ids
        (see ``models/wavefront.py``). Each view's ``_base`` is that layer tensor.
        """
        layout = self.kv_layout(max_steps)
        ref = next(self.parameters())
        dtype = dtype or ref.dtype
        device = device or ref.device
        shape = (2, num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
        if not fold_steps:
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_slots)]
        slots = self.slot_steps(max_steps)
        depth: dict[int, int] = {}
        for layer, step in slots:
            depth[layer] = max(depth.get(layer, 0), step + 1)
        folded = {
            layer: torch.zeros((2, n * num_blocks, *shape[2:]), dtype=dtype, device=device)
            for layer, n in depth.items()
        }
        return [folded[layer][:, step * num_blocks : (step + 1) * num_blocks] for layer, step in slots]

    def check_steps(self, steps: int, kv_caches: list[torch.Tensor]) -> None:
        needed = self.kv_layout(steps).num_slots
        if steps < 1:
            raise ValueError(f"the number of loop steps must be >= 1, got {steps}")
        if len(kv_caches) < needed:
            raise ValueError(
                f"{steps} loop steps need {needed} KV slots but the cache has {len(kv_caches)}; "
                "allocate the cache with a larger max_steps"
            )

    @staticmethod
    def select_rows(h: torch.Tensor, logits_indices: torch.Tensor | None) -> torch.Tensor:
        return h if logits_indices is None else h.index_select(0, logits_indices)


class StackLoopedLM(LoopedLM):
    """A decoder whose whole layer stack runs ``config.loops`` times (Ouro, Nanbeige).

    Slot of loop step ``t``, layer ``l``: ``t * num_hidden_layers + l``. Subclasses build
    ``self.model`` (``embed_tokens``, ``layers``, ``norm``) and define ``loop_step`` and ``head``.
    """

    embedding_name = "model.embed_tokens.weight"

    def __init__(self, cfg, model: nn.Module):
        super().__init__()
        from rlt_compile.models.layers import rope_inv_freq

        self.config = cfg
        self.model = model
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("inv_freq", rope_inv_freq(*cfg.rope), persistent=False)

    def slot_steps(self, max_steps: int | None = None) -> list[tuple[int, int]]:
        n = self.config.num_hidden_layers
        return [(layer, t) for t in range(max_steps or self.config.loops) for layer in range(n)]

    def full_kv_layout(self, max_steps: int | None = None) -> KVLayout:
        cfg = self.config
        return KVLayout((max_steps or cfg.loops) * cfg.num_hidden_layers, cfg.kv_heads, cfg.dim_per_head)

    def step_caches(self, kv_caches: list[torch.Tensor], step: int, shared: bool = False) -> list[torch.Tensor]:
        """The KV planes of loop step ``step`` (step 0's for every step with the shared layout)."""
        n = self.config.num_hidden_layers
        first = 0 if shared else step * n
        return kv_caches[first : first + n]

    def run_layers(self, h, cos, sin, kv_caches: list[torch.Tensor], attn) -> torch.Tensor:
        """One pass of the shared stack (no final norm), each layer on its own KV plane."""
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer(h, cos, sin, kv_cache, attn)
        return h

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        from rlt_compile.models.layers import rope_cos_sin

        cos, sin = rope_cos_sin(positions, self.inv_freq)
        return self.model.embed_tokens(input_ids), cos, sin
