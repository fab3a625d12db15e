"""CUDA/HIP graphs for decode-only batches, one per padded batch bucket (design contract 3).

``CudaGraphRunner(step_fn, kv_caches, max_num_seqs, max_blocks_per_seq)`` captures ``step_fn``
(usually a ``CompiledModel``; any callable with the models' forward signature works) for batches
where every sequence brings exactly one token (``num_tokens == num_seqs``). The whole forward -
embedding, *all* loop steps, head - is one graph per bucket, so a replay costs one launch however
many loop steps the model runs.

* Buckets: padded batch sizes, by default the powers of two up to ``max_num_seqs`` (plus
  ``max_num_seqs`` itself); any sorted list can be given. A batch of ``n`` sequences runs in the
  smallest bucket ``>= n``; above the largest bucket the runner falls back to calling ``step_fn``.
* Static buffers, allocated once at the largest bucket and sliced per bucket: ``input_ids``,
  ``positions``, ``slot_mapping``, ``block_tables`` [B, max_blocks_per_seq], ``seq_lens``,
  ``query_start_loc`` [B + 1] and ``logits_indices``; each bucket's output logits live in the
  graphs' shared memory pool. A call fills them, padding included, with one multi-tensor copy per
  dtype (``copy_grouped``), not a copy per buffer: those run on the GPU between two replays.
* Padding rows (``n .. B-1``): token 0 at position 0, ``slot_mapping = -1`` (the KV write skips
  them), ``seq_lens = 0``, query length 0 (``query_start_loc`` stays at ``n``), block table zeros,
  logits row = the padding row itself. The attention kernels never read or write the KV cache for
  them, and every other op is row-wise, so real rows are bit-for-bit what they would be unpadded.
* Short contexts: small buckets (``context_max_batch``, 8) also get a graph per context bucket
  (``context_buckets``, positions; by default ``SHORT_DECODE_CONTEXT``, 256, on the GPU), captured
  under ``decode_context_limit`` so the decode attention picks that context's tiles (16-key tiles at
  batch 1 made Ouro-1.4B 2.8% faster at context 128, 7.7% slower at 4096: docs/benchmarks.md). A
  batch replays the smallest one its block tables fit (width x block size); the full-width graph
  serves the rest. The choice is the host's, from shapes, so it costs no synchronisation.
* Capture order: largest bucket first, all into one memory pool (``torch.cuda.graph_pool_handle``),
  each after warm-up runs on a side stream (Triton autotuning and lazy initialisation must not
  happen inside a capture). Capture everything before serving.
* ``torch.cuda.CUDAGraph`` is also the HIP-graph API on ROCm builds of torch
  (``Platform.graph_api``); nothing here is CUDA-specific.
* Per-row forward options (``row_options={"exit_at_step": (torch.long, -1), ...}``: name ->
  (dtype, padding value)) get a static ``[B]`` buffer each, passed to ``step_fn`` by name and
  filled per call from ``row_values`` (padding rows get the padding value): one set of graphs then
  serves any per-row values, e.g. Ouro's per-request exit policies.
* ``use_graphs=False`` keeps the static-buffer and padding logic but calls ``step_fn`` instead of
  replaying (what tests use on the CPU; also a debugging aid).

The returned logits are a copy (``clone_outputs=True``): a later replay overwrites the graph's own
output buffer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from rlt_compile.kernels.attention_config import SHORT_DECODE_CONTEXT, decode_context_limit
from rlt_compile.kernels.metadata import AttentionMetadata

log = logging.getLogger("rlt_compile.graphs")


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to ``max_num_seqs`` (which is always included)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    out.append(max_num_seqs)
    return out


def normalize_buckets(buckets: Sequence[int] | None, max_num_seqs: int) -> list[int]:
    if buckets is None:
        return default_buckets(max_num_seqs)
    out = sorted({int(b) for b in buckets})
    if not out or out[0] < 1:
        raise ValueError(f"buckets must be positive batch sizes, got {list(buckets)}")
    return out


def pick_bucket(buckets: Sequence[int], n: int) -> int | None:
    """The smallest bucket holding ``n`` rows (None: larger than every bucket)."""
    for b in buckets:
        if b >= n:
            return b
    return None


def padded_decode_metadata(
    attn: AttentionMetadata, bucket: int, max_blocks_per_seq: int
) -> tuple[AttentionMetadata, int]:
    """The metadata of a decode-only batch padded to ``bucket`` rows (host-side helper, used by
    tests and by the runner's fill logic). Returns (padded metadata, number of real rows)."""
    n = attn.num_seqs
    if attn.slot_mapping.shape[0] != n:
        raise ValueError(f"not a decode-only batch: {attn.slot_mapping.shape[0]} tokens for {n} sequences")
    if n > bucket:
        raise ValueError(f"{n} sequences do not fit bucket {bucket}")
    width = attn.block_tables.shape[1]
    if width > max_blocks_per_seq:
        raise ValueError(f"block tables are {width} wide, more than max_blocks_per_seq={max_blocks_per_seq}")
    dev = attn.slot_mapping.device
    slots = torch.full((bucket,), -1, dtype=attn.slot_mapping.dtype, device=dev)
    slots[:n] = attn.slot_mapping
    tables = torch.zeros((bucket, max_blocks_per_seq), dtype=attn.block_tables.dtype, device=dev)
    tables[:n, :width] = attn.block_tables
    seq_lens = torch.zeros((bucket,), dtype=attn.seq_lens.dtype, device=dev)
    seq_lens[:n] = attn.seq_lens
    qsl = torch.full((bucket + 1,), n, dtype=attn.query_start_loc.dtype, device=dev)
    qsl[: n + 1] = attn.query_start_loc
    return AttentionMetadata(slots, tables, seq_lens, qsl), n


# Copy a batch's inputs into the static buffers with one multi-tensor copy per dtype group instead of
# a copy per buffer: between two replays the GPU otherwise runs seven tiny copies in a row at batch 1
# (Ouro-1.4B 0.2% faster end to end on the H200, docs/benchmarks.md session 22). A module switch for
# A/B runs (benchmarks/run_device.sh pending73).
FOREACH_FILL = True


def copy_grouped(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair, as one ``torch._foreach_copy_`` per group of pairs with the
    same source / destination dtypes and devices. Its single-kernel route on the GPU needs every
    tensor of the group dense and each pair's sizes and strides equal, so a pair of other shapes
    (``src`` broadcast) or a non-contiguous one (a narrow block table) takes its own ``copy_``."""
    if not FOREACH_FILL:
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        return
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src in pairs:
        if dst.numel() == 0:
            continue
        if dst.shape != src.shape or not (dst.is_contiguous() and src.is_contiguous()):
            dst.copy_(src, non_blocking=True)  # a broadcast, or a pair that would take the group off its fast route
            continue
        dsts, srcs = groups.setdefault((dst.dtype, src.dtype, dst.device, src.device), ([], []))
        dsts.append(dst)
        srcs.append(src)
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs, non_blocking=True)


def capture_graph(fn: Callable[[], object], device: torch.device, warmup_runs: int = 2, pool=None):
    """Run ``fn`` ``warmup_runs`` times on a side stream (autotuning and lazy initialisation must not
    happen inside a capture), then capture one call: returns (graph, what the captured call returned)."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup_runs):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class StaticStepRunner:
    """What the graph runners share: the step, the KV planes, the step's options, whether graphs are
    captured, and static input buffers for up to ``tokens`` tokens of ``seqs`` sequences, with the
    constant tensors their padding values are sliced from."""

    def __init__(self, step_fn: Callable, kv_caches: list[torch.Tensor], max_blocks_per_seq: int,
                 step_options: dict | None, use_graphs: bool | None, warmup_runs: int):  # fmt: skip
        if not kv_caches:
            raise ValueError("kv_caches is empty")
        self.step_fn = step_fn
        self.kv_caches = kv_caches
        self.device = kv_caches[0].device
        self.max_blocks_per_seq = int(max_blocks_per_seq)
        self.step_options = dict(step_options or {})
        self.step_options.pop("return_details", None)
        if use_graphs is None:
            use_graphs = self.device.type == "cuda"
        if use_graphs and self.device.type != "cuda":
            raise RuntimeError(f"CUDA/HIP graphs need the KV cache on a GPU, it is on {self.device}")
        self.use_graphs = use_graphs
        self.warmup_runs = warmup_runs
        self.pool = None
        self.captured = False
        self.capture_seconds = 0.0
        self.replays = 0

    def _allocate(self, tokens: int, seqs: int) -> None:
        dev, width = self.device, self.max_blocks_per_seq
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros((seqs, width), dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(seqs, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(max(tokens, seqs), dtype=torch.long, device=dev)
        # constant sources of the padding values, sliced per batch (``_padding_pairs``)
        self._arange = torch.arange(max(tokens, seqs), dtype=torch.long, device=dev)
        self._zeros = torch.zeros(tokens, dtype=torch.long, device=dev)
        self._no_slots = torch.full((tokens,), -1, dtype=torch.long, device=dev)
        self._zero_tables = torch.zeros((seqs, width), dtype=torch.int32, device=dev)
        # row c: the value c, as often as sequences can be padded (row 0: padding sequence lengths,
        # row t: padding query starts after t real tokens)
        self._token_counts = (
            torch.arange(tokens + 1, dtype=torch.int32, device=dev)[:, None].expand(-1, seqs).contiguous()
        )

    def _views(self, tokens: int, seqs: int, rows: int | None = None):
        """The static buffers' views for ``tokens`` x ``seqs`` and ``rows`` logits rows (default
        ``seqs``): (input_ids, positions, attn, logits_indices)."""
        attn = AttentionMetadata(
            self.slot_mapping[:tokens],
            self.block_tables[:seqs],
            self.seq_lens[:seqs],
            self.query_start_loc[: seqs + 1],
        )
        return (
            self.input_ids[:tokens],
            self.positions[:tokens],
            attn,
            self.logits_indices[: seqs if rows is None else rows],
        )

    def _batch_pairs(self, input_ids, positions, attn: AttentionMetadata, logits_indices, rows: int) -> list:
        """(buffer, value) pairs copying a batch of ``input_ids.shape[0]`` tokens, ``attn.num_seqs``
        sequences and ``rows`` logits rows (``logits_indices``, None: the first ``rows`` rows) in."""
        t, s, width = input_ids.shape[0], attn.num_seqs, attn.block_tables.shape[1]
        if width > self.max_blocks_per_seq:
            raise ValueError(f"block tables are {width} wide, more than max_blocks_per_seq={self.max_blocks_per_seq}")
        return [
            (self.input_ids[:t], input_ids),
            (self.positions[:t], positions),
            (self.slot_mapping[:t], attn.slot_mapping),
            (self.seq_lens[:s], attn.seq_lens),
            (self.query_start_loc[: s + 1], attn.query_start_loc),
            (self.block_tables[:s, :width], attn.block_tables),
            (self.block_tables[:s, width:], self._zero_tables[:s, width:]),
            (self.logits_indices[:rows], self._arange[:rows] if logits_indices is None else logits_indices),
        ]

    def _capture_one(self, key, run: Callable[[], torch.Tensor]) -> None:
        """``run`` (one step on the static buffers) captured as ``graphs[key]`` into the runner's pool,
        its output kept as ``outputs[key]``; without graphs, just run once."""
        if not self.use_graphs:
            self.outputs[key] = run()
            return
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self.graphs[key], self.outputs[key] = capture_graph(run, self.device, self.warmup_runs, self.pool)

    def _captured(self, started: float) -> None:
        """Mark the runner captured ``time.perf_counter() - started`` seconds after it started."""
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
        self.captured = True
        self.capture_seconds = time.perf_counter() - started

    def _padding_pairs(self, t: int, tokens: int, s: int, seqs: int, rows: int, row_count: int | None = None) -> list:
        """(buffer, value) pairs padding ``t`` tokens of ``s`` sequences to ``tokens`` x ``seqs``:
        padding tokens are token 0 at position 0 with slot -1, padding sequences have query length 0
        (their start offsets all equal ``t``), ``seq_len`` 0 and a zero block table, and logits rows
        ``rows .. row_count - 1`` (default ``seqs``) point at themselves."""
        row_count = seqs if row_count is None else row_count
        return [
            (self.input_ids[t:tokens], self._zeros[t:tokens]),
            (self.positions[t:tokens], self._zeros[t:tokens]),
            (self.slot_mapping[t:tokens], self._no_slots[t:tokens]),
            (self.seq_lens[s:seqs], self._token_counts[0, : seqs - s]),
            (self.block_tables[s:seqs], self._zero_tables[s:seqs]),
            (self.query_start_loc[s + 1 : seqs + 1], self._token_counts[t, : seqs - s]),
            (self.logits_indices[rows:row_count], self._arange[rows:row_count]),
        ]


class CudaGraphRunner(StaticStepRunner):
    def __init__(
        self,
        step_fn: Callable,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        buckets: Sequence[int] | None = None,
        step_options: dict | None = None,
        use_graphs: bool | None = None,
        clone_outputs: bool = True,
        warmup_runs: int = 2,
        row_options: dict[str, tuple[torch.dtype, float]] | None = None,
        context_buckets: Sequence[int] | None = None,
        context_max_batch: int = 8,
    ):
        super().__init__(step_fn, kv_caches, max_blocks_per_seq, step_options, use_graphs, warmup_runs)
        self.max_num_seqs = max_num_seqs
        self.buckets = normalize_buckets(buckets, max_num_seqs)
        self.clone_outputs = clone_outputs
        B, dev = self.buckets[-1], self.device
        self._allocate(B, B)
        self.row_options = dict(row_options or {})
        self.row_buffers = {
            name: torch.full((B,), pad, dtype=dtype, device=dev) for name, (dtype, pad) in self.row_options.items()
        }
        self._row_padding = {name: buf.clone() for name, buf in self.row_buffers.items()}
        self.block_size = int(kv_caches[0].shape[2])
        if context_buckets is None:
            context_buckets = [SHORT_DECODE_CONTEXT] if self.use_graphs else []
        if any(int(c) < 1 for c in context_buckets):
            raise ValueError(f"context_buckets must be positive position counts, got {list(context_buckets)}")
        full = self.max_blocks_per_seq * self.block_size
        self.context_buckets = sorted({int(c) for c in context_buckets if int(c) < full})
        self.context_max_batch = int(context_max_batch)
        # keyed by (batch bucket, context bucket); None: the block table's whole width
        self.graphs: dict[tuple[int, int | None], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int | None], torch.Tensor] = {}
        self.fallbacks = 0

    # -- buffers ---------------------------------------------------------------------------
    def bucket_for(self, num_seqs: int) -> int | None:
        return pick_bucket(self.buckets, num_seqs)

    def contexts_for(self, bucket: int) -> list[int | None]:
        """The context buckets captured for a batch bucket, None (the full width) last."""
        return [*(self.context_buckets if bucket <= self.context_max_batch else ()), None]

    def context_for(self, bucket: int, table_width: int) -> int | None:
        """The smallest captured context bucket holding ``table_width`` blocks (None: the full width)."""
        if bucket <= self.context_max_batch:
            positions = table_width * self.block_size
            for limit in self.context_buckets:
                if positions <= limit:
                    return limit
        return None

    def can_run(self, num_tokens: int, num_seqs: int) -> bool:
        """A decode-only batch (one token per sequence) that fits a captured bucket."""
        return self.captured and num_tokens == num_seqs and num_seqs >= 1 and self.bucket_for(num_seqs) is not None

    def static_inputs(self, bucket: int):
        """The bucket's views of the static buffers: (input_ids, positions, attn, logits_indices)."""
        return self._views(bucket, bucket)

    def fill(
        self, bucket: int, input_ids, positions, attn: AttentionMetadata, logits_indices=None, row_values=None
    ) -> int:
        """Copy a decode-only batch (and its per-row option values) into the static buffers and pad it
        to ``bucket`` rows: one multi-tensor copy per dtype (``copy_grouped``)."""
        n = attn.num_seqs
        if input_ids.shape[0] != n or attn.slot_mapping.shape[0] != n:
            raise ValueError(f"not a decode-only batch: {input_ids.shape[0]} tokens for {n} sequences")
        if n > bucket:
            raise ValueError(f"{n} sequences do not fit bucket {bucket}")
        rows = n if logits_indices is None else logits_indices.shape[0]
        pairs = self._batch_pairs(input_ids, positions, attn, logits_indices, rows)
        pairs += self._row_pairs(bucket, rows, row_values)
        copy_grouped(pairs + self._padding_pairs(n, bucket, n, bucket, rows))
        return n

    def _row_pairs(self, bucket: int, rows: int, row_values: dict[str, torch.Tensor] | None) -> list:
        """Per-row option values into their static buffers; rows ``rows .. bucket-1`` get the padding value."""
        missing = set(self.row_buffers) - set(row_values or {})
        if missing:
            raise ValueError(f"row_values lacks {sorted(missing)}")
        pairs = []
        for name, buf in self.row_buffers.items():
            values = row_values[name]
            if values.shape != (rows,):
                raise ValueError(f"row_values[{name!r}] has shape {tuple(values.shape)}, want ({rows},)")
            pairs += [(buf[:rows], values), (buf[rows:bucket], self._row_padding[name][rows:bucket])]
        return pairs

    def _run_step(self, bucket: int, context: int | None = None) -> torch.Tensor:
        input_ids, positions, attn, logits_indices = self.static_inputs(bucket)
        rows = {name: buf[:bucket] for name, buf in self.row_buffers.items()}
        with decode_context_limit(context):
            out = self.step_fn(input_ids, positions, self.kv_caches, attn, logits_indices, **self.step_options, **rows)
        return out[0] if isinstance(out, tuple) else out

    # -- capture ---------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self) -> CudaGraphRunner:
        """Warm up and capture every bucket, largest first, into one memory pool."""
        t0 = time.perf_counter()
        for bucket in reversed(self.buckets):
            self.query_start_loc[0] = 0
            rows = [(buf, self._row_padding[name]) for name, buf in self.row_buffers.items()]
            copy_grouped(rows + self._padding_pairs(0, bucket, 0, bucket, 0))  # all padding: no KV reads or writes
            for context in self.contexts_for(bucket):
                self._capture_one((bucket, context), lambda b=bucket, c=context: self._run_step(b, c))
        self._captured(t0)
        log.info(
            "captured %s for buckets %s (contexts %s up to batch %d) in %.2f s",
            "CUDA/HIP graphs" if self.use_graphs else "static-buffer steps (no graphs)",
            self.buckets,
            self.context_buckets,
            self.context_max_batch,
            self.capture_seconds,
        )
        return self

    # -- running ---------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, input_ids, positions, attn: AttentionMetadata, logits_indices=None, row_values=None):
        """Logits for the batch's rows ([len(logits_indices)] or [num_seqs], fp32); ``row_values``:
        one ``[rows]`` tensor per ``row_options`` name."""
        n = attn.num_seqs
        rows = n if logits_indices is None else logits_indices.shape[0]
        bucket = self.bucket_for(n)
        if not self.captured or bucket is None or input_ids.shape[0] != n:
            self.fallbacks += 1
            out = self.step_fn(input_ids, positions, self.kv_caches, attn, logits_indices, **self.step_options,
                               **(row_values or {}))  # fmt: skip
            return out[0] if isinstance(out, tuple) else out
        self.fill(bucket, input_ids, positions, attn, logits_indices, row_values)
        context = self.context_for(bucket, attn.block_tables.shape[1])
        if self.use_graphs:
            self.graphs[bucket, context].replay()
            out = self.outputs[bucket, context]
        else:
            out = self._run_step(bucket, context)
        self.replays += 1
        out = out[:rows]
        return out.clone() if self.clone_outputs else out
