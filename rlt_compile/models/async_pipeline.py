"""Asynchronous self-speculation for batch-1 Ouro decode: the token pipeline with no host in the loop.

The synchronous token pipeline (``DepthBatcher(pipeline_draft_step=0)``) reads every pass's result
on the host to decide which rows run next. Here the whole decision lives on the device, so the host
only replays one captured pass again and again, and reads the emitted tokens every few passes:
drafting the next token overlaps the verification of the current one inside the same pass, and the
GPU never waits for Python.

One pass runs ``T`` rows (``T`` = loop steps) of one sequence through one step of the shared stack:
row ``s`` is the token at position ``newest - s``, at loop step ``s`` (a step-folded cache gives
each step its own K/V plane, ``models/wavefront.py``). Rows ``s >= fill`` are padding. After the
pass, on the device:

* row 0's state gives the draft of the next token (Ouro's head on a 1-step state); it joins as the
  new row 0, and every other row moves one step deeper;
* when the pipeline is full (``fill == T``), row ``T-1`` finishes its last step: its token is final
  and is appended to the output. It verifies the draft its child (row ``T-2``) was started with:
  equal, the child's work stands; different, the child and every later row are dropped and the
  final token restarts alone at step 0 (``fill = 1``).

Every row attends only to K/V that its parent wrote in an earlier pass at the same step, so the
tokens are exactly those of plain greedy decoding at full depth. With every draft right a token
finishes every pass (``T`` times fewer passes); a wrong draft costs a refill of ``T - 1`` passes.
The pass has fixed shapes, so one CUDA/HIP graph captures it (``use_graphs``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlt_compile.kernels.metadata import AttentionMetadata
from rlt_compile.models.ouro import OuroForCausalLM
from rlt_compile.models.wavefront import folded_layers, step_metadata


class AsyncTokenPipeline:
    """Greedy batch-1 decode of one sequence; ``generate`` returns (tokens, stats dict).

    ``kv_caches``: a step-folded cache (``allocate_kv_cache(..., fold_steps=True)``) whose blocks
    ``table`` hold the sequence. ``draft_transform(draft, pass_index) -> draft`` (tensors) may
    alter drafts inside the pass (benchmarks use it to set the acceptance rate).
    """

    def __init__(
        self,
        model: OuroForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        table: list[int],
        max_new_tokens: int,
        use_graphs: bool | None = None,
        draft_transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        sync_every: int = 16,
    ):
        if model.family != "ouro":
            raise ValueError("the asynchronous token pipeline drafts with Ouro's per-step head")
        cfg = model.config
        self.steps = T = cfg.total_ut_steps
        if T < 2:
            raise ValueError("the token pipeline needs at least 2 loop steps")
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.folded = folded_layers(kv_caches, list(range(cfg.num_hidden_layers)))
        self.num_blocks = kv_caches[0].shape[1]
        self.capacity = len(table) * block_size
        self.draft_transform = draft_transform
        self.sync_every = max(1, int(sync_every))
        dev = self.device = kv_caches[0].device
        ref = self.folded[0]
        self.table = torch.tensor(table, dtype=torch.int32, device=dev)
        self.rows = torch.arange(T, device=dev)
        self.plane_offsets = (self.rows * self.num_blocks).to(torch.int32)
        self.query_starts = torch.arange(T + 1, device=dev)
        self.head_rows = torch.tensor([0, T - 1], device=dev)  # row 0 drafts, row T-1 may finish
        # device state of the pipeline (read and written by every pass)
        self.hidden = torch.zeros(T, cfg.hidden_size, dtype=ref.dtype, device=dev)  # row s's state after step s
        self.tokens = torch.zeros(T, dtype=torch.long, device=dev)  # token of the row at step s
        self.newest = torch.zeros((), dtype=torch.long, device=dev)  # position of row 0
        self.fill = torch.zeros((), dtype=torch.long, device=dev)  # rows in flight
        self.passes = torch.zeros((), dtype=torch.long, device=dev)
        self.count = torch.zeros((), dtype=torch.long, device=dev)  # tokens emitted
        self.accepted = torch.zeros((), dtype=torch.long, device=dev)
        self.max_new_tokens = max_new_tokens
        # tokens after the prefill's, and a last slot that absorbs the writes of passes emitting nothing
        self.out = torch.zeros(max_new_tokens + 1, dtype=torch.long, device=dev)
        if use_graphs is None:
            use_graphs = dev.type == "cuda"
        if use_graphs and "loop_step" not in vars(model):
            raise ValueError(
                "CUDA graphs of the token pipeline need the compiled model (rlt_compile.compile_model): the eager "
                "attention op reads its metadata on the host, which graph capture forbids"
            )
        self.use_graphs = use_graphs
        self.graph: torch.cuda.CUDAGraph | None = None

    # -- one pass (device only) ------------------------------------------------------------------
    def _metadata(self, positions: torch.Tensor, valid: torch.Tensor) -> AttentionMetadata:
        bs = self.block_size
        blocks = self.table[torch.div(positions, bs, rounding_mode="floor")].to(torch.long)
        slots = (blocks + self.plane_offsets.to(torch.long)) * bs + positions % bs
        slot_mapping = torch.where(valid, slots, -1)
        block_tables = self.table[None, :] + self.plane_offsets[:, None]
        seq_lens = torch.where(valid, positions + 1, 0).to(torch.int32)
        starts = torch.minimum(self.query_starts, self.fill).to(torch.int32)  # padding rows: no queries
        return AttentionMetadata(slot_mapping, block_tables, seq_lens, starts)

    def _pass(self) -> None:
        T, model = self.steps, self.model
        valid = self.rows < self.fill
        positions = (self.newest - self.rows).clamp(min=0)
        embedded, cos, sin = model.embed(self.tokens, positions)
        state = torch.cat([embedded[:1], self.hidden[: T - 1]])  # row s continues from row s-1's state
        out = model.loop_step(state, cos, sin, self.folded, self._metadata(positions, valid))
        self.hidden.copy_(out)
        picked = model.lm_head(out[self.head_rows]).float().argmax(-1)  # row 0's draft, row T-1's final
        draft, final = picked[0], picked[1]
        if self.draft_transform is not None:
            draft = self.draft_transform(draft, self.passes)
        full = self.fill == T
        accept = full & (final == self.tokens[T - 2])
        restart = full & ~accept
        # the final token of a full pipeline is emitted (the slot past the end absorbs the others)
        slot = torch.where(full, self.count, self.out.shape[0] - 1)
        self.out.index_copy_(0, slot.view(1), final.view(1))
        self.count.add_(full.long())
        self.accepted.add_(accept.long())
        head = torch.where(restart, final, draft)
        self.tokens.copy_(torch.cat([head.view(1), self.tokens[: T - 1]]))
        self.newest.copy_(torch.where(restart, self.newest - (T - 2), self.newest + 1))
        self.fill.copy_(torch.where(restart, torch.ones_like(self.fill), torch.clamp(self.fill + 1, max=T)))
        self.passes.add_(1)

    def _capture(self) -> None:
        from rlt_compile.graphs import capture_graph

        saved = [t.clone() for t in self._state()]
        self.graph, _ = capture_graph(self._pass, self.device)
        for t, value in zip(self._state(), saved):  # the warm-up ran passes: restore the start state
            t.copy_(value)

    def _state(self) -> list[torch.Tensor]:
        return [self.hidden, self.tokens, self.newest, self.fill, self.passes, self.count, self.accepted, self.out]

    # -- driving ---------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
        """Prefill ``prompt`` at full depth, then decode; returns (tokens, stats)."""
        if max_new_tokens > self.max_new_tokens:
            raise ValueError(f"max_new_tokens={max_new_tokens} exceeds the size this pipeline was built for")
        # positions up to len(prompt) + tokens + T - 1 (the deepest speculative row) need slots
        if len(prompt) + max_new_tokens + self.steps > self.capacity:
            raise ValueError(
                f"{len(prompt)} prompt + {max_new_tokens} new tokens (+{self.steps} in flight) exceed the "
                f"{self.capacity} slots of the block table"
            )
        dev = self.device
        table = self.table.tolist()
        meta = step_metadata([len(prompt)], [0], [table], [0], 0, self.block_size, dev)
        last = torch.tensor([len(prompt) - 1], device=dev)
        ids = torch.tensor(prompt, device=dev)
        logits = self.model(ids, torch.arange(len(prompt), device=dev), self.kv_caches, meta, last)
        first = logits[0].argmax()
        for t in self._state():
            t.zero_()
        self.tokens[0] = first
        self.newest.fill_(len(prompt))
        self.fill.fill_(1)
        if self.use_graphs and self.graph is None:
            self._capture()
        run = self.graph.replay if self.graph is not None else self._pass
        need = max_new_tokens - 1
        while need > 0:
            # at least one pass per missing token when every draft is right; read back in chunks
            for _ in range(min(need, self.sync_every)):
                run()
            need = max_new_tokens - 1 - int(self.count)
        tokens = [int(first), *self.out[: max_new_tokens - 1].tolist()]
        emitted = int(self.count)
        stats = {
            "passes": int(self.passes),
            "accepted": int(self.accepted),
            "verified": emitted,
            "acceptance": int(self.accepted) / emitted if emitted else 0.0,
        }
        return tokens, stats
