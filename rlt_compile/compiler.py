"""compile_model: torch.compile with our backend (FX passes, then Inductor) on a model's compile units.

A looped model's ``forward`` is plain Python that calls a few *compile units* (``model.compile_units``:
e.g. ``embed``, ``loop_step``, ``head``). ``compile_model`` installs ``torch.compile(unit)`` on the
model instance for each unit, so the per-loop body is traced and compiled once and then called once
per loop step with that step's KV planes (design contract 4): graph count and compile time do not
grow with the number of loop steps, and asking Huginn for another recurrence count is no recompile.

Our backend receives Dynamo's FX graph of one unit, runs the ``PassManager`` (attention swap to
the Platform's kernel, dot precision, ...) and hands the result to Inductor
(``torch._inductor.compile_fx.compile_fx``). Inductor functionalizes the in-place KV write of the
attention op and re-inplaces it, so the KV planes (graph inputs) are written in place: the
generated code passes the input plane straight to the attention op, without copying it.

Shapes: with ``dynamic="tokens"`` (default) the token dimension (and the sequence, block-table
and KV-block dimensions) of every unit input is marked *unbacked* dynamic before each call, so one
graph per unit serves prefill and decode of any batch size (including 1) and any block-table
width; no recompile, never near ``recompile_limit``. Each ``CompiledModel`` compiles a private copy
of each unit's code object, so its Dynamo cache (and recompile limit) is its own: compiling several
models, or one model with several option sets, in one process does not pile cache entries onto the
shared method.

    cm = compile_model(model, platform="auto")             # "auto" | "cuda" | "rocm" | "cpu"
    logits = cm(input_ids, positions, kv_caches, attn, logits_indices, num_steps=32)
    cm.graph_counts()                                       # {"prelude": 1, "loop_step": 1, "coda": 1}
    runner = cm.capture_graphs(kv_caches, max_num_seqs=8, max_blocks_per_seq=64)   # CUDA/HIP graphs

Options (keyword arguments of ``compile_model``):

    passes             None (default list) or a list of pass names / pass objects ([] = no passes)
    attention_backend  None/"auto" (Platform's choice, RLT_ATTENTION_BACKEND honoured), "triton", "torch"
    dynamic            "tokens" (default, unbacked token dims) | "auto" (Dynamo's automatic dynamic) |
                       "static" (specialise every shape)
    mode               None/"default" | "max-autotune" | "max-autotune-no-cudagraphs" (Inductor modes;
                       "reduce-overhead" is refused: use cuda_graphs=True / CudaGraphRunner instead)
    inductor_config    dict of Inductor config patches (e.g. {"coordinate_descent_tuning": True}); on a
                       platform with PDL on (RLT_PDL, Platform.supports_pdl) "triton.enable_pdl": True
                       is added unless this dict sets it
    inductor           True (default); False runs the post-pass FX graph as is (fast, for debugging)
    fullgraph          True (default): a graph break is an error
    units              which compile units to compile (default: all of model.compile_units)
    dump_dir           write FX graphs before/after passes, pass logs and Inductor code there, and a
                       depyf dump of Dynamo's bytecode (see docs/inspecting.md)
    cuda_graphs        True: decode-only calls replay CUDA/HIP graphs (captured at the first such call
                       per KV cache; see ``graph_max_num_seqs``, ``graph_buckets``), and with
                       ``graph_prefill_tokens`` (token buckets) other calls replay prefill / mixed-batch
                       graphs (``prefill_graphs.PrefillGraphRunner``, sequence buckets up to
                       ``graph_max_num_seqs``)
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import fx

from rlt_compile.kernels.metadata import AttentionMetadata
from rlt_compile.passes.manager import PassContext, PassManager, PassRecord, build_passes, format_graph
from rlt_compile.platform import Platform, get_platform, pdl_enabled

log = logging.getLogger("rlt_compile.compiler")

DYNAMIC_CHOICES = ("tokens", "auto", "static")
MODE_CHOICES = (None, "default", "max-autotune", "max-autotune-no-cudagraphs")

# Which dims of a unit's tensor arguments vary with the batch. Every tensor argument's dim 0 is
# the token / row dimension unless the argument's name is listed here; a model may extend or
# override the table with a ``dynamic_dims`` class attribute of the same form (``()`` = static).
DYNAMIC_DIMS: dict[str, tuple[int, ...]] = {
    "hs": (1,),  # Ouro head: [steps, rows, hidden]
    "kv_caches": (1,),  # [2, num_blocks, block_size, kv_heads, head_dim]: num_blocks per cache
}
DEFAULT_DYNAMIC_DIMS: tuple[int, ...] = (0,)
ATTN_DYNAMIC_DIMS: dict[str, tuple[int, ...]] = {
    "slot_mapping": (0,),
    "block_tables": (0, 1),
    "seq_lens": (0,),
    "query_start_loc": (0,),
}


class PlatformMismatchError(ValueError):
    """The model's device does not belong to the requested platform."""


