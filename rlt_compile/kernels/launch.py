"""How this package launches its Triton kernels: compiled for the GPU or run by Triton's CPU
interpreter, with or without Programmatic Dependent Launch, sized by the device's SM count.

Every kernel module (attention, GEMV, RMSNorm, TMA prefill) launches through these helpers. Kernels
are plain functions wrapped lazily per mode (``kernel_for``), so importing a kernel module before
``TRITON_INTERPRET=1`` is set does not break CPU runs. The PDL contract the kernels follow (trigger,
wait, what may be read before the wait) is in ``triton_attention``'s docstring.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import triton
import triton.language as tl

from rlt_compile import envs
from rlt_compile import platform as _platform

__all__ = [
    "interpreter_scope",
    "is_interpreted",
    "kernel_for",
    "pdl_launch_options",
    "pdl_mode",
    "pdl_trigger_first",
    "pdl_wait",
    "sm_count",
]

_INTERPRETER_LOCK = threading.Lock()
_KERNELS: dict[tuple[str, bool], object] = {}


def kernel_for(fn, interpret: bool):
    """The kernel ``fn`` compiled for the GPU, or wrapped for Triton's CPU interpreter."""
    key = (fn.__name__, interpret)
    kernel = _KERNELS.get(key)
    if kernel is None:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            kernel = InterpretedFunction(fn)
        else:
            from triton.runtime.jit import JITFunction

            kernel = JITFunction(fn)
        _KERNELS[key] = kernel
    return kernel


def is_interpreted(t: torch.Tensor) -> bool:
    """Whether a launch on ``t`` runs in Triton's interpreter: CPU tensors do."""
    return t.device.type == "cpu"


def pdl_mode(t: torch.Tensor) -> int:
    """A launch's ``USE_PDL``: 0 without Programmatic Dependent Launch, 2 with it and the trigger
    first (``RLT_PDL_TRIGGER=early``, the default), 1 with it and the trigger after the kernel's
    ``gdc_wait`` (``RLT_PDL_TRIGGER=wait``). PDL only for CUDA tensors (never the interpreter's CPU tensors or the
    ``meta`` tensors ``aot.py`` records launches with) and when ``platform.pdl_enabled()``
    (``RLT_PDL``, ``Platform.supports_pdl``; environment reads, the rest cached). No device query: it
    runs at every launch, inside CUDA-graph capture too."""
    if not (t.is_cuda and _platform.pdl_enabled()):
        return 0
    return 2 if envs.rlt_pdl_trigger() == "early" else 1


_PDL_OPTIONS: dict[int, dict] = {0: {}, 1: {"launch_pdl": True}, 2: {"launch_pdl": True}}


def pdl_launch_options(pdl: int) -> dict:
    """The launch keyword of PDL: ``launch_pdl=True`` when on, nothing otherwise. Never
    ``launch_pdl=False``: Triton rejects launch keywords its backend does not know
    ("Keyword argument launch_pdl was specified but unrecognised"), and ROCm's ``HIPOptions`` (and
    older NVIDIA backends) have no ``launch_pdl``."""
    return _PDL_OPTIONS[pdl]


@triton.jit
def pdl_trigger_first(USE_PDL: tl.constexpr):
    """A kernel's first statement: with ``USE_PDL == 2`` (``RLT_PDL_TRIGGER=early``) let the next grid
    launch before this one waits."""
    if USE_PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Programmatic Dependent Launch: block until the previous grid has finished and its writes are
    visible, then (if not done first) let the next grid launch. Nothing the previous kernel writes
    may be read before this."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


class _NoPatch:
    def restore(self) -> None:
        pass


_PATCHED = threading.local()  # per thread: its running interpreted launch's patches
_FAST_PATH_USERS = 0
_REAL_INTERPRETER_FUNCTIONS: dict = {}
_FAST_PATH_LOCK = threading.Lock()


