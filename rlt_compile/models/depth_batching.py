"""Continuous depth batching for Ouro decode: rows of one pass sit at different loop steps.

The shared stack serves every loop step, so one pass can advance token A from step 2 to 3 while
token B goes from 0 to 1: the weights are read once for both. A token leaves the batch at its exit
step (Ouro's policy: a fixed step, the gate's cumulative exit probability reaching a threshold, or
the last step), its sequence's next token joins at step 0 in the very next pass, and no row waits
for the slowest one. The KV cache is step-folded (``allocate_kv_cache(fold_steps=True)``): a row at
step ``t`` reaches its step's plane through block ids offset by ``t * num_blocks``. Skipped steps
use the "last-exited" layout (``models/depth.py``): the exit step's K/V is copied into the later
steps' slots of that position, so the next tokens of the sequence find every step filled.

Token pipeline (``pipeline_draft_step=d``): when a token reaches loop step ``d`` its hidden state
already gives a draft of the next token, which joins the batch at step 0 right away, one pass behind
its parent by ``d + 1`` steps: rows of the same sequence at different steps share the weight reads,
so batch-1 decode reads the weights once for two (or more) tokens. The child only reads K/V its parent
wrote in earlier passes. When the parent exits, its final token verifies the draft: equal, the child's
work stands; different, the child and its descendants are dropped and the verified token restarts at
step 0 (its K/V overwrites theirs). Greedy output is the same as without the pipeline. The pipeline
needs a fixed depth per sequence (``exit_at_step`` or full depth), so a child never exits before its
parent.

``DepthBatcher.depth_pass`` is a pure tensor function of fixed-shape inputs (token ids, carried
hidden states, a step-0 mask, positions, metadata), so a CUDA graph per padded batch bucket can
capture it with the per-row steps as data; the bookkeeping around it runs on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlt_compile.models.depth import fill_skipped_folded
from rlt_compile.models.ouro import OuroForCausalLM, exit_distribution
from rlt_compile.models.wavefront import folded_layers, step_metadata


@dataclass(eq=False)  # rows are compared by identity
class DepthRow:
    """One sequence's in-flight token."""

    seq_id: int
    table: list[int]
    position: int  # of the in-flight token
    token: int
    exit_at_step: int | None = None
    exit_threshold: float | None = None
    step: int = 0
    hidden: torch.Tensor | None = None
    gates: list[torch.Tensor] = field(default_factory=list)
    draft: bool = False  # the token is a draft its parent has not verified yet
    child: DepthRow | None = None  # the pipelined next token of the same sequence


