"""Asynchronous scheduling: the host prepares step ``n + 1`` while the device runs step ``n``.

``EngineConfig(async_scheduling=True)`` routes ``LLMEngine.step`` here. One call of ``step``:

1. **schedule** step ``n + 1`` while step ``n`` is still in flight. Tokens sampled at step ``n``
   are not known on the host yet: each such sequence carries a *placeholder* (``PLACEHOLDER``,
   -1) at the end of ``token_ids``, so its length, block needs and position are already right;
2. **launch** step ``n + 1``: the inputs go through ``InputBuffers`` (pinned host buffers, one
   packed non-blocking copy per dtype on a side stream, or UVA views); the placeholder inputs are
   then filled *on the device* from step ``n``'s sampled-id tensor
   (``input_ids.index_copy_(0, gather_dst, sampled_n.index_select(0, gather_src))``), so no token
   travels through the host. The model runs, the sampler runs on the device, and the new ids
   start a non-blocking device-to-host copy into pinned memory followed by an event;
3. **resolve** step ``n``: wait for its event (the device is busy with ``n + 1`` meanwhile), read
   its ids and apply them with the engine's own synchronous rules (``LLMEngine._append``: stop
   ids, eos, detokenization and stop strings, ``max_tokens``), then build the outputs. During
   this the placeholders are stripped, so every rule sees exactly the state of synchronous mode;
   detokenization therefore runs while the device computes (off the critical path).

A sequence that step ``n`` finished (a stop token, eos, a stop string) has already been scheduled
into step ``n + 1``: that one speculative token is computed and discarded (its K/V lands at a
position of the finished sequence, in blocks freed right after; the device runs in stream order,
so a later owner of those blocks writes after it). A sequence that will finish for a reason known
in advance (``max_tokens``, ``max_model_len``) is held out of scheduling instead ("frozen").

Exactness: the tokens equal synchronous mode for greedy and for seeded requests (the sampler is
the synchronous sampler's arithmetic, op for op, with its generators); the batches differ (a
speculative row, admissions one step later), which the engine's batch invariance absorbs.
Unseeded random sampling draws from the engine's shared generator, so - as in synchronous mode -
its tokens depend on batch composition. Requests with a penalty (repetition, presence, frequency)
need the host's token history: when one is in flight the step first resolves the previous step (a
synchronous step).

Host syncs per step: one event wait for the *previous* step's ids (normally complete). The eager
reference attention and per-request depth options build tensors on the host and sync inside the
step; use ``compile=True`` (Triton attention) for a sync-free step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rlt_compile.engine.input_buffers import PLACEHOLDER, InputBuffers, SeqChunk
from rlt_compile.engine.model_runner import StepInputs, prompt_logprob_rows
from rlt_compile.engine.sampler import adjust_logits
from rlt_compile.engine.scheduler import ScheduledBatch
from rlt_compile.engine.sequence import Sequence

log = logging.getLogger(__name__)


# -- sampling on the device (the synchronous Sampler's arithmetic, without host reads) ----------------
class DeviceSampler:
    """``Sampler.__call__`` op for op, returning device tensors: small per-row parameter tensors go
    through pinned memory with ``non_blocking`` copies instead of blocking ``torch.tensor(device=...)``
    copies, and the logprob inputs stay on the device. Shares the engine sampler's generators."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.device = sampler.device
        self.pin = self.device.type == "cuda"

    def to_device(self, values, dtype=None) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        if self.pin:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]):
        """(sampled ids [rows] int64 on the device, logprob pack or None)."""
        logits = logits.float()
        params = [s.params for s in seqs]
        want = [p.logprobs is not None for p in params]
        raw = torch.log_softmax(logits, dim=-1) if any(want) else None
        for row, seq in enumerate(seqs):
            if seq.params.adjusts_logits:
                logits[row] = adjust_logits(logits[row], seq, self.to_device)
        greedy = [p.temperature == 0.0 for p in params]
        tokens = logits.argmax(dim=-1) if all(greedy) else self._sample(logits, seqs, greedy)
        pack = None
        if raw is not None:
            rows = [i for i, w in enumerate(want) if w]
            k = max(params[i].logprobs for i in rows)
            rows_t = self.to_device(rows, torch.long)
            sub = raw.index_select(0, rows_t)
            chosen = sub.gather(1, tokens.index_select(0, rows_t)[:, None]).squeeze(1)
            top_vals, top_ids = sub.topk(k, dim=-1) if k > 0 else (sub[:, :0], sub[:, :0].long())
            pack = LogprobPack(rows, [params[i].logprobs for i in rows], chosen, top_vals, top_ids)
        return tokens, pack

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        return self.sampler._sample(logits, seqs, greedy, self.to_device)


