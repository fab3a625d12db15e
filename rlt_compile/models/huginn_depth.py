"""Continuous depth batching for Huginn decode: tokens at different recurrences share core passes.

Each pass runs three calls: the prelude for tokens entering the batch (their embedding ``e`` and
initial state), one core recurrence for every in-flight token (rows at any recurrence, through a
step-folded cache as in ``depth_batching.py``), and the coda for tokens that exit. A token exits
after its request's ``num_steps`` recurrences, or earlier when its adaptive criterion fires
(``exit_criterion="latent-diff"``: relative state change below ``exit_threshold`` after
``min_steps``); its skipped core slots get the exit step's K/V ("last-exited", the reference's
"latest" cache lookup). Each sequence gets the tokens the model's own per-token path gives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlt_compile.models.depth import fill_skipped_folded
from rlt_compile.models.huginn import HuginnForCausalLM
from rlt_compile.models.layers import rope_cos_sin
from rlt_compile.models.wavefront import folded_layers, step_metadata


@dataclass(eq=False)  # rows are compared by identity
class HuginnRow:
    seq_id: int
    table: list[int]
    position: int
    token: int
    num_steps: int
    exit_threshold: float | None = None
    min_steps: int = 1
    step: int = 0  # recurrences done
    state: torch.Tensor | None = None
    embedded: torch.Tensor | None = None  # the prelude output e, re-injected every recurrence


class HuginnDepthBatcher:
    def __init__(self, model: HuginnForCausalLM, kv_caches: list[torch.Tensor], block_size: int, init_scale=0.0):
        if model.family != "huginn":
            raise ValueError("HuginnDepthBatcher serves Huginn models")
        c = model.config
        self.model, self.kv_caches, self.block_size, self.init_scale = model, kv_caches, block_size, init_scale
        self.num_blocks = kv_caches[0].shape[1]
        self.prelude_n, self.coda_n, self.core_n = (
            c.n_layers_in_prelude,
            c.n_layers_in_coda,
            c.n_layers_in_recurrent_block,
        )
        self.base = self.prelude_n + self.coda_n
        self.max_steps = (len(kv_caches) - self.base) // self.core_n
        self.core = folded_layers(kv_caches, [self.base + j for j in range(self.core_n)])
        self.rows: list[HuginnRow] = []
        self.passes = 0
        self.early_exits = 0  # tokens stopped by their criterion before their num_steps

    @torch.no_grad()
    def add(self, seq_id, prompt, table, num_steps=None, exit_threshold=None, min_steps=1) -> int:
        """Prefill ``prompt`` with every recurrence; its first token joins the batch."""
        steps = num_steps or self.model.default_steps
        if steps > self.max_steps:
            raise ValueError(f"num_steps: {steps} exceeds the {self.max_steps} recurrences the cache holds")
        device = self.kv_caches[0].device
        meta = step_metadata([len(prompt)], [0], [table], [0], 0, self.block_size, device)
        last = torch.tensor([len(prompt) - 1], device=device)
        logits = self.model(torch.tensor(prompt, device=device), torch.arange(len(prompt), device=device),
                            self.kv_caches, meta, last, num_steps=steps, init_scale=self.init_scale)  # fmt: skip
        token = int(logits[0].argmax())
        self.rows.append(HuginnRow(seq_id, table, len(prompt), token, steps, exit_threshold, min_steps))
        return token

    def join(self, seq_id, token, position, table, num_steps=None, exit_threshold=None, min_steps=1) -> HuginnRow:
        """Add an in-flight row (recurrence 0) for a sequence whose positions ``< position`` are cached:
        ``token`` at ``position``, its slot already in ``table`` (the engine's depth batching)."""
        steps = num_steps or self.model.default_steps
        if steps > self.max_steps:
            raise ValueError(f"num_steps: {steps} exceeds the {self.max_steps} recurrences the cache holds")
        if self.has(seq_id):
            raise ValueError(f"sequence {seq_id} already has a token in flight")
        row = HuginnRow(seq_id, table, position, token, steps, exit_threshold, min_steps)
        self.rows.append(row)
        return row

    def has(self, seq_id: int) -> bool:
        return any(r.seq_id == seq_id for r in self.rows)

    def remove(self, seq_id: int) -> None:
        self.rows = [r for r in self.rows if r.seq_id != seq_id]

    def _meta(self, rows, steps):
        return step_metadata(
            [1] * len(rows), [r.position for r in rows], [r.table for r in rows], steps,
            self.num_blocks, self.block_size, self.kv_caches[0].device,
        )  # fmt: skip

    @torch.no_grad()
    def step(self) -> list[tuple[int, int]]:
        """One pass: prelude for new tokens, one recurrence for all, coda for those that exit."""
        rows = list(self.rows)
        if not rows:
            return []
        exiting, logits = self._pass(rows)
        emitted = []
        for r, row_logits in zip(exiting, logits if exiting else []):
            emitted.append((r.seq_id, int(row_logits.argmax())))
            r.token, r.position, r.step, r.state, r.embedded = emitted[-1][1], r.position + 1, 0, None, None
        return emitted

    @torch.no_grad()
    def advance(self, seq_ids=None) -> tuple[list[int], torch.Tensor | None]:
        """One pass over the rows of ``seq_ids`` (default: all) without continuing any sequence (the
        engine's depth batching): exiting rows fill their skipped core slots and leave the batch;
        returns (their seq ids, their coda logits) for the caller to sample from."""
        wanted = None if seq_ids is None else set(seq_ids)
        rows = [r for r in self.rows if wanted is None or r.seq_id in wanted]
        if not rows:
            return [], None
        exiting, logits = self._pass(rows)
        for r in exiting:
            self.rows.remove(r)
        return [r.seq_id for r in exiting], logits

    def _pass(self, rows: list[HuginnRow]) -> tuple[list[HuginnRow], torch.Tensor | None]:
        """Prelude for rows at recurrence 0, one recurrence for all, coda for the exiting ones
        (skipped core slots filled): (exiting rows, their logits)."""
        device = self.kv_caches[0].device
        model = self.model
        new = [r for r in rows if r.step == 0]
        if new:
            ids = torch.tensor([r.token for r in new], device=device)
            pos = torch.tensor([r.position for r in new], device=device)
            e, _, _ = model.prelude(ids, pos, self.kv_caches[: self.prelude_n], self._meta(new, [0] * len(new)))
            s0 = model.initial_state(e, self.init_scale)
            for i, r in enumerate(new):
                r.embedded, r.state = e[i], s0[i]
        positions = torch.tensor([r.position for r in rows], device=device)
        cos, sin = rope_cos_sin(positions, model.inv_freq)
        state = torch.stack([r.state for r in rows])
        embedded = torch.stack([r.embedded for r in rows])
        new_state = model.loop_step(state, embedded, cos, sin, self.core, self._meta(rows, [r.step for r in rows]))
        self.passes += 1
        change = (new_state - state).float().norm(dim=-1) / new_state.float().norm(dim=-1).clamp_min(1e-30)
        adaptive = [r.exit_threshold is not None and r.min_steps <= r.step + 1 < r.num_steps for r in rows]
        below = (
            (change < torch.tensor([r.exit_threshold or 0.0 for r in rows], device=device)).tolist()
            if any(adaptive)
            else []
        )
        exiting = []
        for i, r in enumerate(rows):
            done = r.step + 1 >= r.num_steps
            if adaptive[i]:
                done = bool(below[i])
                self.early_exits += done
            r.state = new_state[i]
            if done:
                exiting.append(r)
            else:
                r.step += 1
        if not exiting:
            return [], None
        meta = self._meta(exiting, [0] * len(exiting))
        idx = torch.tensor([rows.index(r) for r in exiting], device=device)
        logits, _ = model.coda(torch.stack([r.state for r in exiting]), cos[idx], sin[idx],
                               self.kv_caches[self.prelude_n : self.base], meta, None)  # fmt: skip
        self._fill_later_steps(exiting)
        return exiting, logits

    def _fill_later_steps(self, rows: list[HuginnRow]) -> None:
        """ "last-exited": each exiting row's K/V of its last recurrence into the cache's later ones."""
        exits = [(r.table, r.position, r.step) for r in rows]
        fill_skipped_folded(self.core, exits, self.max_steps, self.block_size, self.num_blocks)