class DepthBatcher:
    def __init__(
        self,
        model: OuroForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        pipeline_draft_step: int | None = None,
    ):
        if model.family != "ouro":
            raise ValueError("continuous depth batching needs an exit gate (Ouro)")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_blocks = kv_caches[0].shape[1]
        self.layers = model.config.num_hidden_layers
        self.steps = model.config.total_ut_steps
        self.folded = folded_layers(kv_caches, list(range(self.layers)))
        self.rows: list[DepthRow] = []
        self.passes = 0
        self.pipeline_draft_step = pipeline_draft_step
        self.drafts = self.accepted = 0
        self.graph_runner = None

    def capture_graphs(
        self, max_rows: int, max_blocks_per_seq: int, buckets=None, use_graphs=None, context_buckets=None
    ):
        """Run passes as one CUDA/HIP graph per padded batch bucket (``rlt_compile.graphs``).

        The per-row steps are data (block-id offsets in the metadata), so a bucket's graph serves
        any mix of steps; the carried states and step-0 mask live in static buffers the graph
        reads. ``use_graphs=False`` keeps the static buffers and padding without graphs (CPU).
        """
        from rlt_compile.graphs import CudaGraphRunner

        ref = self.folded[0]
        graphs = ref.device.type == "cuda" if use_graphs is None else use_graphs
        if graphs and "loop_step" not in vars(self.model):
            raise ValueError(
                "CUDA graphs of depth passes need the compiled model (rlt_compile.compile_model): the eager "
                "attention op reads its metadata on the host, which graph capture forbids"
            )
        self._carried = torch.zeros(max_rows, self.model.config.hidden_size, dtype=ref.dtype, device=ref.device)
        self._is_new = torch.zeros(max_rows, dtype=torch.bool, device=ref.device)
        runner = CudaGraphRunner(self._graph_step, self.kv_caches, max_rows, max_blocks_per_seq, buckets,
                                 use_graphs=use_graphs, context_buckets=context_buckets)  # fmt: skip
        self.graph_runner = runner.capture()
        return self.graph_runner

    def _graph_step(self, input_ids, positions, kv_caches, attn, logits_indices):
        """``depth_pass`` in the graph runner's step signature: [rows, hidden + 1] (state | gate)."""
        n = input_ids.shape[0]
        out, gates = self.depth_pass(input_ids, self._carried[:n], self._is_new[:n], positions, attn)
        return torch.cat([out, gates[:, None].to(out.dtype)], dim=-1)

    # -- admission -----------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, seq_id: int, prompt: list[int], table: list[int], exit_at_step=None, exit_threshold=None) -> int:
        """Prefill ``prompt`` at full depth; its first token (read at the policy's exit step) joins
        the batch at step 0. Returns that first token."""
        self._check_policy(exit_threshold)
        device = self.kv_caches[0].device
        meta = step_metadata([len(prompt)], [0], [table], [0], 0, self.block_size, device)
        last = torch.tensor([len(prompt) - 1], device=device)
        ids = torch.tensor(prompt, device=device)
        logits = self.model(ids, torch.arange(len(prompt), device=device), self.kv_caches, meta, last,
                            exit_at_step=exit_at_step, exit_threshold=exit_threshold)  # fmt: skip
        token = int(logits[0].argmax())
        self.join(seq_id, token, len(prompt), table, exit_at_step, exit_threshold)
        return token

    def join(self, seq_id: int, token: int, position: int, table: list[int], exit_at_step=None, exit_threshold=None):
        """Add an in-flight row at step 0 for a sequence whose positions ``< position`` are cached
        (every loop step's plane filled): ``token`` at ``position``, its slot already in ``table``.

        ``exit_at_step`` -1 and ``exit_threshold`` inf mean "none" (the engine's per-request policy
        resolution); None falls back to the model config like the model's forward."""
        self._check_policy(exit_threshold)
        if any(r.seq_id == seq_id for r in self.rows):
            raise ValueError(f"sequence {seq_id} already has a token in flight")
        row = DepthRow(seq_id, table, position, token, exit_at_step, exit_threshold)
        self.rows.append(row)
        return row

    def _check_policy(self, exit_threshold) -> None:
        if self.pipeline_draft_step is not None and exit_threshold is not None:
            raise ValueError("the token pipeline needs a fixed depth per sequence (exit_at_step or full depth)")

    def has(self, seq_id: int) -> bool:
        return any(r.seq_id == seq_id for r in self.rows)

    def remove(self, seq_id: int) -> None:
        self.rows = [r for r in self.rows if r.seq_id != seq_id]

    # -- one pass ------------------------------------------------------------------------------
    def depth_pass(self, tokens, carried, is_new, positions, meta):
        """Advance every row by one loop step: (normed hidden [R, H], gate logits [R])."""
        embedded, cos, sin = self.model.embed(tokens, positions)
        h = torch.where(is_new[:, None], embedded, carried)
        out = self.model.loop_step(h, cos, sin, self.folded, meta)
        return out, self.model.model.early_exit_gate(out).squeeze(-1)

    def _run_pass(self, rows: list[DepthRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the shared stack over ``rows`` (each at its own step): (states, gate logits)."""
        device = self.kv_caches[0].device
        meta = step_metadata(
            [1] * len(rows), [r.position for r in rows], [r.table for r in rows], [r.step for r in rows],
            self.num_blocks, self.block_size, device,
        )  # fmt: skip
        tokens = torch.tensor([r.token for r in rows], device=device)
        positions = torch.tensor([r.position for r in rows], device=device)
        is_new = torch.tensor([r.step == 0 for r in rows], device=device)
        width = self.model.config.hidden_size
        dtype = self.folded[0].dtype
        carried = torch.stack([r.hidden if r.hidden is not None else torch.zeros(width, dtype=dtype, device=device)
                               for r in rows])  # fmt: skip
        if self.graph_runner is not None and len(rows) <= self._carried.shape[0]:
            self._carried[: len(rows)] = carried
            self._is_new[: len(rows)] = is_new
            both = self.graph_runner(tokens, positions, meta)
            out, gates = both[:, :-1], both[:, -1]
        else:
            out, gates = self.depth_pass(tokens, carried, is_new, positions, meta)
        self.passes += 1
        return out, gates

    @torch.no_grad()
    def advance(self, seq_ids=None) -> tuple[list[int], torch.Tensor | None]:
        """One pass over the rows of ``seq_ids`` (default: all) without continuing any sequence:
        the engine's depth-batching step. Exiting rows fill their skipped steps' K/V and leave the
        batch; returns (their seq ids, fp32 logits [exits, V]) for the caller to sample from, and
        joins the next tokens itself (``join``). Needs no token pipeline."""
        if self.pipeline_draft_step is not None:
            raise ValueError("advance() drives rows without the token pipeline")
        wanted = None if seq_ids is None else set(seq_ids)
        rows = [r for r in self.rows if wanted is None or r.seq_id in wanted]
        if not rows:
            return [], None
        out, gates = self._run_pass(rows)
        exiting = [i for i, flag in enumerate(self._exit_flags(rows, gates)) if flag]
        self._fill_later_steps([rows[i] for i in exiting])
        for i, row in enumerate(rows):
            if i in exiting:
                self.rows.remove(row)
            else:
                row.step += 1
                row.hidden = out[i]
        if not exiting:
            return [], None
        return [rows[i].seq_id for i in exiting], self.model.lm_head(out[exiting]).float()

    @torch.no_grad()
    def step(self) -> list[tuple[int, int]]:
        """One pass over all in-flight rows; returns the (seq_id, token) pairs that became final."""
        rows = list(self.rows)
        if not rows:
            return []
        out, gates = self._run_pass(rows)
        exiting = {i for i, flag in enumerate(self._exit_flags(rows, gates)) if flag}
        self._fill_later_steps([rows[i] for i in sorted(exiting)])
        drafting = {
            i for i, r in enumerate(rows)
            if i not in exiting and r.step == self.pipeline_draft_step and r.child is None
        }  # fmt: skip
        heads = sorted(exiting | drafting)
        picked = dict(zip(heads, self.model.lm_head(out[heads]).float().argmax(-1).tolist())) if heads else {}
        emitted = []
        for i, row in sorted(enumerate(rows), key=lambda item: (item[1].seq_id, item[1].position)):
            if row not in self.rows:
                continue  # dropped in this pass with a rejected draft
            if i in exiting:
                emitted.append((row.seq_id, picked[i]))
                self._finish(row, picked[i])
            else:
                row.step += 1
                row.hidden = out[i]
                if i in drafting:
                    row.child = DepthRow(
                        row.seq_id, row.table, row.position + 1, picked[i], row.exit_at_step, draft=True
                    )
                    self.rows.append(row.child)
                    self.drafts += 1
        return emitted

    def _finish(self, row: DepthRow, token: int) -> None:
        """``row`` exited with ``token`` (its skipped steps filled): continue its sequence."""
        self.rows.remove(row)
        child = row.child
        if child is not None and child.token == token:
            child.draft = False  # verified: the pipelined work stands
            self.accepted += 1
            return
        while child is not None:  # rejected: drop the child and everything drafted after it
            self.rows.remove(child)
            child = child.child
        self.rows.append(DepthRow(row.seq_id, row.table, row.position + 1, token, row.exit_at_step, row.exit_threshold))

    def _exit_flags(self, rows: list[DepthRow], gates: torch.Tensor) -> list[bool]:
        """Ouro's rule for each row at its current step (the one the model's head applies). Fixed
        steps and the last step are decided on the host; threshold rows share one device computation
        and one host read per pass."""
        flags: list[bool | None] = []
        pending: list[tuple[int, float]] = []  # (row index, threshold)
        cfg = self.model.config
        for i, row in enumerate(rows):
            row.gates.append(gates[i])
            fixed = row.exit_at_step if row.exit_at_step is not None else cfg.early_exit_step
            threshold = row.exit_threshold if row.exit_threshold is not None else cfg.early_exit_threshold
            if fixed is not None and 0 <= fixed < self.steps:
                flags.append(row.step == fixed)
            elif row.step == self.steps - 1 or threshold is None:
                flags.append(row.step == self.steps - 1)
            else:
                flags.append(None)
                pending.append((i, threshold))
        if pending:
            depth = max(len(rows[i].gates) for i, _ in pending)
            history = torch.stack(
                [torch.stack(rows[i].gates + rows[i].gates[-1:] * (depth - len(rows[i].gates))) for i, _ in pending],
                dim=1,
            )  # [depth, rows]: a row's padding after its last gate does not change its prefix
            cdf = torch.cumsum(exit_distribution(history, self.steps), dim=0)
            last = torch.tensor([len(rows[i].gates) - 1 for i, _ in pending], device=cdf.device)
            limit = torch.tensor([t for _, t in pending], dtype=cdf.dtype, device=cdf.device)
            reached = (cdf.gather(0, last[None]).squeeze(0) >= limit).tolist()
            for (i, _), hit in zip(pending, reached):
                flags[i] = hit
        return flags

    def _fill_later_steps(self, rows: list[DepthRow]) -> None:
        """ "last-exited" for rows that exit this pass: their exit step's K/V into the later steps."""
        exits = [(r.table, r.position, r.step) for r in rows]
        fill_skipped_folded(self.folded, exits, self.steps, self.block_size, self.num_blocks)
