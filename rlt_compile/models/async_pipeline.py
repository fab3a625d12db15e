"""Asynchronous self-speculation for batch-1 decode: the token pipeline with no host in the loop.

The synchronous token pipeline (``DepthBatcher(pipeline_draft_step=0)``) reads every pass's result
on the host to decide which rows run next. Here the whole decision lives on the device, so the host
only replays one captured pass again and again, and reads the emitted tokens every few passes:
drafting the next token overlaps the verification of the current one inside the same pass, and the
GPU never waits for Python.

One pass runs ``T`` rows (``T`` = loop steps; Huginn: recurrences) of one sequence through one step
of the shared loop body: row ``s`` is the token at position ``newest - s``, at step ``s`` (a
step-folded cache gives each step its own K/V plane, ``models/wavefront.py``). Rows ``s >= fill``
are padding. After the pass, on the device:

* row 0's 1-step state gives the draft of the next token (the family's own output head on it); the
  draft joins as the new row 0, and every other row moves one step deeper;
* when the pipeline is full (``fill == T``), row ``T-1`` finishes its last step: its token is final
  and is appended to the output. It verifies the draft its child (row ``T-2``) was started with:
  equal, the child's work stands; different, the child and every later row are dropped and the
  final token restarts alone at step 0 (``fill = 1``).

Every row attends only to K/V that its parent wrote in an earlier pass at the same step, so the
tokens are exactly those of plain greedy decoding at full depth. With every draft right a token
finishes every pass (``T`` times fewer passes); a wrong draft costs a refill of ``T - 1`` passes.
The pass has fixed shapes, so one CUDA/HIP graph captures it (``use_graphs``).

The core is family-neutral; a family supplies three hooks (``_StackHooks``: Ouro, Nanbeige;
``_HuginnHooks``): the state of the row entering at step 0, one step for all rows, and the output
logits of the two head rows (row 0's draft, row ``T-1``'s final token).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlt_compile.kernels.metadata import AttentionMetadata
from rlt_compile.models.base import LoopedLM
from rlt_compile.models.layers import rope_cos_sin
from rlt_compile.models.wavefront import folded_layers, step_metadata

MetaFn = Callable[[], AttentionMetadata]


class _StackHooks:
    """Ouro and Nanbeige: a row's state is the stream after its loop steps (each ends with the
    final norm); the head is Ouro's ``lm_head`` / Nanbeige's ``head`` on a state."""

    carries = False  # no per-row input besides the state

    def __init__(self, model: LoopedLM, kv_caches: list[torch.Tensor]):
        self.model = model
        self.steps = model.config.loops
        self.width = model.config.hidden_size
        self.core = folded_layers(kv_caches, list(range(model.config.num_hidden_layers)))

    def prefill_options(self, prompt_len: int, new_tokens: int) -> dict:
        return {}

    def enter(self, tokens: torch.Tensor, positions: torch.Tensor, first_meta: MetaFn):
        """(state of the row entering at step 0 [1, d], its carry (none), cos, sin of every row)."""
        embedded, cos, sin = self.model.embed(tokens, positions)
        return embedded[:1], None, cos, sin

    def step(self, state, carry, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.loop_step(state, cos, sin, self.core, meta)

    def logits(self, states, rows, cos, sin, meta: MetaFn) -> torch.Tensor:
        """fp32 logits of ``states`` (the rows ``rows`` after this pass's step)."""
        if self.model.family == "ouro":  # full depth without early exit: the last step's state
            return self.model.lm_head(states).float()
        return self.model.head(states)


class _HuginnHooks:
    """Huginn: a row carries its prelude output ``e`` (re-injected by every recurrence) besides its
    state; the entering row runs the prelude, the head rows run the coda (which attends to the coda
    K/V of earlier positions: final ones for the verifying row, a mix for the draft)."""

    carries = True

    def __init__(self, model: LoopedLM, kv_caches: list[torch.Tensor], num_steps, init_scale, capacity: int):
        c = model.config
        p, cd, core = c.n_layers_in_prelude, c.n_layers_in_coda, c.n_layers_in_recurrent_block
        self.model, self.init_scale = model, 1.0 if init_scale is None else init_scale
        self.steps = num_steps or model.default_steps
        self.width = c.n_embd
        cached = (len(kv_caches) - p - cd) // core
        if self.steps > cached:
            raise ValueError(f"num_steps: {self.steps} exceeds the {cached} recurrences the cache holds")
        self.prelude_caches, self.coda_caches = kv_caches[:p], kv_caches[p : p + cd]
        self.core = folded_layers(kv_caches, [p + cd + j for j in range(core)])
        ref = next(model.parameters())
        # the initial recurrent state of the token at each position (see prefill_options)
        self.init_states = torch.zeros(capacity, c.n_embd, dtype=ref.dtype, device=kv_caches[0].device)

    def prefill_options(self, prompt_len: int, new_tokens: int) -> dict:
        """Draw the initial states as plain greedy decoding does: one ``initial_state`` call for the
        prompt, then one per decode step. ``initial_state`` reads only the shape, dtype and device
        of its argument, so the same calls consume the generator identically and give the same
        states; decode token ``i`` (position ``prompt_len + i``) gets the ``i``-th single draw.
        Positions past the last emitted token's input stay zero (their tokens are never emitted)."""
        states, model, scale = self.init_states, self.model, self.init_scale
        states.zero_()
        states[:prompt_len] = model.initial_state(states[:prompt_len], scale)
        for i in range(new_tokens - 1):
            pos = prompt_len + i
            states[pos : pos + 1] = model.initial_state(states[pos : pos + 1], scale)
        return {"num_steps": self.steps, "input_states": states[:prompt_len]}

    def enter(self, tokens, positions, first_meta: MetaFn):
        cos, sin = rope_cos_sin(positions, self.model.inv_freq)
        e, _, _ = self.model.prelude(tokens[:1], positions[:1], self.prelude_caches, first_meta())
        return self.init_states.index_select(0, positions[:1]), e, cos, sin

    def step(self, state, carry, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.loop_step(state, carry, cos, sin, self.core, meta)

    def logits(self, states, rows, cos, sin, meta: MetaFn) -> torch.Tensor:
        return self.model.coda(states, cos[rows], sin[rows], self.coda_caches, meta(), None)[0]


def _sample(probs: torch.Tensor) -> torch.Tensor:
    """One index drawn from ``probs`` (last dim) on the device, no host sync (exponential race)."""
    return torch.argmax(probs / torch.empty_like(probs).exponential_(), dim=-1)


class AsyncTokenPipeline:
    """Batch-1 decode of one sequence, greedy or sampled; ``generate`` returns (tokens, stats dict).

    ``temperature > 0`` samples instead (each pass's draws from the default generator, seed it with
    ``torch.manual_seed``): the draft is drawn from the 1-step distribution ``q``, and a finishing
    row accepts its child's draft ``x`` with probability ``min(1, p(x) / q(x))`` (``p``: its
    full-depth distribution), else emits a token drawn from ``max(p - q, 0)`` normalised and
    restarts from it: standard speculative sampling, so every token follows ``p`` exactly.

    ``kv_caches``: a step-folded cache (``allocate_kv_cache(..., fold_steps=True)``) whose blocks
    ``table`` hold the sequence. ``draft_transform(draft, pass_index) -> draft`` (tensors) may
    alter drafts inside the pass (benchmarks use it to set the acceptance rate). Huginn only:
    ``num_steps`` (recurrences, default the config's) and ``init_scale`` (the forward option, default
    1.0: random initial states drawn as plain greedy decoding draws them; 0: zero states).
    """

    def __init__(
        self,
        model: LoopedLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        table: list[int],
        max_new_tokens: int,
        use_graphs: bool | None = None,
        draft_transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        sync_every: int = 16,
        num_steps: int | None = None,
        init_scale: float | None = None,
        temperature: float = 0.0,
    ):
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if temperature > 0 and draft_transform is not None:
            raise ValueError("draft_transform is for greedy pipelines (a sampled draft keeps its distribution)")
        self.temperature = float(temperature)
        self.capacity = len(table) * block_size
        if model.family == "huginn":
            self.hooks = _HuginnHooks(model, kv_caches, num_steps, init_scale, self.capacity)
        elif model.family in ("ouro", "nanbeige"):
            if num_steps is not None or init_scale is not None:
                raise ValueError("num_steps and init_scale are Huginn options")
            self.hooks = _StackHooks(model, kv_caches)
        else:
            raise ValueError(f"the asynchronous token pipeline has no hooks for family {model.family!r}")
        self.steps = T = self.hooks.steps
        if T < 2:
            raise ValueError("the token pipeline needs at least 2 loop steps")
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.num_blocks = kv_caches[0].shape[1]
        self.draft_transform = draft_transform
        self.sync_every = max(1, int(sync_every))
        dev = self.device = kv_caches[0].device
        ref = next(model.parameters())
        self.table = torch.tensor(table, dtype=torch.int32, device=dev)
        self.rows = torch.arange(T, device=dev)
        self.plane_offsets = (self.rows * self.num_blocks).to(torch.int32)
        self.query_starts = torch.arange(T + 1, device=dev)
        self.head_rows = torch.tensor([0, T - 1], device=dev)  # row 0 drafts, row T-1 may finish
        self.single_plane = torch.zeros(2, dtype=torch.int32, device=dev)  # prelude / coda layers
        # device state of the pipeline (read and written by every pass)
        self.hidden = torch.zeros(T, self.hooks.width, dtype=ref.dtype, device=dev)  # row s's state after step s
        self.carry = torch.zeros_like(self.hidden) if self.hooks.carries else None  # Huginn: row s's e
        self.tokens = torch.zeros(T, dtype=torch.long, device=dev)  # token of the row at step s
        self.newest = torch.zeros((), dtype=torch.long, device=dev)  # position of row 0
        self.fill = torch.zeros((), dtype=torch.long, device=dev)  # rows in flight
        self.passes = torch.zeros((), dtype=torch.long, device=dev)
        self.count = torch.zeros((), dtype=torch.long, device=dev)  # tokens emitted
        self.accepted = torch.zeros((), dtype=torch.long, device=dev)
        # sampled: the draft distribution of the token of the row at step s (fp32, vocabulary wide)
        vocab = model.vocab_size
        self.draft_probs = torch.zeros(T, vocab, device=dev) if self.temperature > 0 else None
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
    def _metadata(self, positions, valid, offsets, count) -> AttentionMetadata:
        """One sequence per row, row ``i`` on the K/V plane at block offset ``offsets[i]``; the
        ``count`` valid rows come first (padding rows: no slot, no queries)."""
        bs = self.block_size
        blocks = self.table[torch.div(positions, bs, rounding_mode="floor")].to(torch.long)
        slots = (blocks + offsets.to(torch.long)) * bs + positions % bs
        slot_mapping = torch.where(valid, slots, -1)
        block_tables = self.table[None, :] + offsets[:, None]
        seq_lens = torch.where(valid, positions + 1, 0).to(torch.int32)
        starts = torch.clamp(self.query_starts[: len(positions) + 1], max=count).to(torch.int32)
        return AttentionMetadata(slot_mapping, block_tables, seq_lens, starts)

    def _pass(self) -> None:
        T, hooks = self.steps, self.hooks
        valid = self.rows < self.fill
        positions = (self.newest - self.rows).clamp(min=0)
        full = self.fill == T
        one_plane = self.single_plane
        first_meta = lambda: self._metadata(positions[:1], valid[:1], one_plane[:1], 1)  # noqa: E731
        first, first_carry, cos, sin = hooks.enter(self.tokens, positions, first_meta)
        state = torch.cat([first, self.hidden[: T - 1]])  # row s continues from row s-1's state
        carry = None if first_carry is None else torch.cat([first_carry, self.carry[: T - 1]])
        out = hooks.step(state, carry, cos, sin, self._metadata(positions, valid, self.plane_offsets, self.fill))
        self.hidden.copy_(out)
        if carry is not None:
            self.carry.copy_(carry)
        rows = self.head_rows
        head_meta = lambda: self._metadata(positions[rows], valid[rows], one_plane, 1 + full.long())  # noqa: E731
        logits = hooks.logits(out[rows], rows, cos, sin, head_meta)  # row 0's draft, row T-1's final
        if self.draft_probs is not None:
            draft, final, accept = self._speculative_sample(logits, full)
        else:
            picked = logits.argmax(-1)
            draft, final = picked[0], picked[1]
            if self.draft_transform is not None:
                draft = self.draft_transform(draft, self.passes)
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

    def _speculative_sample(self, logits: torch.Tensor, full: torch.Tensor):
        """(draft, final, accept) of a sampled pass; ``final`` is the token a full pipeline emits:
        the child's draft when accepted, else a draw from the residual ``max(p - q, 0)``."""
        T = self.steps
        q, p = torch.softmax(logits / self.temperature, dim=-1).unbind(0)
        draft = _sample(q)
        x = self.tokens[T - 2]  # the child's token: drafted from the distribution kept for its row
        q_child = self.draft_probs[T - 2]
        px, qx = p.gather(0, x.view(1))[0], q_child.gather(0, x.view(1))[0]
        accept = full & (torch.rand((), device=p.device) * qx <= px)
        residual = (p - q_child).clamp(min=0.0)
        mass = residual.sum()
        residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p)
        final = torch.where(accept, x, _sample(residual))
        self.draft_probs.copy_(torch.cat([q[None], self.draft_probs[: T - 1]]))
        return draft, final, accept

    def _capture(self) -> None:
        from rlt_compile.graphs import capture_graph

        saved = [t.clone() for t in self._state()]
        self.graph, _ = capture_graph(self._pass, self.device)
        for t, value in zip(self._state(), saved):  # the warm-up ran passes: restore the start state
            t.copy_(value)

    def _state(self) -> list[torch.Tensor]:
        optional = [t for t in (self.carry, self.draft_probs) if t is not None]
        return [
            self.hidden,
            *optional,
            self.tokens,
            self.newest,
            self.fill,
            self.passes,
            self.count,
            self.accepted,
            self.out,
        ]

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
        options = self.hooks.prefill_options(len(prompt), max_new_tokens)
        logits = self.model(ids, torch.arange(len(prompt), device=dev), self.kv_caches, meta, last, **options)
        if self.temperature > 0:
            first = _sample(torch.softmax(logits[0] / self.temperature, dim=-1))
        else:
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
