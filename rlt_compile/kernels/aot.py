"""Ahead-of-time compilation of every Triton kernel in ``rlt_compile.kernels`` for a GPU target.

No GPU is needed: ``triton.compile(ASTSource(...), target=GPUTarget(...))`` runs the whole Triton
pipeline on the CPU (HIP: down to the hsaco through the bundled LLVM; CUDA: down to the cubin through
the ``ptxas`` that ships in the Triton wheel). This proves that the kernels build for AMD targets
(gfx942 = MI300, gfx950 = MI350) without AMD hardware, and reports registers / spills / shared memory
per specialisation.

What gets compiled is *discovered*, not hard-coded:

1. :func:`discover_kernels` lists every Triton kernel of the package: ``@triton.jit`` functions and
   the plain kernel functions (any parameter annotated ``tl.constexpr``) of each module.
2. :func:`capture_launches` runs the real launchers (``kv_write_triton``, ``paged_attention_triton``)
   on ``meta`` tensors with ``JITFunction.run`` replaced by a recorder, for each workload shape (the
   supported model families), dtype and batch mode (prefill, decode, split-K decode), with the
   ``tl.dot`` precision the target's :class:`~rlt_compile.platform.Platform` picks
   (``Platform.mock(kind, arch=...).dot_precision(dtype)``). The tile sizes, warps, stages, split
   counts and constexprs are therefore exactly those the launchers choose; nothing is duplicated.
3. Each recorded launch is bound the way ``JITFunction.run`` binds it on the target (Triton's own
   argument specialisation: dtypes, ``== 1`` ints as constexprs, divisibility by 16), identical
   bindings are merged, and :func:`compile_for` compiles each once.

Metadata (:class:`KernelReport`): ``n_regs`` and ``n_spills`` follow Triton's runtime definitions
(``CompiledKernel.n_regs`` / ``n_spills`` = registers per thread and local-memory bytes / 4), read
from the compiler output instead of a driver: the ``ptxas -v`` log on CUDA, the AMDGPU kernel
descriptor (``.vgpr_count``, ``.private_segment_fixed_size``, ...) in the amdgcn assembly on HIP.
``shared`` is ``metadata.shared`` (bytes of shared memory / LDS per program).

CLI: ``python -m rlt_compile.kernels.aot --target gfx950 [--target sm_90 ...]`` prints the table;
``--pdl 2`` builds the variants with the PDL prologue that an H200 launches (``RLT_ATTENTION_CONFIG``
and ``RLT_GEMV_CONFIG`` apply as on a GPU); ``--sass DIR`` writes each CUDA kernel's SASS there and
prints its ``memory_order`` (global loads and stores, the PDL wait and barriers in program order).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import itertools
import math
import pkgutil
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlt_compile import platform as _platform
from rlt_compile.platform import Platform

__all__ = [
    "DTYPES",
    "MODES",
    "TARGETS",
    "WORKLOADS",
    "KernelReport",
    "Launch",
    "Specialisation",
    "Workload",
    "capture_launches",
    "compile_for",
    "compile_specialisation",
    "discover_kernels",
    "format_table",
    "gpu_target",
    "new_executor",
    "specialisations",
]

# Named targets: name -> (platform kind, arch).
TARGETS: dict[str, tuple[str, str]] = {
    "sm_90": ("cuda", "sm_90"),  # H100 / H200
    "gfx942": ("rocm", "gfx942"),  # MI300X / MI300A / MI325X
    "gfx950": ("rocm", "gfx950"),  # MI350X / MI355X
}

# Shared memory (LDS) one program may use: sm_90 227 KiB of its 228 KiB; CDNA3 64 KiB; CDNA4 160 KiB.
MAX_SHARED_BYTES: dict[str, int] = {"sm_90": 232448, "gfx942": 65536, "gfx950": 163840}

DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
MODES: tuple[str, ...] = ("prefill", "decode", "decode-split")

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Workload:
    """The attention shape of a model family (what the launchers specialise on)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16  # KV-cache block (EngineConfig.block_size default)
    max_model_len: int = 4096
    # Blocks of one KV-cache plane. On AMD, Triton specialises pointers to tensors of at most 2 GiB
    # (buffer loads with 32-bit offsets, ``tt.pointer_range``); engine pools produce both cases
    # (many loop slots -> small planes), so the workloads below cover both.
    num_blocks: int = 4096
    hidden_size: int = 0  # the residual stream (RMSNorm kernels); 0 = num_heads * head_dim
    intermediate_size: int = 0  # the MLP's width (the down projection's GEMV); 0: none launched

    @property
    def hidden(self) -> int:
        return self.hidden_size or self.num_heads * self.head_dim