@dataclass
class LogprobPack:
    rows: list[int]  # logits rows that asked for logprobs
    counts: list[int]  # how many alternatives each asked for
    chosen: torch.Tensor  # [len(rows)] logprob of the sampled token
    top_vals: torch.Tensor  # [len(rows), k]
    top_ids: torch.Tensor

    def to_host(self, pin: bool) -> LogprobPack:
        if not pin:
            return self
        host = [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (self.chosen, self.top_vals, self.top_ids)
        ]
        for h, t in zip(host, (self.chosen, self.top_vals, self.top_ids)):
            h.copy_(t, non_blocking=True)
        return LogprobPack(self.rows, self.counts, *host)

    def entries(self, tokens: list[int], num_rows: int) -> list[dict[int, float] | None]:
        """Per logits row: ``{sampled id: logprob, top ids: logprobs}`` (the sync sampler's format)."""
        chosen, vals, ids = self.chosen.tolist(), self.top_vals.tolist(), self.top_ids.tolist()
        out: list[dict[int, float] | None] = [None] * num_rows
        for j, (i, n) in enumerate(zip(self.rows, self.counts)):
            entry = {tokens[i]: chosen[j]}
            for tid, val in zip(ids[j][:n], vals[j][:n]):
                entry.setdefault(tid, val)
            out[i] = entry
        return out


# -- one launched step -------------------------------------------------------------------------------
@dataclass
class StepRecord:
    index: int
    seqs: list[Sequence]  # the batch
    sample_seqs: list[Sequence]  # one per sampled row
    row_of: dict[int, int]  # seq_id -> sampled row
    tokens_dev: torch.Tensor | None = None  # [rows] sampled ids on the device (the next step gathers here)
    tokens_host: torch.Tensor | None = None  # pinned copy, valid once ``event`` completed
    logprobs: LogprobPack | None = None
    event: torch.cuda.Event | None = None