def _patch_lang_once(real):
    """``real`` (Triton's ``interpreter._patch_lang``) once per language module and launch: a
    device-function call inside a running launch patches only modules the launch has not patched
    yet, and those patches stay until the launch restores its own."""

    def patch_lang(fn):
        langs = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        launch = getattr(_PATCHED, "launch", None)
        if launch is None:  # a launch's own patch, which it restores when its grid is done
            scope = real(fn)
            launch = _PATCHED.launch = {"langs": langs, "nested": []}
            restore = scope.restore

            def restore_launch():
                _PATCHED.launch = None
                for nested in reversed(launch["nested"]):
                    nested.restore()
                restore()

            scope.restore = restore_launch
            return scope
        if not langs <= launch["langs"]:  # e.g. tl.sum's module sees triton.language.core only
            launch["nested"].append(real(fn))
            launch["langs"] |= langs
        return _NoPatch()

    return patch_lang


def _np_dtype_cached(real):
    """``real`` (Triton's ``interpreter._get_np_dtype``, which builds a 20-entry table at every call,
    i.e. at nearly every interpreted op) answering from a table kept per element type."""
    table: dict = {}

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):  # unhashable; real() answers it before its table
            return real(tt_dtype)
        np_dtype = table.get(tt_dtype)
        if np_dtype is None:
            np_dtype = table[tt_dtype] = real(tt_dtype)
        return np_dtype

    return get_np_dtype


# Triton interpreter functions replaced while an interpreted launch runs, and their replacements
_FAST_PATHS = {"_patch_lang": _patch_lang_once, "_get_np_dtype": _np_dtype_cached}


@contextlib.contextmanager
def _interpreter_fast_paths():
    """Two costs of Triton's interpreter removed while any interpreted launch runs:

    - it patches ``triton.language`` again at every device-function call inside a kernel (hundreds
      of ``inspect.getmembers`` walks each time), though the kernel's own patch, in place until its
      grid is done, already covers the call: within this scope such calls skip it;
    - it maps each op's Triton dtype to a NumPy dtype by building a fresh table: cached here.

    Outside any interpreted launch the originals are back in place."""
    global _FAST_PATH_USERS
    from triton.runtime import interpreter

    names = [name for name in _FAST_PATHS if hasattr(interpreter, name)]  # other triton versions: fewer
    with _FAST_PATH_LOCK:
        if _FAST_PATH_USERS == 0:
            for name in names:
                _REAL_INTERPRETER_FUNCTIONS[name] = real = getattr(interpreter, name)
                setattr(interpreter, name, _FAST_PATHS[name](real))
        _FAST_PATH_USERS += 1
    try:
        yield
    finally:
        with _FAST_PATH_LOCK:
            _FAST_PATH_USERS -= 1
            if _FAST_PATH_USERS == 0:
                for name in names:
                    setattr(interpreter, name, _REAL_INTERPRETER_FUNCTIONS.pop(name))


@contextlib.contextmanager
def interpreter_scope(interpret: bool):
    """Let interpreted kernels call triton's own library functions (``tl.sum``, ``tl.max``,
    ``tl.cdiv``...) even when triton was imported before ``TRITON_INTERPRET=1`` was set: those are
    then ``JITFunction``s, which refuse to be called outside a compiled kernel. For the duration of
    an interpreted launch they run through the interpreter like the kernel itself."""
    from triton.runtime.jit import JITFunction

    if not interpret:
        yield
        return
    with _interpreter_fast_paths():
        if not isinstance(tl.sum, JITFunction):
            yield
            return
        from triton.runtime import interpreter

        original = JITFunction.__call__
        wrapped: dict[int, interpreter.InterpretedFunction] = {}

        def call(self, *args, **kwargs):
            fn = wrapped.get(id(self))
            if fn is None:
                fn = wrapped[id(self)] = interpreter.InterpretedFunction(self.fn)
            if not hasattr(fn, "rewrite"):  # pragma: no cover - other triton versions
                return fn(*args, **kwargs)
            # InterpretedFunction.__call__ (a device-function call) patches triton.language and never
            # restores it, which breaks later real compiles in the same process; restore it ourselves.
            scope = interpreter._patch_lang(fn.fn)
            try:
                return fn.rewrite()(*args, **kwargs)
            finally:
                scope.restore()

        with _INTERPRETER_LOCK:
            JITFunction.__call__ = call
            try:
                yield
            finally:
                JITFunction.__call__ = original


def sm_count(device: torch.device) -> int:
    """The SMs (CUs on ROCm) of ``device``, which size grids and split-K; 64 off the GPU (the
    interpreter, ``meta`` tensors; ``aot.py`` gives the attention launchers its target's count)."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 64


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
