"""CUDA/HIP graphs for prefill and mixed batches, one per (token bucket, sequence bucket).

Without a graph the compiled step is bound by the host on small batches: each of its several
hundred launches (custom ops, Triton launchers, Inductor kernels) costs tens of microseconds of
Python, so a short prompt's prefill takes far longer on the host than on the GPU (a depth-batching
engine's prefill step: ~100 ms, docs/benchmarks.md). ``PrefillGraphRunner(step_fn, kv_caches,
max_blocks_per_seq, token_buckets, seq_buckets)`` captures ``step_fn`` for batches of any mix of
prompts, chunks and decode rows, so such a step costs one replay:

* Buckets: a batch of ``t`` tokens from ``s`` sequences replays the graph of the smallest token
  bucket ``T >= t`` and, among the sequence buckets ``S <= T`` captured with it, the smallest
  ``S >= s``. A graph computes ``S`` logits rows, or ``T`` with ``logits_rows="tokens"`` (a logits
  row per token: self-speculation's verify passes). Batches beyond every bucket, or with more
  logits rows than the graph computes, call ``step_fn``.
* Padding: tokens ``t .. T-1`` are token 0 at position 0 with slot -1 (no KV write) and belong to no
  sequence (the attention kernels write zeros for them); sequences ``s .. S-1`` have query length 0
  and ``seq_len`` 0 (``query_start_loc`` stays at ``t``) and a zero block table; logits rows past the
  batch's point at themselves. Every op but attention is row-wise, and attention reads only the real
  sequences' K/V, so real rows are what the unpadded step gives.
* Kernels choose tiles and paths from shapes only, so a graph runs what its padded shape selects
  (e.g. the TMA prefill where ``T / S`` averages at least 32 query tokens).
* Static buffers at the largest buckets, sliced per graph; a call fills them with one multi-tensor
  copy per dtype (``graphs.copy_grouped``). Graphs capture largest first into one memory pool
  (``pool``: share the decode graphs' pool; graphs of one engine never run concurrently) and write
  their logits into one shared buffer; the returned logits are a copy.
* Slow graphs are dropped (``drop_slow=True``): after the capture, each token bucket's graph is
  replayed on its all-padding batch and timed against one call of ``step_fn`` on the smallest shape
  (its host time: the launches' Python, which a graph saves). A bucket whose replay takes longer,
  and every larger one, is dropped: there the padding costs more GPU time than the graph saves host
  time, and ``step_fn`` runs the batch unpadded. Huginn-0125 (r=32, H100): 527 tokens padded to the
  1024 bucket replayed in 220 ms against the step's 131 ms (docs/benchmarks.md, session 25).
* ``use_graphs=False`` keeps the static buffers and padding and calls ``step_fn`` (the CPU tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from rlt_compile.graphs import StaticStepRunner, copy_grouped, normalize_buckets
from rlt_compile.kernels.metadata import AttentionMetadata

log = logging.getLogger("rlt_compile.prefill_graphs")


class PrefillGraphRunner(StaticStepRunner):
    def __init__(
        self,
        step_fn: Callable,
        kv_caches: list[torch.Tensor],
        max_blocks_per_seq: int,
        token_buckets: Sequence[int],
        seq_buckets: Sequence[int] | None = None,
        max_num_seqs: int | None = None,
        step_options: dict | None = None,
        use_graphs: bool | None = None,
        warmup_runs: int = 2,
        pool=None,
        logits_rows: str = "seqs",
        drop_slow: bool = True,
    ):
        super().__init__(step_fn, kv_caches, max_blocks_per_seq, step_options, use_graphs, warmup_runs)
        if logits_rows not in ("seqs", "tokens"):
            raise ValueError(f"logits_rows must be 'seqs' or 'tokens', got {logits_rows!r}")
        self.logits_rows = logits_rows
        self.token_buckets = normalize_buckets(token_buckets, 1)
        top_seqs = min(self.token_buckets[-1], max_num_seqs or self.token_buckets[-1])
        self.seq_buckets = normalize_buckets(seq_buckets, top_seqs)
        self._allocate(self.token_buckets[-1], self.seq_buckets[-1])
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = pool
        self._logits: torch.Tensor | None = None  # the graphs' shared output buffer (``_run_step``)
        self.drop_slow = drop_slow
        self.step_ms: float | None = None  # ``step_fn``'s time on the smallest shape (``_drop_slow_graphs``)
        self.replay_ms: dict[int, float] = {}  # per token bucket timed, its graph's replay time
        self.dropped: set[tuple[int, int]] = set()

    # -- buckets ---------------------------------------------------------------------------
    def shapes(self) -> list[tuple[int, int]]:
        """Every captured (token bucket, sequence bucket): sequence buckets up to the token bucket."""
        return [(t, s) for t in self.token_buckets for s in self.seq_buckets if s <= t]

    def bucket_for(self, num_tokens: int, num_seqs: int, rows: int | None = None) -> tuple[int, int] | None:
        """The graph for ``num_tokens`` tokens of ``num_seqs`` sequences with ``rows`` logits rows
        (default ``num_seqs``), or None."""
        rows = num_seqs if rows is None else rows
        for t in self.token_buckets:
            if t < num_tokens:
                continue
            for s in self.seq_buckets:
                if s > t:
                    break
                if s >= num_seqs and (s >= rows or self.logits_rows == "tokens") and (t, s) not in self.dropped:
                    return t, s
        return None

    def can_run(self, num_tokens: int, num_seqs: int, rows: int | None = None) -> bool:
        return self.captured and num_seqs >= 1 and self.bucket_for(num_tokens, num_seqs, rows) is not None

    def static_inputs(self, tokens: int, seqs: int):
        """The graph's views of the static buffers: (input_ids, positions, attn, logits_indices)."""
        return self._views(tokens, seqs, self._row_count((tokens, seqs)))

    def _row_count(self, shape: tuple[int, int]) -> int:
        """Logits rows a graph computes: one per sequence, or one per token (``logits_rows``)."""
        return shape[1] if self.logits_rows == "seqs" else shape[0]

    # -- buffers ---------------------------------------------------------------------------
    def fill(self, shape: tuple[int, int], input_ids, positions, attn: AttentionMetadata, logits_indices) -> None:
        """Copy a batch into the static buffers and pad it to ``shape`` (tokens, sequences)."""
        tokens, seqs = shape
        t, s, rows = input_ids.shape[0], attn.num_seqs, logits_indices.shape[0]
        if attn.slot_mapping.shape[0] != t or positions.shape[0] != t:
            raise ValueError(f"{t} input ids but {positions.shape[0]} positions, {attn.slot_mapping.shape[0]} slots")
        row_count = self._row_count(shape)
        if t > tokens or s > seqs or rows > row_count:
            raise ValueError(f"{t} tokens, {s} sequences, {rows} logits rows do not fit {shape}")
        pairs = self._batch_pairs(input_ids, positions, attn, logits_indices, rows)
        copy_grouped(pairs + self._padding_pairs(t, tokens, s, seqs, rows, row_count))

    def _run_step(self, shape: tuple[int, int]) -> torch.Tensor:
        input_ids, positions, attn, logits_indices = self.static_inputs(*shape)
        out = self.step_fn(input_ids, positions, self.kv_caches, attn, logits_indices, **self.step_options)
        out = out[0] if isinstance(out, tuple) else out
        if not self.use_graphs:
            return out
        # Every graph writes its logits into one buffer: kept per graph, the [rows, vocab] outputs of a
        # serving set of shapes (tokens 16-2048 x sequences up to 256: 2520 rows) would hold 0.47 GB
        # at Ouro's vocabulary, 1.6 GB at Nanbeige's. Allocated at the first (largest) shape's warm-up,
        # outside any capture.
        if self._logits is None or self._logits.shape[1:] != out.shape[1:] or self._logits.dtype != out.dtype:
            self._logits = out.new_empty((self._row_count(max(self.shapes())), *out.shape[1:]))
        self._logits[: out.shape[0]].copy_(out)
        return self._logits[: out.shape[0]]

    # -- capture ---------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self) -> PrefillGraphRunner:
        """Warm up and capture every shape, largest first, into one memory pool."""
        t0 = time.perf_counter()
        for shape in sorted(self.shapes(), reverse=True):
            self._pad_all(shape)
            self._capture_one(shape, lambda shape=shape: self._run_step(shape))
        if self.use_graphs and self.drop_slow:
            self._drop_slow_graphs()
        self._captured(t0)
        log.info(
            "captured %d prefill %s (tokens %s x sequences %s) in %.2f s",
            len(self.shapes()),
            "CUDA/HIP graphs" if self.use_graphs else "static-buffer steps (no graphs)",
            self.token_buckets,
            self.seq_buckets,
            self.capture_seconds,
        )
        return self

    def _pad_all(self, shape: tuple[int, int]) -> None:
        """Fill the static buffers with an all-padding batch of ``shape``: no KV reads or writes."""
        self.query_start_loc[0] = 0
        copy_grouped(self._padding_pairs(0, shape[0], 0, shape[1], 0, self._row_count(shape)))

    def _timed_ms(self, fn: Callable[[], object]) -> float:
        """Wall milliseconds of the second of two calls of ``fn``, the device synchronised."""
        fn()
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(self.device)
        return (time.perf_counter() - start) * 1e3

    def _drop_slow_graphs(self) -> None:
        """Drop the graphs of the token buckets whose replay is slower than ``step_fn`` on the smallest
        shape, from the first such bucket on (replays grow with the bucket); see the module docstring."""
        smallest = min(self.shapes())
        self._pad_all(smallest)
        self.step_ms = self._timed_ms(lambda: self._run_step(smallest))  # _run_step: step_fn, no replay
        for t in self.token_buckets:
            shapes = [shape for shape in self.shapes() if shape[0] == t]
            if not self.dropped:
                self._pad_all(shapes[-1])
                self.replay_ms[t] = self._timed_ms(self.graphs[shapes[-1]].replay)
                if self.replay_ms[t] <= self.step_ms:
                    continue
            self.dropped.update(shapes)
        for shape in self.dropped:
            del self.graphs[shape], self.outputs[shape]
        if self.dropped:
            log.info(
                "prefill graphs of token buckets %s dropped: their replays (%s ms) are slower than the step "
                "without a graph (%.1f ms)",
                sorted({t for t, _ in self.dropped}),
                ", ".join(f"{ms:.1f}" for t, ms in self.replay_ms.items() if ms > self.step_ms),
                self.step_ms,
            )

    # -- running ---------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, input_ids, positions, attn: AttentionMetadata, logits_indices) -> torch.Tensor:
        """Logits of the batch's ``logits_indices`` rows (fp32, a copy); ``step_fn`` where no graph fits."""
        shape = self.bucket_for(input_ids.shape[0], attn.num_seqs, logits_indices.shape[0])
        if not self.captured or shape is None:
            out = self.step_fn(input_ids, positions, self.kv_caches, attn, logits_indices, **self.step_options)
            return out[0] if isinstance(out, tuple) else out
        self.fill(shape, input_ids, positions, attn, logits_indices)
        if self.use_graphs:
            self.graphs[shape].replay()
            out = self.outputs[shape]
        else:
            out = self._run_step(shape)
        self.replays += 1
        return out[: logits_indices.shape[0]].clone()