# ------------------------------------------------------------------------------------ records
@dataclass
class GraphRecord:
    """One Dynamo graph our backend received: its text before and after the passes, what the passes
    did, and Inductor's generated code (None with ``inductor=False``)."""

    unit: str
    index: int
    before: str
    after: str
    passes: list[PassRecord]
    graph: fx.GraphModule
    output_code: list[str] = field(default_factory=list)
    compile_seconds: float = 0.0


class UnitBackend:
    """The torch.compile backend of one compile unit: PassManager, then Inductor."""

    def __init__(
        self,
        unit: str,
        manager: PassManager,
        ctx: PassContext,
        inductor: bool = True,
        inductor_config: dict | None = None,
        dump_dir: Path | None = None,
    ):
        self.unit = unit
        self.manager = manager
        self.ctx = ctx
        self.inductor = inductor
        self.inductor_config = dict(inductor_config or {})
        self.dump_dir = dump_dir
        self.records: list[GraphRecord] = []

    @property
    def num_graphs(self) -> int:
        return len(self.records)

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        t0 = time.perf_counter()
        index = len(self.records)
        before_text = format_graph(gm, shapes=True)
        before_code = gm.code
        records = self.manager.run(gm, dataclasses.replace(self.ctx, example_inputs=list(example_inputs)))
        record = GraphRecord(self.unit, index, before_text, format_graph(gm, shapes=True), records, gm)
        self.records.append(record)
        if self.dump_dir is not None:
            self._dump(record, before_code, gm.code)
        if not self.inductor:
            record.compile_seconds = time.perf_counter() - t0
            self._after_compile()
            return gm.forward
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.graph import GraphLowering

        with mock.patch.object(GraphLowering, "save_output_code", record.output_code.append):
            compiled = compile_fx(gm, example_inputs, config_patches=self.inductor_config or None)
        record.compile_seconds = time.perf_counter() - t0
        self._after_compile()
        log.info("compiled %s graph %d in %.1f s", self.unit, index, record.compile_seconds)
        if self.dump_dir is not None:
            for i, code in enumerate(record.output_code):
                suffix = "" if i == 0 else f".{i}"
                (self.dump_dir / f"{self.unit}.{index}.inductor{suffix}.py").write_text(code)
        return compiled

    def _after_compile(self) -> None:
        for p in self.manager.passes:
            hook = getattr(p, "after_compile", None)
            if hook is not None:
                hook()

    def _dump(self, record: GraphRecord, before_code: str, after_code: str) -> None:
        stem = self.dump_dir / f"{record.unit}.{record.index}"
        header = f"# compile unit {record.unit!r}, Dynamo graph {record.index}, platform {self.ctx.platform.kind}\n"
        Path(f"{stem}.before.txt").write_text(header + "# before our passes\n" + record.before)
        Path(f"{stem}.after.txt").write_text(header + "# after our passes\n" + record.after)
        Path(f"{stem}.before.py").write_text(header + before_code)
        Path(f"{stem}.after.py").write_text(header + after_code)
        lines = [str(r) for r in record.passes] or ["(no pass changed anything)"]
        Path(f"{stem}.passes.txt").write_text(
            header + f"# passes in order: {', '.join(self.manager.names)}\n" + "\n".join(lines) + "\n"
        )