# The supported families (docs/models.md): MHA with head_dim 128, GQA 48/8, and a head_dim that is not
# a power of two (padded to 128 with masks); KV planes under and over 2 GiB.
WORKLOADS: tuple[Workload, ...] = (
    # 1 GiB bf16 plane
    Workload("ouro-1.4b", num_heads=16, num_kv_heads=16, head_dim=128, num_blocks=8192, intermediate_size=5632),
    # 4 GiB plane; hidden 3072 (its q_proj widens to 48 x 128 = 6144)
    Workload(
        "nanbeige-4.2-3b",
        num_heads=48,
        num_kv_heads=8,
        head_dim=128,
        num_blocks=65536,
        hidden_size=3072,
        intermediate_size=10752,
    ),
    # 0.8 GiB plane
    Workload("huginn-0125", num_heads=55, num_kv_heads=55, head_dim=96, num_blocks=2048, intermediate_size=17920),
)


# ----------------------------------------------------------------------------------------- targets
def gpu_target(kind: str, arch: str):
    """The ``triton.backends.compiler.GPUTarget`` of a platform kind/arch (warp size from the Platform)."""
    from triton.backends.compiler import GPUTarget

    p = Platform.mock(kind, arch=arch)
    if kind == "cuda":
        if not (arch.startswith("sm_") and arch[3:].rstrip("a").isdigit()):
            raise ValueError(f"CUDA arch must look like 'sm_90', got {arch!r}")
        return GPUTarget("cuda", int(arch[3:].rstrip("a")), p.warp_size)
    if kind == "rocm":
        if not arch.startswith("gfx"):
            raise ValueError(f"ROCm arch must look like 'gfx942', got {arch!r}")
        return GPUTarget("hip", arch, p.warp_size)
    raise ValueError(f"no GPU target for platform kind {kind!r}; GPU kinds: cuda, rocm")


def _resolve_target(target_kind: str, arch: str | None) -> tuple[str, str]:
    if target_kind in TARGETS and arch is None:
        return TARGETS[target_kind]
    if arch is None:
        raise ValueError(f"arch is required for target kind {target_kind!r} (named targets: {sorted(TARGETS)})")
    return target_kind, arch


# ------------------------------------------------------------------------------------------ kernels
def _is_constexpr_annotation(annotation) -> bool:
    import triton.language as tl

    if annotation is tl.constexpr:
        return True
    return isinstance(annotation, str) and annotation.replace(" ", "") in ("tl.constexpr", "triton.language.constexpr")


def _is_kernel(obj, module_name: str) -> bool:
    """A kernel is a function named ``*_kernel`` with constexpr parameters (or a JITFunction of that
    name): ``@triton.jit`` helpers that kernels call are compiled into them, not on their own."""
    from triton.runtime.jit import JITFunction

    if not getattr(_python_fn(obj), "__name__", "").endswith("_kernel"):
        return False
    if _is_gluon(obj) or isinstance(obj, JITFunction):
        return getattr(obj, "module", module_name) == module_name
    if not inspect.isfunction(obj) or obj.__module__ != module_name:
        return False
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(_is_constexpr_annotation(p.annotation) for p in params)


def _is_gluon(obj) -> bool:
    return type(obj).__name__ == "GluonJITFunction"


