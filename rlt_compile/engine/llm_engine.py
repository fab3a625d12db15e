"""LLMEngine: requests in, streamed RequestOutput deltas out, one ``step()`` at a time.

``add_request`` validates and tokenizes a request (bad input raises ``ValueError`` naming the field
and leaves every other request untouched) and queues its ``n`` sequences; with prefix caching the
``n - 1`` extra completions wait until the first has its prompt cached, then share those blocks.
``step`` schedules a batch, runs the model, samples, applies the stop rules (stop token ids, the
model's eos unless ``ignore_eos``, stop strings, ``max_tokens``, ``max_model_len``), frees finished
sequences and returns the new output of every request that made progress.

With ``speculative_num_draft=K`` (self-speculative decoding, docs/speculation.md) a decode-only step
drafts up to K tokens per sequence with the model's first ``speculative_draft_steps`` loop steps (K
draft passes), verifies them with one full-depth varlen pass (K + 1 tokens per sequence) and keeps
the longest agreeing prefix plus the target's token (greedy) or the rejection-sampling result
(sampled), so the output equals (greedy) or is distributed as (sampled) plain decoding.

With ``depth_batching=True`` (Ouro, Huginn; docs/depth.md) prefill chunks run as above, at full depth,
and every decode token is an in-flight row of a ``DepthBatcher`` (``HuginnDepthBatcher``) on the
step-folded KV cache: one engine step advances each row by one loop step, a row leaves at its own exit
step (the request's exit policy / recurrence count or the engine's ``model_options``) and only exiting
rows are sampled (the same sampler and stop rules); its sequence's next token joins at step 0 in the
next engine step, when its KV slot is allocated.

With ``wavefront_prefill_chunk=C`` (docs/speculation.md) the KV cache is step-folded and every
scheduled prefill that finishes its sequence's uncomputed tokens in this step and is longer than ``C``
tokens runs through ``wavefront_prefill`` (after any prefix-cache hit or earlier chunk: ``start``); the
rest of the batch (decodes, shorter or partial prefill chunks) runs through the runner afterwards and
every logits row is sampled in batch order, as in a plain step.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch

from rlt_compile.engine.async_runner import AsyncScheduler
from rlt_compile.engine.block_manager import BlockManager
from rlt_compile.engine.config import EngineConfig
from rlt_compile.engine.detokenizer import detokenize_step, find_stop_string
from rlt_compile.engine.model_runner import ModelRunner, choose_num_blocks
from rlt_compile.engine.outputs import CompletionOutput, RequestOutput
from rlt_compile.engine.sampler import Sampler, logprob_entries, sampling_probs
from rlt_compile.engine.sampling_params import SamplingParams, generation_defaults
from rlt_compile.engine.scheduler import ScheduledBatch, Scheduler
from rlt_compile.engine.sequence import Sequence
from rlt_compile.models.base import LoopedLM
from rlt_compile.models.depth_batching import DepthBatcher
from rlt_compile.models.huginn_depth import HuginnDepthBatcher
from rlt_compile.models.speculative import draft_options, speculative_accept
from rlt_compile.models.wavefront import wavefront_prefill

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """``max_queue_size`` requests are already waiting."""


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0  # tokens computed as prompt (or recompute) input
    decode_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    spec_steps: int = 0  # steps that ran self-speculation (draft passes + one verify pass)
    spec_drafted: int = 0  # draft tokens proposed
    spec_accepted: int = 0  # draft tokens the verify pass accepted
    depth_passes: int = 0  # depth batching: passes of the shared stack over the in-flight decode rows
    wavefront_prefills: int = 0  # prefills run through wavefront chunked prefill
    wavefront_tokens: int = 0  # tokens they computed

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0


def collect_eos_ids(model: LoopedLM, tokenizer) -> set[int]:
    """eos ids from the generation config, the model config and the tokenizer."""
    found: set[int] = set()
    sources = [
        (getattr(model, "generation_config", None) or {}).get("eos_token_id"),
        getattr(getattr(model, "config", None), "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ]
    for value in sources:
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, list | tuple):
            found.update(v for v in value if isinstance(v, int))
    return found


class LLMEngine:
    def __init__(self, model: LoopedLM, config: EngineConfig | None = None, tokenizer=None, **options):
        self.model = model
        self.config = config if config is not None else EngineConfig(**options)
        self.tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        device = next(model.parameters()).device
        context = model.max_context
        max_len = min(self.config.max_model_len or context, context)
        num_blocks = choose_num_blocks(model, self.config, max_len, device)
        capacity = num_blocks * self.config.block_size
        if capacity < max_len:
            log.warning(
                "max_model_len lowered from %d to %d: the KV pool holds %d blocks", max_len, capacity, num_blocks
            )
            max_len = capacity
        self.max_model_len = max_len
        self.block_manager = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager, max_len)
        self.runner = ModelRunner(model, self.config, num_blocks, max_len)
        self.draft_options = self._draft_options() if self.config.speculative_num_draft else None
        if self.draft_options is not None:  # the draft passes' decode graphs, captured before serving
            self.runner.option_graph_runner(self.runner.engine_options(self.draft_options))
        self.depth = self._depth_batcher() if self.config.depth_batching else None
        self.wavefront_chunk = self._wavefront_chunk()
        self.sampler = Sampler(device, self.config.seed)
        self.eos_token_ids = collect_eos_ids(model, self.tokenizer)
        self.sampling_defaults = self._sampling_defaults()
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._arrivals = itertools.count()
        self._request_ids = itertools.count()
        self._aborted: list[RequestOutput] = []
        self.async_scheduler = AsyncScheduler(self) if self.config.async_scheduling else None

    def _draft_options(self) -> dict:
        """Forward options of the draft passes (ValueError for unusable settings)."""
        d = self.config.speculative_draft_steps
        layout = self.config.model_options.get("kv_layout", "delayed")
        if layout != "delayed":
            raise ValueError(f"speculative_num_draft: needs kv_layout='delayed', got {layout!r}")
        try:
            options = draft_options(self.model, d)
        except ValueError as e:
            raise ValueError(f"speculative_draft_steps: {e}") from None
        if d > self.runner.cache_steps:
            raise ValueError(
                f"speculative_draft_steps: {d} exceeds the {self.runner.cache_steps} loop steps of the KV cache"
            )
        return options

    def _depth_batcher(self) -> DepthBatcher | HuginnDepthBatcher:
        """The continuous depth batcher over the runner's step-folded cache (ValueError for unusable settings)."""
        family = self.model.family
        if family not in ("ouro", "huginn"):
            raise ValueError(f"depth_batching: needs an Ouro or Huginn model; this is {family}")
        options = self.config.model_options
        layout = options.get("kv_layout", "last-exited")
        if layout != "last-exited":
            raise ValueError(f"depth_batching: decode uses kv_layout='last-exited', got {layout!r}")
        if family == "huginn":
            criterion = options.get("exit_criterion")
            if criterion not in (None, "latent-diff"):
                raise ValueError(f"depth_batching: Huginn's adaptive exit supports 'latent-diff', got {criterion!r}")
            if criterion is not None and not options.get("exit_threshold", 0) > 0:
                raise ValueError("exit_threshold: must be > 0 with exit_criterion='latent-diff'")
            if self.config.use_cuda_graphs:
                raise ValueError("depth_batching: CUDA graphs are captured for Ouro's batcher only, not Huginn's")
            init_scale = options.get("init_scale", 1.0)
            return HuginnDepthBatcher(self.model, self.runner.kv_caches, self.config.block_size, init_scale)
        steps = options.get("num_steps")
        if steps is not None and steps != self.model.config.total_ut_steps:
            raise ValueError(
                f"depth_batching: model_options['num_steps']={steps} differs from the model's "
                f"{self.model.config.total_ut_steps} loop steps"
            )
        batcher = DepthBatcher(self.model, self.runner.kv_caches, self.config.block_size)
        if self.config.use_cuda_graphs and self.runner.device.type == "cuda" and not self.config.compile:
            log.warning(
                "use_cuda_graphs=True needs compile=True (eager attention reads metadata on the host); no graphs"
            )
        elif self.config.use_cuda_graphs:
            blocks = -(-self.max_model_len // self.config.block_size)
            batcher.capture_graphs(
                self.config.max_num_seqs,
                blocks,
                buckets=self.config.cuda_graph_buckets,
                context_buckets=self.config.cuda_graph_context_buckets,
            )
        return batcher

    def _wavefront_chunk(self) -> int:
        """The wavefront prefill chunk size, 0 when off (ValueError for unusable settings)."""
        chunk = self.config.wavefront_prefill_chunk or 0
        layout = self.config.model_options.get("kv_layout")
        if chunk and layout == "shared":
            raise ValueError("wavefront_prefill_chunk: needs a K/V plane per loop step, not kv_layout='shared'")
        return chunk

    def _depth_join(self, seq: Sequence) -> None:
        """``seq``'s uncomputed last token joins the depth batcher at step 0 with its request's policy."""
        args = (seq.seq_id, seq.token_ids[-1], len(seq) - 1, seq.block_table)
        if self.model.family == "huginn":
            options = self.config.model_options
            steps = seq.params.num_steps or self.runner.cache_steps
            adaptive = options.get("exit_criterion") is not None
            threshold = options.get("exit_threshold") if adaptive else None
            self.depth.join(*args, steps, threshold, options.get("min_steps", 1))
        else:
            self.depth.join(*args, *self.runner.ouro_exit(seq.params))

    # -- requests ------------------------------------------------------------------------------
    def _sampling_defaults(self) -> dict:
        if self.config.generation_config != "auto":
            return {}
        defaults = generation_defaults(getattr(self.model, "generation_config", None))
        try:
            SamplingParams(**defaults)
        except (TypeError, ValueError) as e:
            log.warning("generation_config.json: sampling defaults %s ignored (%s)", defaults, e)
            return {}
        if defaults:
            log.info("sampling defaults from generation_config.json: %s", defaults)
        return defaults

    def default_sampling_params(self, **fields) -> SamplingParams:
        """SamplingParams with the checkpoint's generation-config defaults (``generation_config="auto"``),
        then ``fields``."""
        return SamplingParams(**{**self.sampling_defaults, **fields})

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: a text prompt needs a tokenizer; pass token ids instead")
        return list(self.tokenizer.encode(prompt))

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request (text or token ids); returns its id. Invalid input raises ValueError."""
        request_id = str(next(self._request_ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        params = params if params is not None else self.default_sampling_params()
        params.verify()
        if not isinstance(priority, int):
            raise ValueError(f"priority: must be an integer, got {priority!r}")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenize(prompt) if prompt else []
        elif isinstance(prompt, list | tuple):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError(f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
        self._validate(token_ids, params)
        waiting = self.scheduler.num_waiting
        limit = self.config.max_queue_size
        if limit is not None and waiting + params.n > limit:
            raise QueueFullError(f"max_queue_size: {waiting} sequences already waiting (limit {limit})")
        request = Request(request_id, text, token_ids, params)
        arrival = next(self._arrivals)
        share = self.config.enable_prefix_caching and params.n > 1
        for i in range(params.n):
            parent = request.seqs[0] if share and i > 0 else None
            seq = Sequence(request_id, i, token_ids, params, priority=priority, arrival=arrival, parent=parent)
            request.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = request
        return request_id

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt: empty prompt (no tokens)")
        vocab = self.model.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {vocab})")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens is longer than the model context (max_model_len={self.max_model_len})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(f"{name}: {value} exceeds the vocabulary size {vocab}")
        if params.prompt_logprobs is not None and self.config.wavefront_prefill_chunk:
            raise ValueError("prompt_logprobs: not supported with wavefront_prefill_chunk")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
            bad = [t for t in ids or [] if t >= vocab]
            if bad:
                raise ValueError(f"{name}: {bad[:5]} outside the vocabulary [0, {vocab})")
        self.runner.check_depth(params)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output comes with the next ``step``."""
        request = self.requests.pop(str(request_id), None)
        if request is None:
            return False
        if self.async_scheduler is not None:
            self.async_scheduler.forget(request)
        for seq in request.seqs:
            if self.depth is not None:
                self.depth.remove(seq.seq_id)
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        self._aborted.append(self._output(request))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.async_scheduler is not None:  # overlapped: outputs come one step later
            return self.async_scheduler.step()
        outputs, self._aborted = self._aborted, []
        batch = self.scheduler.schedule()
        self.stats.preemptions += len(batch.preempted)
        if self.depth is not None:
            for seq in batch.preempted:  # recomputed later from prompt + output
                self.depth.remove(seq.seq_id)
        if not batch.seqs:
            if self.scheduler.waiting and not self.scheduler.running and not batch.preempted:
                raise RuntimeError("the scheduler cannot admit any waiting sequence (KV pool too small?)")
            return outputs
        if self.depth is not None:
            touched = self._depth_step(batch)
        elif self._speculates(batch):
            touched = self._speculative_step(batch)
        elif self.wavefront_chunk:
            touched = self._wavefront_step(batch)
        else:
            touched = self._plain_step(batch)
        for request in touched.values():
            outputs.append(self._output(request))
            if request.finished:
                del self.requests[request.request_id]
        return outputs

    def _plain_step(self, batch: ScheduledBatch) -> dict[str, Request]:
        inputs = self.runner.prepare(batch, prompt_logprobs=True)
        logits, sample_seqs = self.runner.run(batch, inputs)
        if inputs.prompt_rows:
            self._record_prompt_logprobs(logits[len(sample_seqs) :], inputs.prompt_rows)
        self._account(batch)
        return self._sample(logits[: len(sample_seqs)], sample_seqs)

    @staticmethod
    def _record_prompt_logprobs(logits: torch.Tensor, rows: list[tuple[Sequence, int]], chunk: int = 512) -> None:
        """Append each row's prompt-token logprob entry (rows come in position order per sequence),
        ``chunk`` rows at a time: a prefill's rows x the vocabulary in fp32 can be gigabytes."""
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            raw = torch.log_softmax(logits[start : start + chunk].float(), dim=-1)
            tokens = [seq.token_ids[q + 1] for seq, q in part]
            for (seq, q), entry in zip(part, logprob_entries(raw, tokens, [s.params.prompt_logprobs for s, _ in part])):
                assert len(seq.prompt_logprobs) == q + 1, (seq, q)
                seq.prompt_logprobs.append(entry)

    def _account(self, batch: ScheduledBatch) -> None:
        """Count the step and its tokens; the scheduled tokens are computed (and their full blocks cached)."""
        self.stats.steps += 1
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if n == 1 and seq.num_computed_tokens == len(seq) - 1 and seq.num_output_tokens > 0:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += n
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)

    def _sample(self, logits: torch.Tensor, sample_seqs: list[Sequence]) -> dict[str, Request]:
        touched: dict[str, Request] = {}
        if sample_seqs:
            sampled = self.sampler(logits, sample_seqs)
            for seq, token, logprobs in zip(sample_seqs, sampled.token_ids, sampled.logprobs):
                self._append(seq, token, logprobs)
                touched[seq.request_id] = self.requests[seq.request_id]
        return touched

    # -- wavefront chunked prefill -------------------------------------------------------------
    def _wavefront_row(self, seq: Sequence, n: int) -> bool:
        """Whether ``seq``'s chunk this step runs as a wavefront: it finishes the sequence's uncomputed
        tokens (so its last token's logits are sampled) and spans more than one wavefront chunk."""
        return n == seq.num_uncomputed_tokens and n > self.wavefront_chunk

    def _wavefront_step(self, batch: ScheduledBatch) -> dict[str, Request]:
        """Wavefront prefills first, then the rest of the batch through the runner; one sampler call
        over every logits row in batch order (as a plain step would)."""
        rest, rows = ScheduledBatch(), {}
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if self._wavefront_row(seq, n):
                rows[seq.seq_id] = self._run_wavefront(seq)
                self.stats.wavefront_prefills += 1
                self.stats.wavefront_tokens += n
            else:
                rest.add(seq, n)
        if not rows:
            return self._plain_step(batch)
        plain_rows: dict[int, torch.Tensor] = {}
        if rest.seqs:
            logits, sample_seqs = self.runner.execute(rest)
            plain_rows = {seq.seq_id: logits[i] for i, seq in enumerate(sample_seqs)}
        self._account(batch)
        order = [seq for seq in batch.seqs if seq.seq_id in rows or seq.seq_id in plain_rows]
        logits = torch.stack([rows.get(seq.seq_id, plain_rows.get(seq.seq_id)) for seq in order])
        return self._sample(logits, order)

    def _run_wavefront(self, seq: Sequence) -> torch.Tensor:
        """fp32 logits of ``seq``'s last token after a wavefront prefill of its uncomputed tokens,
        with the forward options the runner would use for it (engine-wide or the request's own)."""
        options = dict(self.runner.model_options)
        steps = options.pop("num_steps", None)
        family = self.model.family
        if family == "huginn":
            steps = seq.params.num_steps or steps
        elif family == "ouro":
            options["exit_at_step"], options["exit_threshold"] = self.runner.ouro_exit(seq.params)
        return wavefront_prefill(
            self.model,
            self.runner.kv_caches,
            seq.token_ids,
            seq.block_table,
            self.wavefront_chunk,
            num_steps=steps,
            start=seq.num_computed_tokens,
            **options,
        )

    # -- continuous depth batching -------------------------------------------------------------
    def _depth_row(self, seq: Sequence, n: int) -> bool:
        """Whether ``seq`` decodes through the depth batcher this step (in flight, or its one
        uncomputed token is an output token)."""
        if self.depth.has(seq.seq_id):
            return True
        return n == 1 and seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens

    def _depth_step(self, batch: ScheduledBatch) -> dict[str, Request]:
        """Prefill chunks through the runner (full depth); one loop step for every decode row."""
        prefill, rows = ScheduledBatch(), []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if self._depth_row(seq, n):
                rows.append(seq)
            else:
                prefill.add(seq, n)
        touched = self._plain_step(prefill) if prefill.seqs else {}
        if not prefill.seqs:
            self.stats.steps += 1
        if not rows:
            return touched
        for seq in rows:
            if not self.depth.has(seq.seq_id):  # joins at step 0; the scheduler allocated its slot
                self._depth_join(seq)
        exited_ids, logits = self.depth.advance([seq.seq_id for seq in rows])
        self.stats.depth_passes += 1
        if not exited_ids:
            return touched
        by_id = {seq.seq_id: seq for seq in rows}
        exited = [by_id[i] for i in exited_ids]
        for seq in exited:
            # K/V of every step is in place (the exit step's copied into the later ones). Such blocks
            # are not registered in the prefix cache: their K/V is not the full-depth prefill's.
            seq.num_computed_tokens += 1
            self.stats.decode_tokens += 1
        sampled = self.sampler(logits, exited)
        for seq, token, logprobs in zip(exited, sampled.token_ids, sampled.logprobs):
            self._append(seq, token, logprobs)
            touched[seq.request_id] = self.requests[seq.request_id]
        return touched

    # -- self-speculative decoding -------------------------------------------------------------
    def _speculates(self, batch: ScheduledBatch) -> bool:
        """A decode-only batch (no prefill chunk, no per-request depth options) with reserved drafts."""
        return (
            self.draft_options is not None
            and any(batch.lookahead.get(s.seq_id, 0) for s in batch.seqs)
            and batch.is_decode_only
            and all(s.num_computed_tokens == len(s) - 1 and not s.params.has_depth_options for s in batch.seqs)
        )

    def _speculative_step(self, batch: ScheduledBatch) -> dict[str, Request]:
        """K draft passes, one full-depth verify pass, acceptance, stop rules per token, rollback."""
        seqs = batch.seqs
        ks = [batch.lookahead.get(s.seq_id, 0) for s in seqs]
        base = [len(s) for s in seqs]  # L: the last token (position L - 1) is not computed yet
        drafts: list[list[int]] = [[] for _ in seqs]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        try:
            for i in range(max(ks)):  # draft pass i: input at position L - 1 + i, one token per sequence
                active = [j for j, k in enumerate(ks) if k > i]
                sub = ScheduledBatch()
                for j in active:
                    sub.add(seqs[j], 1)
                logits, _ = self.runner.run(sub, self.runner.prepare(sub), self.draft_options)
                tokens, probs = self._draft_pick(logits, [seqs[j] for j in active])
                for row, j in enumerate(active):
                    drafts[j].append(tokens[row])
                    if probs[row] is not None:
                        draft_probs[j].append(probs[row])
                    seqs[j].token_ids.append(tokens[row])  # temporarily: the next pass's input
                    seqs[j].num_computed_tokens += 1
            verify = ScheduledBatch()
            for j, seq in enumerate(seqs):
                seq.num_computed_tokens = base[j] - 1
                verify.add(seq, ks[j] + 1)
            logits, _ = self.runner.run(verify, self.runner.prepare(verify, all_logits=True))
        finally:
            for j, seq in enumerate(seqs):  # roll back to the verified state
                del seq.token_ids[base[j] :]
                seq.num_computed_tokens = base[j] - 1
        self.stats.steps += 1
        self.stats.spec_steps += 1
        self.stats.decode_tokens += sum(ks) + len(ks)
        rows, start = [], 0
        for k in ks:
            rows.append((start, start + k + 1))
            start += k + 1
        emitted: list[list[int]] = [[] for _ in seqs]
        plain_logprobs: dict[int, dict | None] = {}
        plain = [j for j, k in enumerate(ks) if k == 0]
        if plain:  # sequences that did not speculate: an ordinary decode through the sampler
            out = self.sampler(logits[[rows[j][0] for j in plain]], [seqs[j] for j in plain])
            for j, token, lp in zip(plain, out.token_ids, out.logprobs):
                emitted[j], plain_logprobs[j] = [token], lp
        for j, seq in enumerate(seqs):
            if ks[j] == 0:
                continue
            target = logits[rows[j][0] : rows[j][1]]
            if seq.params.greedy:
                targets = target.argmax(dim=-1).tolist()
                n = 0
                while n < ks[j] and drafts[j][n] == targets[n]:
                    n += 1
                emitted[j] = drafts[j][:n] + [targets[n]]
            else:
                p = sampling_probs(target, [seq.params] * (ks[j] + 1))
                q = torch.stack(draft_probs[j])
                tokens = torch.tensor(drafts[j], device=q.device)
                emitted[j] = speculative_accept(tokens, q, p, self.sampler.generator_for(seq))
            self.stats.spec_drafted += ks[j]
            self.stats.spec_accepted += len(emitted[j]) - 1
        touched: dict[str, Request] = {}
        for j, seq in enumerate(seqs):
            for token in emitted[j]:
                self._append(seq, token, plain_logprobs.get(j))
                if seq.is_finished:  # a stop rule inside the accepted run: the rest is dropped
                    break
            if not seq.is_finished:
                # K/V is valid for the verified last token and the accepted drafts
                seq.num_computed_tokens = base[j] + len(emitted[j]) - 1
                self.block_manager.commit(seq)
            touched[seq.request_id] = self.requests[seq.request_id]
        return touched

    def _draft_pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list]:
        """Draft tokens: argmax for greedy requests, else a sample (and its distribution) drawn with the
        request's generator from the same transformed distribution as the target's."""
        tokens = logits.argmax(dim=-1).tolist()
        probs: list[torch.Tensor | None] = [None] * len(seqs)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            dist = sampling_probs(logits[sampled], [seqs[i].params for i in sampled])
            for row, i in enumerate(sampled):
                gen = self.sampler.generator_for(seqs[i])
                tokens[i] = int(torch.multinomial(dist[row], 1, generator=gen))
                probs[i] = dist[row]
        return tokens, probs

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        seq.token_ids.append(token)
        self.stats.generated_tokens += 1
        params = seq.params
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token]
        produced = seq.num_output_tokens
        may_stop = produced >= params.min_tokens
        if may_stop and token in (params.stop_token_ids or ()):
            self._finish(seq, "stop", token)
            return
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, "stop", None)
            return
        if self.tokenizer is not None:
            new_text = detokenize_step(self.tokenizer, seq)
            if may_stop and params.stop_strings and new_text:
                stop = find_stop_string(seq, len(new_text))
                if stop is not None:
                    self._finish(seq, "stop", stop)
                    return
        if produced >= params.max_tokens or len(seq) >= self.max_model_len:
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)

    def _output(self, request: Request) -> RequestOutput:
        """The request's news since its last output (tokens, text, logprobs per completion)."""
        completions = []
        for seq in request.seqs:
            produced = len(seq.token_ids) - seq.num_prompt_tokens
            done = seq.finish_reason is not None
            if seq.sent_tokens == produced and (not done or seq.sent_finish):
                continue
            params = seq.params
            text_end = len(seq.text)
            if not done and params.stop_strings:  # hold back what may be the start of a stop string
                text_end = max(seq.sent_text, text_end - max(map(len, params.stop_strings)) + 1)
            with_logprobs = params.logprobs is not None
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.text[seq.sent_text : text_end],
                    token_ids=seq.token_ids[seq.num_prompt_tokens + seq.sent_tokens :],
                    logprobs=seq.logprobs[seq.sent_logprobs :] if with_logprobs else None,
                    cumulative_logprob=seq.cumulative_logprob if with_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
            seq.sent_tokens, seq.sent_text, seq.sent_logprobs = produced, text_end, len(seq.logprobs)
            seq.sent_finish = done
        prompt_logprobs = None
        if request.params.prompt_logprobs is not None and not request.sent_prompt_logprobs:
            done = [s.prompt_logprobs for s in request.seqs if not s.prompt_logprobs_pending]
            if done:  # with the first completion's first tokens
                prompt_logprobs, request.sent_prompt_logprobs = list(done[0]), True
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=all(s.finish_reason is not None for s in request.seqs),
            num_cached_tokens=request.seqs[0].num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    # -- conveniences --------------------------------------------------------------------------
    def run_to_completion(self) -> dict[str, RequestOutput]:
        """Step until every request finishes; the merged output of each request by id."""
        merged: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in merged:
                    merged[out.request_id].merge(out)
                else:
                    merged[out.request_id] = out
        return merged

    @property
    def device(self) -> torch.device:
        return self.runner.device