# ------------------------------------------------------------------------------------ units
def _dims_table(model) -> dict[str, tuple[int, ...]]:
    extra = getattr(model, "dynamic_dims", None) or {}
    return {**DYNAMIC_DIMS, **extra}


def _mark(t: torch.Tensor, dims: Iterable[int]) -> None:
    for d in dims:
        if d < t.dim():
            torch._dynamo.decorators.mark_unbacked(t, d)


def mark_dynamic_args(bound: inspect.BoundArguments, table: dict[str, tuple[int, ...]]) -> None:
    """Mark the batch-dependent dims of a unit's arguments as unbacked dynamic (see module doc)."""
    for name, value in bound.arguments.items():
        if isinstance(value, AttentionMetadata):
            for field_name, dims in ATTN_DYNAMIC_DIMS.items():
                _mark(getattr(value, field_name), dims)
            continue
        dims = table.get(name, DEFAULT_DYNAMIC_DIMS)
        if isinstance(value, torch.Tensor):
            _mark(value, dims)
        elif isinstance(value, (list, tuple)):
            for t in value:
                if isinstance(t, torch.Tensor):
                    _mark(t, dims)


def private_method(model: torch.nn.Module, name: str) -> types.MethodType:
    """``model.<name>`` bound to a private copy of the function's code object.

    Dynamo keeps its cache (and counts ``recompile_limit``) per code object; a private copy gives
    each compiled model its own cache instead of sharing the class method's."""
    func = getattr(type(model), name)
    if not isinstance(func, types.FunctionType):
        raise TypeError(f"{type(model).__name__}.{name} is not a plain method; cannot compile it as a unit")
    fresh = types.FunctionType(
        func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    fresh.__kwdefaults__ = func.__kwdefaults__
    fresh.__qualname__ = func.__qualname__
    fresh.__module__ = func.__module__
    fresh.__doc__ = func.__doc__
    return types.MethodType(fresh, model)


class CompiledUnit:
    """A compile unit installed on the model: marks dynamic dims, then calls the compiled method."""

    def __init__(self, model, name: str, backend: UnitBackend, dynamic: str, fullgraph: bool):
        self.name = name
        self.backend = backend
        self.method = private_method(model, name)
        self.signature = inspect.signature(self.method)
        self.table = _dims_table(model)
        self.mark = dynamic == "tokens"
        self.compiled = torch.compile(
            self.method, backend=backend, fullgraph=fullgraph, dynamic=None if dynamic == "auto" else False
        )

    def __call__(self, *args, **kwargs):
        if self.mark:
            mark_dynamic_args(self.signature.bind(*args, **kwargs), self.table)
        return self.compiled(*args, **kwargs)


# ------------------------------------------------------------------------------------ the model
def resolve_platform(platform: str | Platform) -> Platform:
    """A Platform from "auto" | "cuda" | "rocm" | "cpu" (or a Platform). Unknown names raise
    ValueError, kinds this machine lacks raise RuntimeError (both name the valid choices)."""
    if isinstance(platform, Platform):
        return platform
    if not isinstance(platform, str):
        raise ValueError(f"platform must be 'auto', 'cuda', 'rocm', 'cpu' or a Platform, got {platform!r}")
    return get_platform(platform)


def _check_device(model: torch.nn.Module, platform: Platform) -> None:
    if not platform.available:
        return  # a mock platform (graph-only use)
    param = next(model.parameters(), None)
    if param is None:
        return
    device = param.device.type
    if device == "meta":
        raise PlatformMismatchError("the model's parameters are on the meta device; load or materialise them first")
    if device != platform.device_type:
        raise PlatformMismatchError(
            f"platform {platform.kind!r} runs on {platform.device_type!r} tensors but the model is on {device!r}; "
            f"move the model (model.to({platform.device_type!r})) or pass platform={device if device == 'cpu' else 'auto'!r}"
        )


class CompiledModel:
    """The model with its compile units compiled; call it like the model's ``forward``.

    ``model`` is the same instance, with compiled units installed as instance attributes
    (``uninstall()`` removes them)."""

    def __init__(
        self,
        model: torch.nn.Module,
        platform: Platform,
        units: dict[str, CompiledUnit],
        manager: PassManager,
        options: dict,
    ):
        self.model = model
        self.platform = platform
        self.units = units
        self.manager = manager
        self.options = options
        self.dump_dir: Path | None = options.get("dump_dir")
        self._dumping = self.dump_dir is not None
        self.graph_runners: dict[tuple, Any] = {}
        self.installed = True

    # -- calling ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.options.get("cuda_graphs"):
            runner = self._graph_runner_for(args, kwargs)
            if runner is not None:
                input_ids, positions, _, attn, logits_indices = _forward_args(args, kwargs)
                return runner(input_ids, positions, attn, logits_indices)
        return self.run_compiled(*args, **kwargs)

    def run_compiled(self, *args, **kwargs):
        """The model's forward through the compiled units (no CUDA graphs)."""
        with torch.no_grad():
            if not self._dumping:
                return self.model(*args, **kwargs)
            before = self.num_graphs()
            from rlt_compile.depyf_compat import depyf_dump

            with depyf_dump(self.dump_dir / "depyf"):
                out = self.model(*args, **kwargs)
            if self.num_graphs() == before:  # nothing new was compiled: stop dumping
                self._dumping = False
            return out

    forward = __call__

    # -- introspection ---------------------------------------------------------------------
    @property
    def attention_backend(self) -> str:
        return self.platform.select_attention_backend(self.options.get("attention_backend"))

    def graph_counts(self) -> dict[str, int]:
        """Dynamo graphs compiled so far, per compile unit."""
        return {name: unit.backend.num_graphs for name, unit in self.units.items()}

    def num_graphs(self) -> int:
        return sum(self.graph_counts().values())

    def graph_records(self, unit: str | None = None) -> list[GraphRecord]:
        units = [self.units[unit]] if unit else list(self.units.values())
        return [r for u in units for r in u.backend.records]

    @property
    def pass_log(self) -> list[PassRecord]:
        return list(self.manager.history)

    def compile_seconds(self) -> float:
        return sum(r.compile_seconds for r in self.graph_records())

    def uninstall(self) -> None:
        """Put the model's plain methods back (the compiled units stay usable through ``units``)."""
        for name in self.units:
            self.model.__dict__.pop(name, None)
        self.installed = False

    # -- CUDA / HIP graphs -----------------------------------------------------------------
    def capture_graphs(
        self,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        buckets: list[int] | None = None,
        **step_options,
    ):
        """A captured ``graphs.CudaGraphRunner`` for decode-only batches over ``kv_caches``."""
        from rlt_compile.graphs import CudaGraphRunner

        if not self.platform.supports_graphs:
            raise RuntimeError(f"CUDA/HIP graphs need a GPU platform; this one is {self.platform.kind}")
        runner = CudaGraphRunner(
            self.run_compiled, kv_caches, max_num_seqs, max_blocks_per_seq, buckets=buckets, step_options=step_options
        )
        runner.capture()
        return runner

    def capture_prefill_graphs(
        self,
        kv_caches: list[torch.Tensor],
        max_blocks_per_seq: int,
        token_buckets: list[int],
        seq_buckets: list[int] | None = None,
        max_num_seqs: int | None = None,
        **step_options,
    ):
        """A captured ``prefill_graphs.PrefillGraphRunner`` for prefill / mixed batches over ``kv_caches``."""
        from rlt_compile.prefill_graphs import PrefillGraphRunner

        if not self.platform.supports_graphs:
            raise RuntimeError(f"CUDA/HIP graphs need a GPU platform; this one is {self.platform.kind}")
        runner = PrefillGraphRunner(
            self.run_compiled,
            kv_caches,
            max_blocks_per_seq,
            token_buckets,
            seq_buckets=seq_buckets,
            max_num_seqs=max_num_seqs,
            step_options=step_options,
        )
        return runner.capture()

    def _graph_runner_for(self, args, kwargs):
        if not self.platform.supports_graphs:
            return None
        input_ids, positions, kv_caches, attn, logits_indices = _forward_args(args, kwargs)
        if attn is None or logits_indices is None:
            return None
        decode = input_ids.shape[0] == attn.num_seqs
        if not decode and not self.options.get("graph_prefill_tokens"):
            return None
        step_options = {k: v for k, v in kwargs.items() if k not in _FORWARD_ARG_NAMES}
        if step_options.get("return_details") or any(isinstance(v, torch.Tensor) for v in step_options.values()):
            return None
        key = (decode, id(kv_caches[0]), len(kv_caches), tuple(sorted(step_options.items())))
        runner = self.graph_runners.get(key)
        if runner is None:
            max_seqs = int(self.options.get("graph_max_num_seqs") or 8)
            width = int(self.options.get("graph_max_blocks_per_seq") or kv_caches[0].shape[1])
            if decode:
                runner = self.capture_graphs(
                    kv_caches, max_seqs, width, buckets=self.options.get("graph_buckets"), **step_options
                )
            else:
                tokens = self.options["graph_prefill_tokens"]
                runner = self.capture_prefill_graphs(kv_caches, width, tokens, max_num_seqs=max_seqs, **step_options)
            self.graph_runners[key] = runner
        if decode:
            return runner if runner.can_run(input_ids.shape[0], attn.num_seqs) else None
        return runner if runner.can_run(input_ids.shape[0], attn.num_seqs, logits_indices.shape[0]) else None


_FORWARD_ARG_NAMES = ("input_ids", "positions", "kv_caches", "attn", "logits_indices")


def _forward_args(args, kwargs):
    values = list(args[: len(_FORWARD_ARG_NAMES)])
    for name in _FORWARD_ARG_NAMES[len(values) :]:
        values.append(kwargs.get(name))
    return values


# ------------------------------------------------------------------------------------ entry point
_KNOWN_OPTIONS = {
    "passes",
    "attention_backend",
    "dynamic",
    "mode",
    "inductor_config",
    "inductor",
    "fullgraph",
    "units",
    "dump_dir",
    "cuda_graphs",
    "graph_max_num_seqs",
    "graph_max_blocks_per_seq",
    "graph_buckets",
    "graph_prefill_tokens",
}


PDL_PATCH = "triton.enable_pdl"


def _user_sets(inductor_config: dict | None, key: str) -> bool:
    """Whether the user's Inductor patches set ``key`` ("a.b"), dotted or as a nested dict."""
    config = inductor_config or {}
    if key in config:
        return True
    head, _, tail = key.partition(".")
    nested = config.get(head)
    return isinstance(nested, dict) and tail in nested


def _inductor_has_pdl() -> bool:
    import torch._inductor.config as inductor_config

    return hasattr(inductor_config.triton, "enable_pdl")


def inductor_patches(mode: str | None, inductor_config: dict | None, platform: Platform | None = None) -> dict:
    """The Inductor config patches of a compile: ``mode``'s options (without Inductor's cudagraphs),
    ``triton.enable_pdl=True`` when ``platform`` has PDL on (``platform.pdl_enabled``: ``RLT_PDL``,
    ``Platform.supports_pdl``) and this Inductor knows the option, then the user's
    ``inductor_config`` (which wins, also for ``triton.enable_pdl``)."""
    if mode == "reduce-overhead":
        raise ValueError(
            "mode='reduce-overhead' is not supported: the KV planes are mutated graph inputs, which "
            "Inductor's CUDA-graph trees refuse; use compile_model(..., cuda_graphs=True) or "
            "CompiledModel.capture_graphs() (rlt_compile.graphs.CudaGraphRunner) instead"
        )
    if mode not in MODE_CHOICES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(str(m) for m in MODE_CHOICES)}")
    patches: dict = {}
    if mode not in (None, "default"):
        import torch._inductor

        patches.update(torch._inductor.list_mode_options(mode))
        patches.pop("triton.cudagraphs", None)  # graphs are ours (graphs.py)
    if platform is not None and not _user_sets(inductor_config, PDL_PATCH) and pdl_enabled(platform):
        if _inductor_has_pdl():
            patches[PDL_PATCH] = True
            log.info("PDL on (%s): Inductor patch %s=True", platform.describe(), PDL_PATCH)
        else:
            log.info("PDL: this Inductor has no %s option; only our Triton kernels use PDL", PDL_PATCH)
    patches.update(inductor_config or {})
    return patches


