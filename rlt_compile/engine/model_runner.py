"""ModelRunner: owns the KV planes and the step function, and runs one scheduled batch.

It flattens the batch (varlen layout, see ``kernels/metadata.py``): each sequence contributes the
``num_tokens`` tokens after its ``num_computed_tokens``, and a logits row only when those finish
its uncomputed tokens (a partial prefill chunk produces none). With ``prompt_logprobs`` the rows of
the prompt positions a request asked logprobs for follow the sampled rows. The step function is the
model, or ``rlt_compile.compiler.compile_model(model, ...)`` with ``compile=True``; with
``use_cuda_graphs=True`` decode-only batches replay ``rlt_compile.graphs.CudaGraphRunner`` graphs, and
with ``cuda_graph_prefill_tokens`` prefill and mixed batches ``rlt_compile.prefill_graphs``' ones.
These modules are optional: when one is missing the runner warns and falls back to the plain path.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

import torch

from rlt_compile.engine.config import DEFAULT_PREFILL_GRAPH_SEQS, DEFAULT_PREFILL_GRAPH_TOKENS, EngineConfig
from rlt_compile.engine.scheduler import ScheduledBatch
from rlt_compile.engine.sequence import Sequence
from rlt_compile.kernels.metadata import AttentionMetadata, build_metadata
from rlt_compile.models.base import LoopedLM

log = logging.getLogger(__name__)

# Self-speculation's verify passes replay graphs for batches of up to this many sequences (each graph
# keeps a [tokens, vocab] fp32 output: at 8 sequences of K + 1 = 5 tokens, 64 rows).
VERIFY_GRAPH_SEQS = 8


def _optional(module: str, name: str):
    """``module.name`` if the module exists, else None (other parts of the package are optional)."""
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return None
    except AttributeError:
        return None


def kv_steps(model: LoopedLM, model_options: dict) -> int:
    """Loop steps the KV cache must hold slots for (``num_steps`` option, else the model's default)."""
    return int(model_options.get("num_steps") or model.default_steps)


def kv_bytes_per_block(model: LoopedLM, block_size: int, steps: int, dtype: torch.dtype) -> int:
    layout = model.kv_layout(steps)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return layout.num_slots * 2 * block_size * layout.num_kv_heads * layout.head_dim * itemsize


def _available_host_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def choose_num_blocks(model: LoopedLM, config: EngineConfig, max_model_len: int, device: torch.device) -> int:
    """Explicit ``num_blocks``, else a memory budget, capped at what ``max_num_seqs`` full sequences need."""
    if config.num_blocks is not None:
        return config.num_blocks
    dtype = next(model.parameters()).dtype
    per_block = kv_bytes_per_block(model, config.block_size, kv_steps(model, config.model_options), dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization)
    else:
        budget = min(int(_available_host_bytes() * config.gpu_memory_utilization), config.cpu_kv_cache_bytes)
    enough = config.max_num_seqs * -(-max_model_len // config.block_size)
    blocks = min(budget // per_block, enough)
    if blocks < 1:
        raise ValueError(
            f"num_blocks: no room for a single KV block ({per_block} bytes each, budget {budget} bytes); "
            "lower max_model_len / max_num_seqs or raise gpu_memory_utilization"
        )
    return blocks


# Ouro's per-request exit policy as per-row forward options: name -> (dtype, padding value).
OURO_ROW_OPTIONS = {"exit_at_step": (torch.long, -1), "exit_threshold": (torch.float32, float("inf"))}


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    sample_seqs: list[Sequence]  # one per sampled logits row
    # after the sampled rows: (sequence, position q) whose logits give prompt token q + 1's logprob
    prompt_rows: list[tuple[Sequence, int]] = ()

    @property
    def row_seqs(self) -> list[Sequence]:
        """The sequence of every logits row, sampled rows first."""
        return self.sample_seqs + [seq for seq, _ in self.prompt_rows]


def prompt_logprob_rows(batch: ScheduledBatch) -> tuple[list[tuple[Sequence, int]], list[int]]:
    """The prompt positions of ``batch`` whose logits give a still missing prompt logprob, as
    (sequence, position q: its logits predict prompt token q + 1) and their rows in the flattened
    batch. What an earlier pass (before a preemption) recorded is skipped."""
    rows: list[tuple[Sequence, int]] = []
    flat: list[int] = []
    offset = 0
    for seq, n in zip(batch.seqs, batch.num_tokens):
        start = seq.num_computed_tokens
        if seq.prompt_logprobs_pending:
            for q in range(max(start, len(seq.prompt_logprobs) - 1), min(start + n, seq.num_prompt_tokens - 1)):
                rows.append((seq, q))
                flat.append(offset + q - start)
        offset += n
    return rows, flat


class ModelRunner:
    def __init__(self, model: LoopedLM, config: EngineConfig, num_blocks: int, max_model_len: int):
        self.model = model
        self.config = config
        self.device = next(model.parameters()).device
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.model_options = dict(config.model_options)
        if config.depth_batching:  # the runner only prefills (full depth); decode runs in the depth batcher
            drop = ("kv_layout", "exit_criterion", "exit_threshold", "min_steps") if model.family == "huginn" else ()
            for key in ("kv_layout", *drop):
                self.model_options.pop(key, None)
        self.kv_caches = model.allocate_kv_cache(
            num_blocks,
            config.block_size,
            max_steps=kv_steps(model, self.model_options),
            fold_steps=config.depth_batching or bool(config.wavefront_prefill_chunk),
        )
        self.step_fn = self._build_step_fn()
        # with depth batching the DepthBatcher captures the decode graphs (LLMEngine)
        use_graphs = config.use_cuda_graphs and not config.depth_batching
        self.graph_runner = self._build_graph_runner() if use_graphs else None
        self._row_graph_runner = None  # Ouro's per-request exits; captured at first use
        self._option_graph_runners: dict[str, object] = {}  # other static options (self-speculation's drafts)
        prefill_graphs = config.use_cuda_graphs and bool(self._prefill_token_buckets())
        self.prefill_graph_runner = self._optional_graphs(self._build_prefill_graph_runner) if prefill_graphs else None
        # self-speculation's verify passes (a logits row per token), for up to VERIFY_GRAPH_SEQS sequences
        verify_graphs = config.use_cuda_graphs and config.speculative_num_draft > 0 and not config.depth_batching
        self.verify_graph_runner = self._optional_graphs(self._build_verify_graph_runner) if verify_graphs else None

    def _build_step_fn(self):
        if not self.config.compile:
            return self.model
        compile_model = _optional("rlt_compile.compiler", "compile_model")
        if compile_model is None:
            log.warning("compile=True but rlt_compile.compiler.compile_model is not available; running eager")
            return self.model
        return compile_model(self.model, **self.config.compile_options)

    def _build_graph_runner(self, row_options: dict | None = None, step_options: dict | None = None, pool=None):
        """Decode graphs over the engine's KV planes, captured with ``step_options`` (default: the
        engine-wide options but ``row_options``' names) into ``pool`` (default: a new one)."""
        if step_options is None:
            step_options = {k: v for k, v in self.model_options.items() if k not in (row_options or {})}
        runner_cls = _optional("rlt_compile.graphs", "CudaGraphRunner")
        if runner_cls is None:
            log.warning("use_cuda_graphs=True but rlt_compile.graphs.CudaGraphRunner is not available")
            return None
        if self.device.type != "cuda":  # the runner keeps its static buffers but replays no graphs
            log.info("use_cuda_graphs=True on %s: decode steps use static buffers without graphs", self.device)
        elif self.step_fn is self.model:
            log.warning(
                "use_cuda_graphs=True needs compile=True (eager attention reads metadata on the host); no graphs"
            )
            return None
        runner = runner_cls(
            self.step_fn,
            self.kv_caches,
            self.config.max_num_seqs,
            -(-self.max_model_len // self.block_size),
            buckets=self.config.cuda_graph_buckets,
            context_buckets=self.config.cuda_graph_context_buckets,
            step_options=step_options,
            row_options=row_options,
        )
        runner.pool = pool
        runner.capture()
        return runner

    def engine_options(self, extra: dict | None = None) -> dict:
        """The forward options of a batch without per-request options in the "delayed" KV layout (what
        ``step_options`` gives then), updated with ``extra``."""
        return {**{k: v for k, v in self.model_options.items() if k != "kv_layout"}, **(extra or {})}

    @staticmethod
    def _optional_graphs(build):
        """``build()``, or None with a warning when capturing fails: these graphs only save host time,
        so the engine keeps serving through the compiled step."""
        try:
            return build()
        except (RuntimeError, ValueError) as e:
            log.warning("graph capture failed (%s: %s); those steps run the compiled step", type(e).__name__, e)
            return None

    def option_graph_runner(self, options: dict):
        """Decode graphs captured with ``options`` (self-speculation's draft passes: the engine-wide
        options with fewer loop steps) at the first call with them (``LLMEngine`` makes it at start),
        into the decode graphs' pool; None without decode graphs or with tensor-valued options."""
        if self.graph_runner is None or any(isinstance(v, torch.Tensor) for v in options.values()):
            return None
        key = repr(sorted(options.items()))
        if key not in self._option_graph_runners:
            log.info("capturing the decode graphs for forward options %s", options)
            self._option_graph_runners[key] = self._optional_graphs(
                lambda: self._build_graph_runner(step_options=options, pool=self.graph_runner.pool)
            )
        return self._option_graph_runners[key]

    def _prefill_token_buckets(self) -> list[int]:
        """``cuda_graph_prefill_tokens``, or where it is None the default buckets on the GPU (on the
        CPU no graph would replace the step's host work, so none)."""
        tokens = self.config.cuda_graph_prefill_tokens
        if tokens is None:
            return list(DEFAULT_PREFILL_GRAPH_TOKENS) if self.device.type == "cuda" else []
        return list(tokens)

    def _build_prefill_graph_runner(self, token_buckets=None, seq_buckets=None, logits_rows: str = "seqs"):
        """Graphs for prefill and mixed batches (default: ``cuda_graph_prefill_tokens`` /
        ``_seqs``), captured with the options every prompt token runs with: the engine-wide ones
        without ``kv_layout``."""
        runner_cls = _optional("rlt_compile.prefill_graphs", "PrefillGraphRunner")
        if runner_cls is None or (self.device.type == "cuda" and self.step_fn is self.model):
            log.warning("prefill graphs need compile=True and rlt_compile.prefill_graphs; none captured")
            return None
        if not token_buckets:  # no step holds more than max_num_batched_tokens: larger buckets never run
            wanted = sorted(set(self._prefill_token_buckets()))
            token_buckets, limit = [], self.config.max_num_batched_tokens
            for bucket in wanted:
                if not token_buckets or token_buckets[-1] < limit:
                    token_buckets.append(bucket)
            if len(token_buckets) < len(wanted):
                log.info("prefill graphs: token buckets above max_num_batched_tokens=%d dropped", limit)
            seq_buckets = self.config.cuda_graph_prefill_seqs
            if seq_buckets is None:
                most = min(self.config.max_num_seqs, token_buckets[-1])
                seq_buckets = [s for s in DEFAULT_PREFILL_GRAPH_SEQS if s < most] + [most]
        runner = runner_cls(
            self.step_fn,
            self.kv_caches,
            -(-self.max_model_len // self.block_size),
            token_buckets,
            seq_buckets=seq_buckets,
            max_num_seqs=self.config.max_num_seqs,
            step_options=self.engine_options(),
            pool=self.graph_runner.pool if self.graph_runner is not None else None,
            logits_rows=logits_rows,
        )
        runner.capture()
        return runner

    def _build_verify_graph_runner(self):
        """Graphs for self-speculation's verify passes: up to ``VERIFY_GRAPH_SEQS`` sequences, each
        with its last token and up to ``speculative_num_draft`` drafts, a logits row per token (the
        token buckets: powers of two up to that many tokens)."""
        seqs = min(self.config.max_num_seqs, VERIFY_GRAPH_SEQS)
        most = seqs * (self.config.speculative_num_draft + 1)
        tokens = [1 << i for i in range(1, most.bit_length() + (most & (most - 1) != 0))]
        seq_buckets = [b for b in (1, 2, 4, 8, 16) if b < seqs] + [seqs]
        return self._build_prefill_graph_runner(tokens, seq_buckets, logits_rows="tokens")

    def prefill_graph_for(self, batch: ScheduledBatch, inputs: StepInputs, options: dict):
        """The prefill graphs (or, for a logits row per token, the verify graphs) that run this
        batch: its options are the ones they were captured with (no per-request tensors), no prompt
        logprob rows, and a captured shape holds it; else None."""
        rows = inputs.logits_indices.shape[0]
        runner = self.verify_graph_runner if rows > len(batch) else self.prefill_graph_runner
        if runner is None or inputs.prompt_rows or any(isinstance(v, torch.Tensor) for v in options.values()):
            return None
        if options != runner.step_options or not runner.can_run(batch.total_tokens, len(batch), rows):
            return None
        return runner

    def row_graph_runner(self, options: dict):
        """The graphs for decode batches whose only non-engine-wide options are Ouro's per-row exit
        tensors (``options``: this batch's forward options), captured the first time one comes;
        None when ``options`` differ otherwise."""
        if self.graph_runner is None or self.model.family != "ouro" or set(OURO_ROW_OPTIONS) - set(options):
            return None

        def static(opts: dict) -> dict:
            return {
                **{k: v for k, v in opts.items() if k not in OURO_ROW_OPTIONS},
                "kv_layout": opts.get("kv_layout", "delayed"),
            }

        if static(options) != static(self.model_options):
            return None
        if self._row_graph_runner is None:
            log.info("capturing the decode graphs for per-request exit policies")
            self._row_graph_runner = self._build_graph_runner(row_options=OURO_ROW_OPTIONS)
        return self._row_graph_runner

    # -- depth options (per request) -------------------------------------------------------------
    @property
    def cache_steps(self) -> int:
        return kv_steps(self.model, self.model_options)

    def check_depth(self, params) -> None:
        """Reject depth options the model or the allocated KV cache cannot serve (ValueError)."""
        family = self.model.family
        if params.exit_policy is not None and family != "ouro":
            raise ValueError(f"exit_policy: only Ouro models have an exit gate (this is {family})")
        if params.num_steps is not None:
            if family != "huginn":
                raise ValueError(
                    f"num_steps: per-request loop counts are for Huginn; set model_options['num_steps'] for {family}"
                )
            if params.num_steps > self.cache_steps:
                raise ValueError(
                    f"num_steps: {params.num_steps} recurrences exceed the {self.cache_steps} the KV cache was "
                    "allocated for (engine model_options['num_steps'])"
                )
        steps = self.model_options.get("num_steps") or self.model.default_steps
        if params.exit_step is not None and params.exit_step >= steps:
            raise ValueError(f"exit_step: must be < {steps} loop steps, got {params.exit_step}")

    def ouro_exit(self, params) -> tuple[int, float]:
        """Ouro exit policy of a request as (fixed step, -1 = none; threshold, inf = none): its own
        ``exit_policy`` or the engine's ``model_options``, else the model config."""
        options, cfg = self.model_options, self.model.config
        steps = options.get("num_steps") or cfg.total_ut_steps
        if params.exit_policy == "full":
            f, t = steps - 1, None
        elif params.exit_policy == "fixed":
            f, t = params.exit_step, None
        elif params.exit_policy == "threshold":
            f, t = None, params.exit_threshold if params.exit_threshold is not None else cfg.early_exit_threshold
        else:
            f, t = (
                options.get("exit_at_step", cfg.early_exit_step),
                options.get("exit_threshold", cfg.early_exit_threshold),
            )
        return (-1 if f is None else f), (float("inf") if t is None else t)

    def step_options(self, batch: ScheduledBatch, inputs: StepInputs) -> tuple[dict, bool]:
        """Forward options for this batch and whether they are the engine-wide ones (graph-safe)."""
        options = dict(self.model_options)
        layout = options.pop("kv_layout", "delayed")
        generated_only = batch.is_decode_only and all(s.num_computed_tokens >= s.num_prompt_tokens for s in batch.seqs)
        if layout != "delayed" and generated_only and len(inputs.sample_seqs) == len(batch.seqs):
            options["kv_layout"] = layout  # early exit applies to generated tokens only
        if not any(seq.params.has_depth_options for seq in batch.seqs):
            # graphs were captured with the engine-wide options, kv_layout included
            return options, layout == "delayed" or "kv_layout" in options
        dev = self.device
        if self.model.family == "ouro":
            fixed, threshold = [], []
            for seq in inputs.row_seqs:
                f, t = self.ouro_exit(seq.params)
                fixed.append(f)
                threshold.append(t)
            options["exit_at_step"] = torch.tensor(fixed, dtype=torch.long, device=dev)
            options["exit_threshold"] = torch.tensor(threshold, dtype=torch.float32, device=dev)
        elif self.model.family == "huginn":
            default = options.get("num_steps") or self.model.default_steps
            per_seq = [seq.params.num_steps or default for seq in batch.seqs]
            if len(set(per_seq)) == 1:
                options["num_steps"] = per_seq[0]
            else:
                counts = torch.tensor(batch.num_tokens)
                options["num_steps"] = torch.tensor(per_seq).repeat_interleave(counts).to(dev)
        return options, False

    # -- one step ------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch, all_logits: bool = False, prompt_logprobs: bool = False) -> StepInputs:
        """Flatten ``batch``; ``all_logits``: a logits row for every token of a sequence whose chunk
        ends its tokens (self-speculation's verify pass), ``sample_seqs`` repeating it per row;
        ``prompt_logprobs``: rows for the prompt positions whose logprobs are still missing."""
        ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        sample_seqs: list[Sequence] = []
        context_lens: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            context_lens.append(start)
            if start + n == len(seq):
                rows = range(len(ids) - n, len(ids)) if all_logits else [len(ids) - 1]
                logits_indices.extend(rows)
                sample_seqs.extend([seq] * len(rows))
        prompt_rows, prompt_indices = prompt_logprob_rows(batch) if prompt_logprobs else ([], [])
        logits_indices += prompt_indices
        attn = build_metadata(
            batch.num_tokens,
            context_lens,
            [seq.block_table for seq in batch.seqs],
            self.block_size,
        )
        dev = self.device
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True),
            positions=torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True),
            attn=attn.to(dev),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long).to(dev, non_blocking=True),
            sample_seqs=sample_seqs,
            prompt_rows=prompt_rows,
        )

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Run the batch; returns (fp32 logits [len(sample_seqs), V], sample_seqs); see ``run``."""
        return self.run(batch, self.prepare(batch))

    @torch.no_grad()
    def run(
        self, batch: ScheduledBatch, inputs: StepInputs, extra_options: dict | None = None
    ) -> tuple[torch.Tensor, list[Sequence]]:
        """Run prepared device inputs (``prepare`` or the async engine's input buffers).

        ``extra_options`` override the forward options (self-speculation's draft passes); such a
        decode batch replays graphs captured with its own options (``option_graph_runner``), never
        the engine-wide ones. The logits have a row per ``inputs.row_seqs``: the prompt rows, if any,
        follow the sampled ones."""
        n = len(batch)
        options, engine_wide = self.step_options(batch, inputs)
        if extra_options:
            options.update(extra_options)
            engine_wide = False
        decode = self.graph_runner is not None and batch.is_decode_only and not inputs.prompt_rows
        row_runner = self.row_graph_runner(options) if decode and not engine_wide and not extra_options else None
        option_runner = self.option_graph_runner(options) if decode and extra_options else None
        if decode and engine_wide and self.graph_runner.can_run(batch.total_tokens, n):
            logits = self.graph_runner(inputs.input_ids, inputs.positions, inputs.attn, inputs.logits_indices)
        elif row_runner is not None and row_runner.can_run(batch.total_tokens, n):
            rows = {name: options[name] for name in OURO_ROW_OPTIONS}
            logits = row_runner(inputs.input_ids, inputs.positions, inputs.attn, inputs.logits_indices, rows)
        elif option_runner is not None and option_runner.can_run(batch.total_tokens, n):
            logits = option_runner(inputs.input_ids, inputs.positions, inputs.attn, inputs.logits_indices)
        elif not extra_options and (prefill_runner := self.prefill_graph_for(batch, inputs, options)) is not None:
            logits = prefill_runner(inputs.input_ids, inputs.positions, inputs.attn, inputs.logits_indices)
        else:
            logits = self.step_fn(
                inputs.input_ids,
                inputs.positions,
                self.kv_caches,
                inputs.attn,
                inputs.logits_indices,
                **options,
            )
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits[: len(inputs.sample_seqs) + len(inputs.prompt_rows)], inputs.sample_seqs