class AsyncScheduler:
    """The overlapped ``step`` of an ``LLMEngine`` (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        runner = engine.runner
        cfg = engine.config
        self.device = runner.device
        self.is_cuda = self.device.type == "cuda"
        max_blocks = -(-engine.max_model_len // cfg.block_size)
        max_tokens = max(cfg.max_num_batched_tokens, engine.max_model_len)
        self.buffers = InputBuffers(self.device, max_tokens, cfg.max_num_seqs, max_blocks)
        self.sampler = DeviceSampler(engine.sampler)
        # sampled ids land here (pinned, one buffer per step parity): step k's are read before k+2 writes
        self._ids_host = [self._pinned_ids(cfg.max_num_seqs) for _ in range(2)]
        self.inflight: StepRecord | None = None
        self.pending: dict[Sequence, list[StepRecord]] = {}  # placeholders per sequence, oldest first
        self.steps = 0
        self.sync_steps = 0  # steps that had to resolve the previous one before scheduling
        self.speculative_rows = 0  # sampled rows discarded because their sequence had finished
        self.trace: list[tuple[str, int]] | None = None  # set to [] to record the event order (tests)

    def _pinned_ids(self, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.long, pin_memory=self.is_cuda)

    # -- bookkeeping -------------------------------------------------------------------------------
    def _note(self, what: str, index: int) -> None:
        if self.trace is not None:
            self.trace.append((what, index))

    def real_len(self, seq: Sequence) -> int:
        """Tokens of ``seq`` the host knows (its length without placeholders)."""
        return len(seq.token_ids) - len(self.pending.get(seq, ()))

    def forget(self, request) -> None:
        """An aborted request: drop its placeholders (its rows in flight are discarded)."""
        for seq in request.seqs:
            records = self.pending.pop(seq, None)
            if records:
                del seq.token_ids[-len(records) :]

    def _will_finish(self, seq: Sequence) -> bool:
        """Whether resolving ``seq``'s placeholders surely finishes it (length limits)."""
        return seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.engine.max_model_len

    def _needs_history(self) -> bool:
        return any(seq.params.needs_history for seq, recs in self.pending.items() if recs)

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> list:
        engine = self.engine
        outputs, engine._aborted = engine._aborted, []
        if self.inflight is not None and self._needs_history():
            self.sync_steps += 1
            outputs += self._resolve(self._take_inflight())
        batch = self._schedule()
        engine.stats.preemptions += len(batch.preempted)
        if not batch.seqs:
            if self.inflight is not None:  # nothing to overlap with: finish the step in flight
                outputs += self._resolve(self._take_inflight())
                return outputs
            sched = engine.scheduler
            if sched.waiting and not sched.running and not batch.preempted:
                raise RuntimeError("the scheduler cannot admit any waiting sequence (KV pool too small?)")
            return outputs
        record = self._launch(batch)
        previous, self.inflight = self.inflight, record
        if previous is not None:
            outputs += self._resolve(previous)
        return outputs

    def _take_inflight(self) -> StepRecord:
        record, self.inflight = self.inflight, None
        return record

    def _schedule(self) -> ScheduledBatch:
        sched = self.engine.scheduler
        frozen = [s for s in sched.running if self.pending.get(s) and self._will_finish(s)]
        for seq in frozen:
            sched.running.remove(seq)
        try:
            batch = sched.schedule()
        finally:
            sched.running.extend(frozen)
        self._note("schedule", self.steps)
        return batch

    @torch.no_grad()
    def _launch(self, batch: ScheduledBatch) -> StepRecord:
        runner = self.engine.runner
        prev = self.inflight
        chunks, sample_seqs = [], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            real = self.real_len(seq)
            gather = None
            if start + n > real:  # placeholder inputs: sampled by the step in flight
                records = self.pending[seq]
                gather = {}
                for offset in range(max(real - start, 0), n):
                    record = records[start + offset - real]
                    if record is not prev:
                        raise AssertionError(f"{seq}: placeholder from step {record.index}, in flight {prev}")
                    gather[offset] = record.row_of[seq.seq_id]
            sample = start + n == len(seq)
            chunks.append(SeqChunk(seq.token_ids[start : start + n], start, seq.block_table, sample, gather))
            if sample:
                sample_seqs.append(seq)
        tensors = self.buffers.stage(chunks, runner.block_size)
        if tensors.num_gather:
            tensors.input_ids.index_copy_(0, tensors.gather_dst, prev.tokens_dev.index_select(0, tensors.gather_src))
        indices = tensors.logits_indices
        prompt_rows, prompt_indices = prompt_logprob_rows(batch)
        if prompt_rows:  # prompt tokens are never placeholders: their logprobs are recorded right away
            indices = torch.cat([indices, torch.tensor(prompt_indices, dtype=torch.long).to(indices.device)])
        inputs = StepInputs(tensors.input_ids, tensors.positions, tensors.attn, indices, sample_seqs, prompt_rows)
        logits, _ = runner.run(batch, inputs)
        self.buffers.release(tensors)
        if prompt_rows:
            self.engine._record_prompt_logprobs(logits[len(sample_seqs) :], prompt_rows)
            logits = logits[: len(sample_seqs)]
        record = StepRecord(self.steps, list(batch.seqs), sample_seqs, {s.seq_id: i for i, s in enumerate(sample_seqs)})
        if sample_seqs:
            record.tokens_dev, pack = self.sampler(logits, sample_seqs)
            if self.is_cuda:
                parity, rows = record.index % 2, len(sample_seqs)
                if rows > self._ids_host[parity].shape[0]:
                    self._ids_host[parity] = self._pinned_ids(2 * rows)
                record.tokens_host = self._ids_host[parity][:rows]
                record.tokens_host.copy_(record.tokens_dev, non_blocking=True)
            record.logprobs = pack.to_host(self.is_cuda) if pack is not None else None
        if self.is_cuda:
            record.event = torch.cuda.Event()
            record.event.record(torch.cuda.current_stream(self.device))
        self._account(batch)
        for seq in sample_seqs:
            seq.token_ids.append(PLACEHOLDER)
            self.pending.setdefault(seq, []).append(record)
        self._note("launch", self.steps)
        self.steps += 1
        return record

    def _account(self, batch: ScheduledBatch) -> None:
        """The synchronous step's bookkeeping: stats, computed tokens, prefix-cache commits."""
        engine = self.engine
        engine.stats.steps += 1
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if n == 1 and seq.num_computed_tokens == len(seq) - 1 and seq.num_output_tokens > 0:
                engine.stats.decode_tokens += 1
            else:
                engine.stats.prefill_tokens += n
            seq.num_computed_tokens += n
            if seq.num_computed_tokens <= self.real_len(seq):  # no placeholder computed: commit now
                engine.block_manager.commit(seq)

    def _read_tokens(self, record: StepRecord) -> list[int]:
        """The host learns step ``record.index``'s ids (waits for its event only)."""
        self._note("read", record.index)
        if record.event is not None:
            record.event.synchronize()
        source = record.tokens_host if record.tokens_host is not None else record.tokens_dev
        return source.tolist() if source is not None else []

    def _resolve(self, record: StepRecord) -> list:
        engine = self.engine
        tokens = self._read_tokens(record)
        logprobs = record.logprobs.entries(tokens, len(tokens)) if record.logprobs is not None else [None] * len(tokens)
        # 1. strip every placeholder: the engine's rules then see the synchronous state
        for seq, records in self.pending.items():
            if records:
                del seq.token_ids[-len(records) :]
        # 2. register the blocks this step (and the one in flight) computed, as the sync step does
        live = record.seqs + (self.inflight.seqs if self.inflight is not None else [])
        for seq in dict.fromkeys(live):
            if not seq.is_finished:
                engine.block_manager.commit(seq)
        # 3. apply the ids in row order
        touched = {}
        for row, seq in enumerate(record.sample_seqs):
            records = self.pending.get(seq)
            if records and records[0] is record:
                records.pop(0)
            if seq.is_finished:  # aborted, or finished by an earlier token: a speculative row
                self.speculative_rows += 1
                continue
            engine._append(seq, tokens[row], logprobs[row])
            touched[seq.request_id] = engine.requests[seq.request_id]
        outputs = []
        for request in touched.values():
            outputs.append(engine._output(request))
            if request.finished:
                del engine.requests[request.request_id]
        # 4. put back the placeholders of the step in flight (finished sequences drop theirs)
        for seq, records in list(self.pending.items()):
            if not records or seq.is_finished:
                del self.pending[seq]
            else:
                seq.token_ids.extend([PLACEHOLDER] * len(records))
        return outputs

    def drain(self) -> list:
        """Resolve the step in flight (if any) now; returns its outputs."""
        if self.inflight is None:
            return []
        return self._resolve(self._take_inflight())