def compile_model(model: torch.nn.Module, platform: str | Platform = "auto", **options) -> CompiledModel:
    """Compile ``model``'s compile units with our backend; see the module docstring for options."""
    unknown = set(options) - _KNOWN_OPTIONS
    if unknown:
        raise TypeError(f"compile_model: unknown option(s) {sorted(unknown)}; known: {sorted(_KNOWN_OPTIONS)}")
    plat = resolve_platform(platform)
    _check_device(model, plat)
    dynamic = options.get("dynamic", "tokens")
    if dynamic not in DYNAMIC_CHOICES:
        raise ValueError(f"dynamic must be one of {DYNAMIC_CHOICES}, got {dynamic!r}")
    patches = inductor_patches(options.get("mode"), options.get("inductor_config"), plat)
    backend_name = options.get("attention_backend")
    plat.select_attention_backend(backend_name)  # validate early (unknown / unavailable -> ValueError)
    names = list(options.get("units") or getattr(model, "compile_units", ()))
    if not names:
        raise ValueError(f"{type(model).__name__} names no compile_units")
    missing = [n for n in names if not callable(getattr(type(model), n, None))]
    if missing:
        raise ValueError(f"{type(model).__name__} has no method(s) {missing} to compile")
    dump_dir = options.get("dump_dir")
    if dump_dir is not None:
        dump_dir = Path(dump_dir)
        dump_dir.mkdir(parents=True, exist_ok=True)
        options = {**options, "dump_dir": dump_dir}
    manager = PassManager(build_passes(options.get("passes")))
    units = {}
    for name in names:
        ctx = PassContext(platform=plat, attention_backend=backend_name, unit=name)
        backend = UnitBackend(name, manager, ctx, options.get("inductor", True), patches, dump_dir)
        units[name] = CompiledUnit(model, name, backend, dynamic, options.get("fullgraph", True))
    for name, unit in units.items():
        setattr(model, name, unit)
    log.info(
        "compile_model: %s on %s, units %s, passes %s, dynamic=%s",
        type(model).__name__,
        plat.describe(),
        names,
        manager.names,
        dynamic,
    )
    return CompiledModel(model, plat, units, manager, options)