def kernel_modules() -> list[str]:
    """The modules of ``rlt_compile.kernels`` (this one excluded)."""
    import rlt_compile.kernels as package

    names = [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    return sorted(n for n in names if n != __name__)


def discover_kernels(modules: Iterable[str] | None = None, platform: Platform | None = None) -> dict[str, Callable]:
    """Every Triton kernel of the kernel modules: ``"module.function"`` -> the function (or JITFunction).
    With ``platform``, only the kernels built for it: a module whose ``REQUIRES`` names a
    :class:`~rlt_compile.platform.Platform` capability (e.g. ``"supports_tma"``) the platform lacks is
    skipped."""
    found: dict[str, Callable] = {}
    for module_name in kernel_modules() if modules is None else modules:
        module = importlib.import_module(module_name)
        requires = getattr(module, "REQUIRES", None)
        if platform is not None and requires is not None and not getattr(platform, requires):
            continue
        for name, obj in vars(module).items():
            if _is_kernel(obj, module_name):
                found[f"{module_name}.{name}"] = obj
    return found


def _python_fn(obj) -> Callable:
    return getattr(obj, "fn", obj)


def _jit(obj):
    """A ``JITFunction`` for a kernel (plain kernel functions are wrapped like the launchers do)."""
    from triton.runtime.jit import JITFunction

    return obj if isinstance(obj, JITFunction) else JITFunction(obj)


def _kernel_name(fn) -> str:
    fn = _python_fn(fn)
    return f"{fn.__module__}.{fn.__name__}"


# ------------------------------------------------------------------------------------------ capture
@dataclass
class Launch:
    """One recorded ``kernel[grid](*args, **kwargs)`` call."""

    kernel: str  # "module.function"
    fn: Callable  # the Python kernel function
    args: tuple
    kwargs: dict
    grid: object
    label: str


_CAPTURE_LOCK = threading.Lock()


@contextlib.contextmanager
def _recording(records: list, label: str):
    """Replace ``JITFunction.run`` (what ``kernel[grid](...)`` calls) by a recorder."""
    from triton.runtime.jit import JITFunction

    def run(self, *args, grid, warmup, **kwargs):
        records.append(Launch(_kernel_name(self.fn), self.fn, args, dict(kwargs), grid, label))
        return None

    with _CAPTURE_LOCK:
        original = JITFunction.run
        JITFunction.run = run
        try:
            yield
        finally:
            JITFunction.run = original


@contextlib.contextmanager
def _as_target(p: Platform, pdl: int = 0):
    """While the launchers run, answer device questions as the target would: ``current_platform()``
    is ``p`` and the kernel modules' SM count (``sm_count``, which sizes split-K and GEMV tiles) is ``p.num_sms``;
    on ``meta`` tensors it would otherwise be a CPU default. ``pdl``: the PDL mode every launcher
    picks (``launch.pdl_mode``; on ``meta`` tensors 0), to build the variants a GPU launches."""
    from rlt_compile.kernels import gemv, prefill_tma, rmsnorm, triton_attention

    def current() -> Platform:
        return p

    current.cache_clear = lambda: None  # type: ignore[attr-defined]
    patches = [(_platform, "current_platform", current)]
    if p.num_sms:  # the attention's split-K and the GEMVs' tiles (gemv_config) follow the SM count
        patches += [(module, "sm_count", lambda device: p.num_sms) for module in (triton_attention, gemv)]
    if pdl:
        patches += [(module, "pdl_mode", lambda t: pdl) for module in (triton_attention, prefill_tma, rmsnorm, gemv)]
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in originals:
            setattr(obj, name, value)


def _run_launchers(workload: Workload, dtype: torch.dtype, mode: str, precision: str) -> None:
    """Call the public launchers of ``triton_attention`` on meta tensors shaped like a real batch."""
    from rlt_compile.kernels import prefill_tma, triton_attention

    meta = torch.device("meta")
    w = workload
    if mode == "prefill":  # two sequences, multi-token queries (chunked prefill looks the same)
        query_lens, num_seqs = [96, 32], 2
    elif mode in ("decode", "decode-split"):
        query_lens, num_seqs = [1] * 8, 8
    else:
        raise ValueError(f"unknown mode {mode!r}; valid: {MODES}")
    num_tokens = sum(query_lens)
    blocks_per_seq = math.ceil(w.max_model_len / w.block_size)
    num_blocks = max(w.num_blocks, num_seqs * blocks_per_seq)

    q = torch.empty(num_tokens, w.num_heads, w.head_dim, dtype=dtype, device=meta)
    k = torch.empty(num_tokens, w.num_kv_heads, w.head_dim, dtype=dtype, device=meta)
    v = torch.empty_like(k)
    kv_cache = torch.empty(2, num_blocks, w.block_size, w.num_kv_heads, w.head_dim, dtype=dtype, device=meta)
    slot_mapping = torch.empty(num_tokens, dtype=torch.int64, device=meta)
    block_tables = torch.empty(num_seqs, blocks_per_seq, dtype=torch.int32, device=meta)
    seq_lens = torch.empty(num_seqs, dtype=torch.int32, device=meta)
    query_start_loc = torch.empty(num_seqs + 1, dtype=torch.int32, device=meta)

    split_k = {"prefill": None, "decode": False, "decode-split": True}[mode]
    metadata = (block_tables, seq_lens, query_start_loc, w.head_dim**-0.5)
    triton_attention.kv_write_triton(k, v, kv_cache, slot_mapping)
    # The unified kernel (prefill / mixed batches; for decode shapes with the decode kernel turned off).
    triton_attention.paged_attention_triton(
        q, kv_cache, *metadata, precision=precision, split_k=split_k, config={"decode": False}
    )
    if mode == "prefill" and prefill_tma_serves(w, dtype):
        # the default (the Gluon kernel where the target has wgmma), then the TMA kernel: that GPU's fallback
        # for caches the Gluon kernel cannot read, and every prefill on targets without wgmma
        for config in (None, {"gluon_prefill": 0}):
            prefill_tma.prefill_tma_attention(
                q, k, v, kv_cache, *metadata, precision=precision, config=config, slot_mapping=slot_mapping
            )
    if mode != "prefill":  # what rlt::attention_triton runs for all-decode batches: the decode kernel, KV write fused
        triton_attention.attention_forward(
            q, k, v, kv_cache, slot_mapping, *metadata, precision=precision, split_k=split_k
        )
    if mode == "decode-split":  # batch 1 too: a small GQA grid merges its many splits in the reduce kernel
        one = (block_tables[:1], seq_lens[:1], query_start_loc[:2], metadata[-1])
        triton_attention.attention_forward(
            q[:1], k[:1], v[:1], kv_cache, slot_mapping[:1], *one, precision=precision, split_k=split_k
        )


def prefill_tma_serves(workload: Workload, dtype: torch.dtype) -> bool:
    """Whether ``attention_forward`` sends this workload's prefill to the TMA kernel on the current
    (mocked) platform."""
    from rlt_compile.kernels import prefill_tma

    group = workload.num_heads // workload.num_kv_heads
    return prefill_tma.uses_prefill_tma(1024, 2, workload.head_dim, torch.device("cuda"), dtype, group=group)


def capture_launches(
    platform: Platform,
    workloads: Sequence[Workload] = WORKLOADS,
    dtypes: Sequence[torch.dtype] = DTYPES,
    modes: Sequence[str] = MODES,
    precision: str | None = None,
    pdl: int = 0,
) -> list[Launch]:
    """Every kernel launch the launchers make for these workloads x dtypes x modes on ``platform``.

    ``precision`` overrides ``platform.dot_precision(dtype)`` (to build variants the Platform would
    never pick, e.g. tf32 on ROCm); ``pdl`` is the PDL mode the launchers pick (``_as_target``)."""
    records: list[Launch] = []
    for w in workloads:
        for dtype in dtypes:
            prec = precision or platform.dot_precision(dtype)
            for mode in modes:
                label = f"{w.name}/{_DTYPE_NAMES.get(dtype, dtype)}/{mode}"
                with _as_target(platform, pdl), _recording(records, label):
                    _run_launchers(w, dtype, mode, prec)
                    _run_norm_launchers(w, dtype, mode)
                    _run_gemv_launchers(w, dtype, mode)
    return records


def _run_norm_launchers(workload: Workload, dtype: torch.dtype, mode: str) -> None:
    """The fused RMSNorm kernel in each variant the fuse_rmsnorm pass emits, on meta tensors."""
    from rlt_compile.kernels import rmsnorm

    rows = 128 if mode == "prefill" else 8
    y = torch.empty(rows, workload.hidden, dtype=dtype, device="meta")
    w = torch.empty(workload.hidden, dtype=dtype, device="meta")
    rmsnorm.rmsnorm_triton(y, w, 1e-6)
    rmsnorm.add_rmsnorm_triton(y, y, w, 1e-6)
    rmsnorm.add_rmsnorm2_triton(y, y, w, w, 1e-6, 1e-6)
    rmsnorm.add_rmsnorm_rmsnorm_triton(y, y, w, w, 1e-6, 1e-6)


def _run_gemv_launchers(workload: Workload, dtype: torch.dtype, mode: str) -> None:
    """The decode GEMV (``kernels/gemv.py``) as the gemv_swap pass uses it: one row (no ``tl.dot``)
    and 8 rows (the 16-row ``tl.dot`` tile every 2-16 rows share), plain and with the SwiGLU gate
    folded in, on a square weight and on the down projection's (``intermediate_size``, whose rows pick
    the longer runs); one row with the rotary epilogue (on the fused q/k/v weight) and with the SwiGLU
    gate epilogue (on the gate/up weight), and the rotary and gating kernels for more rows. Prefill
    linears run ``F.linear``."""
    if mode == "prefill":
        return
    from rlt_compile.kernels import gemv

    for k in filter(None, (workload.hidden, workload.intermediate_size)):
        for rows in (1, 8):
            w = torch.empty(workload.hidden, k, dtype=dtype, device="meta")
            gemv.linear_gemv(torch.empty(rows, k, dtype=dtype, device="meta"), w)
            gemv.linear_gemv(torch.empty(rows, 2 * k, dtype=dtype, device="meta"), w, silu_mul=True)
    half = workload.head_dim // 2  # the fused q/k/v GEMV with its rotary epilogue (fuse_rope_gemv)
    cos = torch.empty(1, half, dtype=torch.float32, device="meta")
    q_cols, kv_cols = workload.num_heads * workload.head_dim, workload.num_kv_heads * workload.head_dim
    qkv = torch.empty(q_cols + 2 * kv_cols, workload.hidden, dtype=dtype, device="meta")
    rope = gemv.RopeColumns(cos, cos, 0, q_cols + kv_cols, workload.head_dim)  # q and k rotate
    gemv.linear_gemv(torch.empty(1, workload.hidden, dtype=dtype, device="meta"), qkv, rope=rope)
    gate_up = torch.empty(
        2 * (workload.intermediate_size or workload.hidden), workload.hidden, dtype=dtype, device="meta"
    )
    gemv.linear_gemv(torch.empty(1, workload.hidden, dtype=dtype, device="meta"), gate_up, swiglu=True)
    gemv.silu_gate_triton(torch.empty(8, gate_up.shape[0], dtype=dtype, device="meta"))  # fuse_swiglu_gemv
    tables = torch.empty(8, half, dtype=torch.float32, device="meta")  # more rows: the rotary kernel alone
    rows = gemv.RopeColumns(tables, tables, rope.lo, rope.hi, rope.head_dim)
    gemv.rope_columns_triton(torch.empty(8, qkv.shape[0], dtype=dtype, device="meta"), rows)


# ------------------------------------------------------------------------------ specialisations
@dataclass
class Specialisation:
    """One compile job: a kernel bound for a target exactly as ``JITFunction.run`` would bind it."""

    kernel: str  # "module.function"
    signature: dict[str, str]  # parameter -> Triton type ("*bf16", "i32", "fp32", "constexpr", ...)
    constexprs: dict  # (index,) -> value
    attrs: dict  # (index,) -> [["tt.divisibility", 16]]
    options: dict  # num_warps, num_stages, ...
    labels: list[str] = field(default_factory=list)  # the workload/dtype/mode launches it serves

    @property
    def short_name(self) -> str:
        return self.kernel.rsplit(".", 1)[-1].strip("_")

    def named_constexprs(self) -> dict[str, object]:
        names = list(self.signature)
        return {names[k[0]]: v for k, v in self.constexprs.items() if len(k) == 1 and k[0] < len(names)}

    def describe(self) -> str:
        """The block sizes / tile constexprs (upper-case names) and launch options."""
        cx = {k: v for k, v in self.named_constexprs().items() if k.isupper()}
        return " ".join(f"{k}={v}" for k, v in cx.items() if k != "PRECISION")

    def dtypes(self) -> str:
        """The model dtypes of the launches it serves (from the labels)."""
        seen = dict.fromkeys(label.split("/")[1] for label in self.labels if label.count("/") >= 2)
        return ",".join(seen) or "-"

    def key(self) -> str:
        return repr(
            (
                self.kernel,
                sorted(self.signature.items()),
                sorted(self.constexprs.items()),
                self.attrs,
                sorted(self.options.items()),
            )
        )


def _fallback_bind(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """Simplified ``JITFunction`` binding, for Triton versions without the private binder."""
    sig = inspect.signature(fn)
    params = list(sig.parameters)
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
    options = {k: v for k, v in kwargs.items() if k not in params}
    names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32"}
    names |= {torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "u1"}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(params):
        value = bound.arguments.get(name, sig.parameters[name].default)
        if _is_constexpr_annotation(sig.parameters[name].annotation) or value == 1 and type(value) is int:
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + names[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "u1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"cannot bind argument {name}={value!r} of {fn.__name__}")
    return signature, constexprs, attrs, options


def _bind(launch: Launch, target) -> Specialisation:
    """Bind a launch for ``target`` with Triton's own JIT specialisation (same signature, constexprs
    and divisibility attributes that ``kernel[grid](...)`` would compile on that GPU)."""
    from triton.compiler import make_backend

    jit = _jit(launch.fn)
    backend = make_backend(target)
    try:
        from triton.runtime.jit import create_function_from_signature

        binder = create_function_from_signature(jit.signature, jit.params, backend)
        bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
        parsed, signature, constexprs, attrs = jit._pack_args(
            backend, launch.kwargs, bound_args, specialization, options
        )
        chosen = {k: v for k, v in launch.kwargs.items() if k in parsed.__dict__}
    except (ImportError, AttributeError, TypeError):
        signature, constexprs, attrs, chosen = _fallback_bind(_python_fn(launch.fn), launch.args, launch.kwargs)
    return Specialisation(launch.kernel, dict(signature), dict(constexprs), dict(attrs), chosen, [launch.label])


def specialisations(
    platform: Platform,
    target=None,
    workloads: Sequence[Workload] = WORKLOADS,
    dtypes: Sequence[torch.dtype] = DTYPES,
    modes: Sequence[str] = MODES,
    precision: str | None = None,
    pdl: int = 0,
) -> list[Specialisation]:
    """The distinct compile jobs for ``platform`` (launches that bind identically are merged)."""
    target = target or gpu_target(platform.kind, platform.arch)
    merged: dict[str, Specialisation] = {}
    for launch in capture_launches(platform, workloads, dtypes, modes, precision, pdl):
        spec = _bind(launch, target)
        key = spec.key()
        if key in merged:
            merged[key].labels.extend(spec.labels)
        else:
            merged[key] = spec
    return list(merged.values())


# ------------------------------------------------------------------------------------------ compile
@dataclass
class KernelReport:
    """The result of compiling one specialisation for one target."""

    target: str  # arch, e.g. "gfx950"
    kind: str  # "cuda" | "rocm"
    spec: Specialisation
    precision: str | None  # the PRECISION constexpr when the kernel has one
    ok: bool
    error: str | None = None
    n_regs: int | None = None  # registers per thread (VGPRs on AMD)
    n_spills: int | None = None  # Triton's definition: local/scratch bytes per thread / 4
    spill_stores: int | None = None  # bytes (ptxas) / spilled VGPRs (AMD)
    spill_loads: int | None = None  # bytes (ptxas) / spilled SGPRs (AMD)
    shared: int | None = None  # bytes of shared memory / LDS per program
    max_shared: int | None = None
    extra: dict = field(default_factory=dict)
    compile_s: float = 0.0

    @property
    def fits(self) -> bool:
        return self.ok and (self.max_shared is None or (self.shared or 0) <= self.max_shared)


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
# ptxas's own performance notes, e.g. "(C7515) Potential Performance Loss: wgmma.mma_async
# instructions are serialized due to ...": every wgmma of the kernel then waits for the previous one
_PTXAS_PERF = re.compile(r"(\(C\d+\) Potential Performance Loss: .*?)(?: in the function '\w+'.*)?$", re.MULTILINE)
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _parse_ptxas_log(log: str, name: str) -> dict:
    """Registers, stack and spills of function ``name`` from a ``ptxas -v`` log."""
    section = log
    marker = f"Function properties for {name}"
    if marker in log:
        section = log[log.index(marker) :]
    out = {}
    if m := _PTXAS_SPILLS.search(section):
        out["stack"], out["spill_stores"], out["spill_loads"] = (int(g) for g in m.groups())
    if m := _PTXAS_REGS.search(section):
        out["n_regs"] = int(m.group(1))
    out["perf_warnings"] = [w.strip() for w in _PTXAS_PERF.findall(log)]
    return out


def _ptxas_rerun(ptx: str, arch: int) -> str:
    """``ptxas -v`` on the kernel's PTX (only when the compile's own log was not captured)."""
    import subprocess

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = f"{tmp}/k.ptx"
        with open(src, "w") as f:
            f.write(ptx)
        suffix = "a" if arch >= 90 else ""
        cmd = [get_ptxas(arch).path, "-v", "-lineinfo", "--regAllocOptLevel=2", f"--gpu-name=sm_{arch}{suffix}", src]
        done = subprocess.run([*cmd, "-o", f"{tmp}/k.o"], capture_output=True, text=True, check=True)
        return done.stdout + done.stderr


def _amdgpu_field(asm: str, name: str) -> int | None:
    m = re.search(rf"^\s*\.{re.escape(name)}:\s*(\d+)\s*$", asm, re.MULTILINE)
    return int(m.group(1)) if m else None


def _fill_metadata(report: KernelReport, kernel, ptxas_log: str, arch_num) -> None:
    md = kernel.metadata
    report.shared = int(getattr(md, "shared", 0) or 0)
    binary = "cubin" if report.kind == "cuda" else "hsaco"
    report.extra.update(
        num_warps=md.num_warps,
        num_stages=md.num_stages,
        warp_size=getattr(md, "warp_size", None) or md.target.warp_size,
        binary=binary,
        binary_bytes=len(kernel.asm.get(binary, b"")),
        hash=md.hash,
    )
    if report.kind == "cuda":
        info = _parse_ptxas_log(ptxas_log, md.name) if ptxas_log else {}
        if "n_regs" not in info and "ptx" in kernel.asm:
            info = _parse_ptxas_log(_ptxas_rerun(kernel.asm["ptx"], arch_num), md.name)
        report.n_regs = info.get("n_regs")
        report.extra["ptxas_perf_warnings"] = info.get("perf_warnings", [])
        if "stack" in info:
            report.n_spills = info["stack"] // 4  # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES / 4, as Triton
            report.spill_stores, report.spill_loads = info["spill_stores"], info["spill_loads"]
            report.extra["stack_bytes"] = info["stack"]
    else:
        asm = kernel.asm.get("amdgcn", "")
        vgpr, scratch = _amdgpu_field(asm, "vgpr_count"), _amdgpu_field(asm, "private_segment_fixed_size")
        report.n_regs = vgpr
        report.n_spills = None if scratch is None else scratch // 4  # HIP LOCAL_SIZE_BYTES / 4, as Triton
        report.spill_stores = _amdgpu_field(asm, "vgpr_spill_count")
        report.spill_loads = _amdgpu_field(asm, "sgpr_spill_count")
        report.extra.update(
            sgpr_count=_amdgpu_field(asm, "sgpr_count"),
            agpr_count=_amdgpu_field(asm, "agpr_count"),
            scratch_bytes=scratch,
            lds_static=_amdgpu_field(asm, "group_segment_fixed_size"),
        )
        if m := re.search(r"; Occupancy: (\d+)", asm):
            report.extra["occupancy"] = int(m.group(1))


@contextlib.contextmanager
def _private_cache():
    """A throw-away Triton cache, so every compile really runs (and ptxas logs its usage)."""
    from triton import knobs

    with tempfile.TemporaryDirectory(prefix="rlt-aot-") as tmp, knobs.cache.scope(), knobs.nvidia.scope():
        knobs.cache.dir = tmp
        knobs.nvidia.dump_ptxas_log = True
        yield


def compile_specialisation(spec: Specialisation, kind: str, arch: str, target=None, sass: bool = False) -> KernelReport:
    """Compile one specialisation for ``kind``/``arch`` (in a throw-away Triton cache, so the compile
    really runs and its ptxas log is captured); failures are reported, not raised. ``sass`` (CUDA):
    also disassemble the cubin into ``extra["sass"]`` and its ``memory_order`` into
    ``extra["memory_order"]``."""
    import triton

    target = target or gpu_target(kind, arch)
    module_name, fn_name = spec.kernel.rsplit(".", 1)
    fn = getattr(importlib.import_module(module_name), fn_name)
    precision = spec.named_constexprs().get("PRECISION")
    report = KernelReport(arch, kind, spec, precision, ok=False, max_shared=MAX_SHARED_BYTES.get(arch))
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with _private_cache(), contextlib.redirect_stdout(log):
            source = _source_class(fn)(_jit(fn), spec.signature, spec.constexprs, spec.attrs)
            kernel = triton.compile(source, target=target, options=dict(spec.options))
    except Exception as exc:  # CompilationError, ptxas failure, LLVM error: a failed target
        report.error = f"{type(exc).__name__}: {exc}"
        report.compile_s = time.perf_counter() - start
        return report
    report.compile_s = time.perf_counter() - start
    report.ok = True
    _fill_metadata(report, kernel, log.getvalue(), target.arch)
    if sass and kind == "cuda":
        report.extra["sass"] = disassemble(kernel.asm["cubin"])
        report.extra["memory_order"] = memory_order(report.extra["sass"])
    return report


def _source_class(fn):
    """Triton's ``ASTSource``, or Gluon's for a Gluon kernel (``kernels/prefill_gluon.py``)."""
    if _is_gluon(fn):
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource
    from triton.compiler import ASTSource

    return ASTSource


def nvdisasm_path() -> Path:
    """The ``nvdisasm`` that ships in the Triton wheel (some wheels have none)."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"


def disassemble(cubin: bytes) -> str:
    """The SASS of a cubin, through ``nvdisasm_path()``."""
    import subprocess

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(nvdisasm_path()), "-c", f.name], capture_output=True, text=True, check=True).stdout


_SASS_MEMORY_OPS = (
    ("ACQBULK", "WAIT"),  # griddepcontrol.wait: the PDL wait
    ("LDGSTS", "LDGSTS"),
    ("LDG", "LDG"),
    ("STG", "STG"),
    ("ATOMG", "ATOM"),  # global atomics (ATOMS is shared memory)
    ("ATOM.", "ATOM"),
    ("RED.", "ATOM"),  # a global reduction (REDUX is a warp reduction in registers)
    ("BAR.SYNC", "BAR"),
)


def memory_order(sass: str) -> str:
    """The global memory accesses, PDL wait and barriers of a kernel's SASS in program order, runs
    collapsed: ``"LDG*2 WAIT LDG*2 BAR BAR STG"``. A load that follows a ``BAR`` though its address
    does not depend on the reduction before it costs a memory round trip of its own at batch 1."""
    tokens: list[str] = []
    for line in sass.splitlines():
        match = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if not match:
            continue
        op = match.group(1)
        token = next((name for prefix, name in _SASS_MEMORY_OPS if op.startswith(prefix)), None)
        if token:
            tokens.append(token)
    runs = [(token, len(list(group))) for token, group in itertools.groupby(tokens)]
    return " ".join(token if n == 1 else f"{token}*{n}" for token, n in runs)


def compile_for(
    target_kind: str,
    arch: str | None = None,
    *,
    workloads: Sequence[Workload] = WORKLOADS,
    dtypes: Sequence[torch.dtype] = DTYPES,
    modes: Sequence[str] = MODES,
    precision: str | None = None,
    pdl: int = 0,
    specs: Sequence[Specialisation] | None = None,
    executor: Executor | None = None,
    sass: bool = False,
) -> list[KernelReport]:
    """Compile every kernel specialisation for a target, ahead of time, without a GPU.

    ``target_kind`` is a platform kind ("cuda" | "rocm") with ``arch`` ("sm_90", "gfx942", ...), or a
    named target of :data:`TARGETS` ("gfx950"). The dot precision of each dtype is
    ``Platform.mock(kind, arch=arch).dot_precision(dtype)`` unless ``precision`` overrides it.
    ``pdl``: the kernels' PDL mode (``USE_PDL``; 0 by default, as on ``meta`` tensors; an H200 runs 2).
    ``sass``: disassemble each CUDA kernel (``compile_specialisation``).
    ``executor``: a process pool (``new_executor``) to compile in parallel; compiles hold the GIL and
    capture the ptxas log from stdout, so threads do not work. Returns one :class:`KernelReport` per
    distinct specialisation (``ok`` False with ``error`` when the compiler rejected it)."""
    kind, arch = _resolve_target(target_kind, arch)
    p = Platform.mock(kind, arch=arch)
    target = gpu_target(kind, arch)
    if specs is None:
        specs = specialisations(p, target, workloads, dtypes, modes, precision, pdl)
    if executor is not None:
        n = len(specs)
        return list(executor.map(compile_specialisation, specs, [kind] * n, [arch] * n, [None] * n, [sass] * n))
    return [compile_specialisation(s, kind, arch, target, sass) for s in specs]


def new_executor(jobs: int | None = None) -> Executor:
    """A process pool for :func:`compile_for` (spawned workers: no forked MLIR/LLVM state)."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    jobs = jobs or max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1, 8))
    return ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))


# ------------------------------------------------------------------------------------------- report
def format_table(reports: Sequence[KernelReport]) -> str:
    """A plain-text table: target, kernel, dtype, tiles, precision, registers, spills, shared memory."""
    header = ("target", "kernel", "dtype", "constexprs", "warps", "stages", "prec", "regs", "n_spills", "spill st/ld")
    header += ("shared", "s")
    rows = [header]
    for r in reports:
        spills = "-" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
        rows.append(
            (
                r.target,
                r.spec.short_name,
                r.spec.dtypes(),
                r.spec.describe(),
                str(r.extra.get("num_warps", r.spec.options.get("num_warps", "-"))),
                str(r.extra.get("num_stages", r.spec.options.get("num_stages", "-"))),
                r.precision or "-",
                "-" if r.n_regs is None else str(r.n_regs),
                "-" if r.n_spills is None else str(r.n_spills),
                spills,
                "-" if r.shared is None else str(r.shared),
                f"{r.compile_s:.1f}" if r.ok else "FAIL",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = {
        "cuda": "cuda: spill st/ld = bytes of spill stores/loads (ptxas -v)",
        "rocm": "rocm: regs = VGPRs; spill st/ld = spilled VGPRs/SGPRs (SGPRs spill to VGPR lanes, cheap)",
    }
    lines += [notes[k] for k in ("cuda", "rocm") if any(r.kind == k for r in reports)]
    for r in reports:
        if not r.ok:
            lines.append(f"FAILED {r.target} {r.spec.short_name} [{', '.join(r.spec.labels)}]: {r.error}")
        for warning in r.extra.get("ptxas_perf_warnings", []):
            lines.append(f"PTXAS {r.target} {r.spec.short_name} [{r.spec.describe()}]: {warning}")
    return "\n".join(lines)


def _write_sass(reports: Sequence[KernelReport], out: Path) -> None:
    """Each disassembled report's SASS as ``out/<kernel>-<n>.sass``, and its memory order printed."""
    out.mkdir(parents=True, exist_ok=True)
    for n, report in enumerate(r for r in reports if "sass" in r.extra):
        name = f"{report.spec.kernel.rsplit('.', 1)[-1].lstrip('_')}-{n}"
        (out / f"{name}.sass").write_text(report.extra["sass"])
        constexprs = " ".join(f"{k}={v}" for k, v in report.spec.named_constexprs().items())
        print(f"{name}  {constexprs}\n    {report.extra['memory_order']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", help=f"named target ({', '.join(TARGETS)}) or kind:arch")
    parser.add_argument("--dtype", action="append", choices=sorted(_DTYPE_NAMES.values()))
    parser.add_argument("--mode", action="append", choices=MODES)
    parser.add_argument("--workload", action="append", choices=[w.name for w in WORKLOADS])
    parser.add_argument("--precision", choices=("ieee", "tf32"), help="override the Platform's dot precision")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    parser.add_argument(
        "--pdl", type=int, default=0, choices=(0, 1, 2), help="USE_PDL of every kernel (an H200 launches 2)"
    )
    parser.add_argument(
        "--sass", type=Path, metavar="DIR", help="CUDA: write each kernel's SASS there and print its memory order"
    )
    args = parser.parse_args(argv)
    by_name = {v: k for k, v in _DTYPE_NAMES.items()}
    dtypes = tuple(by_name[d] for d in args.dtype) if args.dtype else DTYPES
    workloads = tuple(w for w in WORKLOADS if not args.workload or w.name in args.workload)
    failed = 0
    with contextlib.ExitStack() as stack:
        executor = stack.enter_context(new_executor(args.jobs)) if args.jobs > 1 else None
        for name in args.target or list(TARGETS):
            kind, arch = name.split(":", 1) if ":" in name else _resolve_target(name, None)
            reports = compile_for(
                kind,
                arch,
                workloads=workloads,
                dtypes=dtypes,
                modes=tuple(args.mode or MODES),
                precision=args.precision,
                pdl=args.pdl,
                executor=executor,
                sass=args.sass is not None,
            )
            print(format_table(reports), end="\n\n")
            if args.sass is not None:
                _write_sass(reports, args.sass / arch)
            failed += sum(not r.fits for r in reports)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
