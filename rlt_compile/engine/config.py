"""EngineConfig: the engine's knobs (batch limits, KV pool size, scheduling policy, compile/graphs).

``num_blocks`` sizes the paged KV pool explicitly; otherwise the pool takes
``gpu_memory_utilization`` of the device's free memory (on the CPU: of available RAM, capped by
``cpu_kv_cache_bytes``), never more than ``max_num_seqs`` full-length sequences need.
``model_options`` are passed to every model forward (Huginn ``num_steps`` / ``init_scale``,
Ouro ``exit_at_step`` ...). ``speculative_num_draft`` (K > 0) turns on synchronous self-speculative
decoding with ``speculative_draft_steps`` (d) draft loop steps; it cannot be combined with
``async_scheduling`` (ValueError). ``depth_batching=True`` (Ouro, Huginn) runs decode through continuous depth
batching (``models/depth_batching.py``, docs/depth.md): each engine step advances every in-flight
token by one loop step and a token leaves at its own exit step; it cannot be combined with
``async_scheduling`` or ``speculative_num_draft`` (ValueError). ``wavefront_prefill_chunk=C`` (> 0)
allocates the KV cache step-folded and runs a prefill that finishes a sequence's uncomputed tokens in
one step and spans more than one chunk through wavefront chunked prefill (``models/wavefront.py``,
docs/speculation.md); it cannot be combined with ``async_scheduling``, ``speculative_num_draft`` or
``depth_batching`` (ValueError).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

POLICIES = ("fcfs", "priority")
# Default prefill-graph buckets. Without a graph a prefill step is bound by the host (Ouro-1.4B on the
# H200: 130-141 ms up to 527 tokens); a replay of 16 tokens takes 5.9 ms, of 128 tokens 6.2, of 512
# 11.1, a 1024-token graph 19.3 (docs/benchmarks.md, session 22), so coarse token buckets lose little
# to padding, and chunked-prefill steps up to 2048 tokens still gain. Buckets above
# max_num_batched_tokens are dropped. Sequence buckets only size the logits rows and the attention grid.
DEFAULT_PREFILL_GRAPH_TOKENS = (128, 256, 512, 1024, 2048)
DEFAULT_PREFILL_GRAPH_SEQS = (1, 8, 64, 256)


@dataclass
class EngineConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # default: the model's context length
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 2 << 30
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    max_queue_size: int | None = None  # waiting requests; None = unbounded
    model_options: dict = field(default_factory=dict)
    compile: bool = False
    compile_options: dict = field(default_factory=dict)
    use_cuda_graphs: bool = False
    cuda_graph_buckets: list[int] | None = None
    # Short-context decode graphs for buckets up to 8 (positions; None: graphs.CudaGraphRunner's
    # default [256]; []: none): their attention takes the short context's tiles (docs/compiler.md).
    cuda_graph_context_buckets: list[int] | None = None
    # Prefill / mixed-batch graphs (prefill_graphs.PrefillGraphRunner, docs/compiler.md): token buckets
    # (None: DEFAULT_PREFILL_GRAPH_TOKENS on the GPU, none on the CPU; []: none) and sequence buckets
    # (None: DEFAULT_PREFILL_GRAPH_SEQS up to max_num_seqs, and max_num_seqs). Needs use_cuda_graphs.
    cuda_graph_prefill_tokens: list[int] | None = None
    cuda_graph_prefill_seqs: list[int] | None = None
    seed: int = 0  # for requests without their own seed
    async_scheduling: bool = False  # prepare step n+1 on the host while the device runs step n
    # Self-speculative decoding (docs/speculation.md): draft K tokens with the model's first d loop
    # steps, verify them in one full-depth pass. 0 = off.
    speculative_num_draft: int = 0
    speculative_draft_steps: int = 1
    # Continuous depth batching (Ouro, Huginn; docs/depth.md): decode tokens advance one loop step per engine
    # step on a step-folded KV cache and exit at their own step ("last-exited" KV layout).
    depth_batching: bool = False
    # Wavefront chunked prefill (docs/speculation.md): chunk size C of the wavefront; 0 / None = off.
    wavefront_prefill_chunk: int | None = None
    # FCFS: admit waiting requests only once this many sequence slots are free (or fewer requests wait,
    # or nothing runs), so their prefills share one step. None: 1, or max_num_seqs // 4 with
    # depth_batching, where rows exit one by one and each lone prefill would be a pass of its own.
    admission_batch: int | None = None
    # Sampling defaults for what a request leaves unset: "auto" takes temperature, top_p, top_k, min_p,
    # repetition_penalty and max_new_tokens (as max_tokens) from the checkpoint's generation_config.json,
    # as vLLM does; "vllm" ignores it (SamplingParams' own defaults).
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {message}")

        check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        check(
            self.generation_config in ("auto", "vllm"),
            "generation_config",
            f"must be 'auto' or 'vllm', got {self.generation_config!r}",
        )
        check(
            self.admission_batch is None or 1 <= self.admission_batch <= self.max_num_seqs,
            "admission_batch",
            f"must be in [1, max_num_seqs={self.max_num_seqs}] or None, got {self.admission_batch}",
        )
        check(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            f"must be >= 1, got {self.max_num_batched_tokens}",
        )
        check(self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        check(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", f"must be >= 1, got {self.num_blocks}")
        check(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        check(
            self.max_model_len is None or self.max_model_len >= 1,
            "max_model_len",
            f"must be >= 1, got {self.max_model_len}",
        )
        check(self.scheduling_policy in POLICIES, "scheduling_policy", f"must be one of {POLICIES}")
        for name in ("cuda_graph_buckets", "cuda_graph_prefill_tokens", "cuda_graph_prefill_seqs"):
            buckets = getattr(self, name)
            check(
                buckets is None or all(isinstance(b, int) and b >= 1 for b in buckets),
                name,
                f"must be a list of positive integers or None, got {buckets!r}",
            )
        check(
            self.max_queue_size is None or self.max_queue_size >= 1,
            "max_queue_size",
            f"must be >= 1 or None, got {self.max_queue_size}",
        )

        check(
            isinstance(self.speculative_num_draft, int) and self.speculative_num_draft >= 0,
            "speculative_num_draft",
            f"must be an integer >= 0, got {self.speculative_num_draft!r}",
        )
        check(
            isinstance(self.speculative_draft_steps, int) and self.speculative_draft_steps >= 1,
            "speculative_draft_steps",
            f"must be an integer >= 1, got {self.speculative_draft_steps!r}",
        )
        check(
            not (self.speculative_num_draft and self.async_scheduling),
            "speculative_num_draft",
            "self-speculative decoding is synchronous: it cannot be combined with async_scheduling=True",
        )

        check(
            not (self.depth_batching and self.async_scheduling),
            "depth_batching",
            "continuous depth batching is synchronous: it cannot be combined with async_scheduling=True",
        )
        check(
            not (self.depth_batching and self.speculative_num_draft),
            "depth_batching",
            "continuous depth batching cannot be combined with self-speculation (speculative_num_draft > 0)",
        )

        chunk = self.wavefront_prefill_chunk
        check(
            chunk is None or (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 0),
            "wavefront_prefill_chunk",
            f"must be an integer >= 0 or None (0 / None = off), got {chunk!r}",
        )
        for on, what in (
            (self.async_scheduling, "async_scheduling=True"),
            (self.speculative_num_draft, "self-speculation (speculative_num_draft > 0)"),
            (self.depth_batching, "depth_batching=True"),
        ):
            check(not (chunk and on), "wavefront_prefill_chunk", f"wavefront prefill cannot be combined with {what}")

    @classmethod
    def split_options(cls, options: dict) -> tuple[EngineConfig, dict]:
        """(EngineConfig from the known keys, the remaining keys)."""
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in options.items() if k in names}
        rest = {k: v for k, v in options.items() if k not in names}
        return cls(**known), rest