# ------------------------------------------------------------------------------------ graph capture only
def capture_unit_graph(model: torch.nn.Module, unit: str, *args, dynamic: str = "tokens", **kwargs) -> fx.GraphModule:
    """The FX graph Dynamo captures for ``model.<unit>(*args, **kwargs)``, before any pass, without
    compiling or keeping anything installed (for snapshots and pass tests). The unit runs once
    eagerly (the recording backend returns the graph itself)."""
    graphs: list[fx.GraphModule] = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    method = private_method(model, unit)
    if dynamic == "tokens":
        mark_dynamic_args(inspect.signature(method).bind(*args, **kwargs), _dims_table(model))
    compiled = torch.compile(method, backend=record, fullgraph=True, dynamic=None if dynamic == "auto" else False)
    with torch.no_grad():
        compiled(*args, **kwargs)
    if len(graphs) != 1:
        raise RuntimeError(f"expected one graph for {unit}, Dynamo produced {len(graphs)}")
    return graphs[0]


def run_passes(
    gm: fx.GraphModule,
    platform: str | Platform,
    passes: Iterable | None = None,
    attention_backend: str | None = None,
    unit: str = "?",
) -> list[PassRecord]:
    """Apply our passes for ``platform`` to ``gm`` in place (``platform`` may be a mock: graph only)."""
    plat = platform if isinstance(platform, Platform) else get_platform(platform, allow_unavailable=True)
    manager = PassManager(build_passes(passes))
    return manager.run(gm, PassContext(platform=plat, attention_backend=attention_backend, unit=unit))
