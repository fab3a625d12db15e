"""The Platform: which machine we run on and every capability-gated decision (design contract 5).

This is the only module that looks at ``torch.version.hip`` / device properties. Everything else
asks a :class:`Platform`:

    p = current_platform()                  # detected once (cached) from torch
    p.kind                                  # "cuda" | "rocm" | "cpu"
    p.attention_backends()                  # auto order, e.g. ["flash", "triton", "torch"]
    p.select_attention_backend()            # honours RLT_ATTENTION_BACKEND
    p.dot_precision(torch.float32)          # tl.dot input_precision: "ieee" on ROCm, "tf32" allowed on CUDA
    get_platform("rocm", allow_unavailable=True)   # a ROCm platform on any machine, for graph-only tests
    Platform.mock("rocm", arch="gfx942")    # a hand-made platform for tests

ROCm never imports FlashAttention: its support check returns before even looking the package up.
CUDA graphs: ``torch.cuda.CUDAGraph`` also serves HIP graphs on ROCm builds of torch, so both GPU
kinds share the graph code (``Platform.graph_api``).

UVA (``uva_enabled``): with ``RLT_UVA=auto`` (default) we probe whether the device pointer of a
pinned host buffer equals its host pointer (``cudaHostGetDevicePointer`` / ``hipHostGetDevicePointer``
through ctypes); any failure means "no UVA", with the reason logged.

PDL (``pdl_enabled``): Programmatic Dependent Launch lets a kernel be launched while the previous
one in the stream is still running; the kernel waits for it with ``gdc_wait`` before touching
memory. ``Platform.supports_pdl``: NVIDIA only, compute capability >= 9.0 (Hopper), and a Triton
that has the GDC intrinsics and the ``launch_pdl`` launch option (feature-detected, cached).
``RLT_PDL=auto`` (default) follows it; ``0`` turns PDL off; ``1`` asks for it (still only where
supported, with a warning otherwise).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import importlib.util
import logging
import os
import platform as _pyplatform
import sys
from dataclasses import dataclass

import torch

from rlt_compile import envs

logger = logging.getLogger(__name__)

KINDS: tuple[str, ...] = ("cuda", "rocm", "cpu")
PLATFORM_CHOICES: tuple[str, ...] = ("auto", *KINDS)
ATTENTION_BACKEND_NAMES: tuple[str, ...] = ("flash", "triton", "torch")
FLASH_ATTN_PACKAGE = "flash_attn"

_MOCK_DEFAULTS: dict[str, dict] = {
    "cuda": {
        "device_name": "NVIDIA H200 (mock)",
        "capability": (9, 0),
        "arch": "sm_90",
        "warp_size": 32,
        "num_sms": 132,
    },
    "rocm": {
        "device_name": "AMD Instinct MI300X (mock)",
        "capability": (9, 4),
        "arch": "gfx942",
        "warp_size": 64,
        "num_sms": 304,
    },
    "cpu": {"device_name": "cpu (mock)", "capability": None, "arch": "cpu", "warp_size": 1, "num_sms": 0},
}


@dataclass(frozen=True)
class Platform:
    """A machine kind and its capabilities. Build with :func:`current_platform`, :func:`get_platform`
    or :meth:`Platform.mock`."""

    kind: str  # "cuda" | "rocm" | "cpu"
    device_name: str = "cpu"
    capability: tuple[int, int] | None = None  # compute capability (CUDA) / gfx major, minor (ROCm)
    arch: str = "cpu"  # "sm_90", "gfx942", or the CPU architecture
    warp_size: int = 1  # 32 on NVIDIA, 64 on CDNA
    num_sms: int = 0  # streaming multiprocessors / compute units
    total_memory: int = 0  # bytes of device memory
    available: bool = True  # False: a platform this machine does not have (mock / graph-only)
    flash_attn_installed: bool | None = None  # None: look the package up when asked (CUDA only)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown platform kind {self.kind!r}; valid: {', '.join(KINDS)}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def mock(cls, kind: str, **overrides) -> Platform:
        """A platform of ``kind`` with typical properties (H200 / MI300X), for tests and snapshots.

        ``available`` defaults to False for GPU kinds. Any field can be overridden, e.g.
        ``Platform.mock("cuda", capability=(7, 5), flash_attn_installed=True)``."""
        if kind not in KINDS:
            raise ValueError(f"unknown platform kind {kind!r}; valid: {', '.join(KINDS)}")
        fields = dict(_MOCK_DEFAULTS[kind])
        fields["available"] = kind == "cpu"
        fields.update(overrides)
        if "arch" in overrides and "capability" not in overrides and kind == "cuda":
            arch = overrides["arch"]
            if arch.startswith("sm_") and arch[3:].isdigit():
                digits = arch[3:]
                fields["capability"] = (int(digits[:-1]), int(digits[-1]))
        return cls(kind=kind, **fields)

    # ------------------------------------------------------------------ simple properties
    @property
    def is_gpu(self) -> bool:
        return self.kind in ("cuda", "rocm")

    @property
    def device_type(self) -> str:
        """The torch device type: ROCm builds of torch also call their device "cuda"."""
        return "cuda" if self.is_gpu else "cpu"

    @property
    def graph_api(self) -> str | None:
        """The graph-capture API: ``torch.cuda.CUDAGraph`` serves CUDA graphs and, on ROCm builds of
        torch, HIP graphs (same Python API). None on CPU (no graphs)."""
        return "torch.cuda.CUDAGraph" if self.is_gpu else None

    @property
    def supports_graphs(self) -> bool:
        return self.is_gpu

    @property
    def compact_attention_tiles(self) -> bool:
        """Prefill attention needs the smaller 16-bit tile: on gfx90a/gfx942 the 128x64 tile spills
        VGPRs (AOT report, tests/test_rocm_aot.py); gfx950 and NVIDIA GPUs take the larger one."""
        return self.kind == "rocm" and self.arch.split(":")[0] in ("gfx90a", "gfx942")

    @property
    def supports_pdl(self) -> bool:
        """Programmatic Dependent Launch: NVIDIA CUDA with compute capability >= 9.0 and a Triton
        with ``tl.extra.cuda.gdc_wait`` / ``gdc_launch_dependents`` and the ``launch_pdl`` option
        (:func:`triton_supports_pdl`). Never on ROCm or the CPU."""
        if self.kind != "cuda" or self.capability is None or self.capability[0] < 9:
            return False
        return triton_supports_pdl()

    @property
    def supports_tma(self) -> bool:
        """Tensor Memory Accelerator copies (Triton tensor descriptors): NVIDIA compute capability
        >= 9.0 (Hopper). Never on ROCm or the CPU."""
        return self.kind == "cuda" and self.capability is not None and self.capability[0] >= 9

    @property
    def supports_wgmma(self) -> bool:
        """Hopper's asynchronous warp-group MMA (Gluon's ``warpgroup_mma``): NVIDIA compute capability
        9.x only (Blackwell has other tensor-core instructions). Never on ROCm or the CPU."""
        return self.kind == "cuda" and self.capability is not None and self.capability[0] == 9

    def torch_device(self, index: int = 0) -> torch.device:
        return torch.device(self.device_type, index) if self.is_gpu else torch.device("cpu")

    # ------------------------------------------------------------------ attention
    def supports_flash_attention(self) -> bool:
        """FlashAttention: NVIDIA only, compute capability >= 8.0, ``flash_attn`` importable.

        The package is looked up with ``importlib.util.find_spec`` (never imported) and only on CUDA:
        ROCm returns before the lookup."""
        if self.kind != "cuda":
            return False
        if self.capability is None or tuple(self.capability) < (8, 0):
            return False
        if self.flash_attn_installed is not None:
            return self.flash_attn_installed
        try:
            return importlib.util.find_spec(FLASH_ATTN_PACKAGE) is not None
        except (ImportError, ValueError):
            return False

    def attention_backends(self) -> list[str]:
        """Backends in "auto" preference order.

        cuda: flash (if supported), triton, torch. rocm: triton, torch (never flash). cpu: torch,
        with triton first only when ``TRITON_INTERPRET=1`` (the Triton CPU interpreter)."""
        if self.kind == "cuda":
            return (["flash"] if self.supports_flash_attention() else []) + ["triton", "torch"]
        if self.kind == "rocm":
            return ["triton", "torch"]
        return (["triton"] if envs.triton_interpret() else []) + ["torch"]

    def select_attention_backend(self, requested: str | None = None) -> str:
        """The attention backend to use.

        ``requested`` wins when given (not None / "auto"); otherwise ``RLT_ATTENTION_BACKEND``;
        otherwise the first of :meth:`attention_backends`. Unknown names and "flash" where it
        cannot run raise ValueError."""
        name = requested if requested not in (None, "", "auto") else envs.rlt_attention_backend()
        name = str(name).strip().lower()
        source = "requested" if requested not in (None, "", "auto") else "RLT_ATTENTION_BACKEND"
        if name == "auto":
            return self.attention_backends()[0]
        if name not in ATTENTION_BACKEND_NAMES:
            raise ValueError(
                f"unknown attention backend {name!r} ({source}); valid: auto, {', '.join(ATTENTION_BACKEND_NAMES)}"
            )
        if name == "flash":
            if self.kind == "rocm":
                raise ValueError(
                    "attention backend 'flash' is not supported on ROCm: the FlashAttention path here is "
                    "NVIDIA-only (ROCm never imports flash_attn); use 'triton' or 'torch'"
                )
            if not self.supports_flash_attention():
                if self.kind != "cuda":
                    why = f"FlashAttention needs an NVIDIA GPU, this platform is {self.kind}"
                elif self.capability is None or tuple(self.capability) < (8, 0):
                    why = f"FlashAttention needs compute capability >= 8.0, this GPU has {self.capability}"
                else:
                    why = f"the {FLASH_ATTN_PACKAGE!r} package is not installed"
                raise ValueError(f"attention backend 'flash' is unavailable: {why}; use 'triton' or 'torch'")
        return name

    def dot_precision(self, dtype: torch.dtype) -> str:
        """``tl.dot`` input precision for ``dtype`` inputs: "ieee" on ROCm (it rejects tf32) and CPU;
        on CUDA "tf32" for float32 when ``torch.get_float32_matmul_precision() != "highest"``."""
        if self.kind == "cuda" and dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
            return "tf32"
        return "ieee"

    def describe(self) -> str:
        cap = "" if self.capability is None else f" cc={self.capability[0]}.{self.capability[1]}"
        extra = "" if self.available else " (not this machine)"
        return f"{self.kind}: {self.device_name} [{self.arch}{cap}, warp {self.warp_size}]{extra}"


# ---------------------------------------------------------------------------------------- detection
def _cpu_platform() -> Platform:
    name = _pyplatform.processor() or _pyplatform.machine() or "cpu"
    return Platform(kind="cpu", device_name=name, arch=_pyplatform.machine() or "cpu", warp_size=1)


def _detect() -> Platform:
    if not torch.cuda.is_available():
        return _cpu_platform()
    props = torch.cuda.get_device_properties(0)
    capability = (props.major, props.minor)
    common = {
        "device_name": props.name,
        "capability": capability,
        "num_sms": props.multi_processor_count,
        "total_memory": props.total_memory,
    }
    if getattr(torch.version, "hip", None):
        arch = (getattr(props, "gcnArchName", "") or "").split(":")[0] or f"gfx{props.major}{props.minor}"
        return Platform(kind="rocm", arch=arch, warp_size=int(getattr(props, "warp_size", 64) or 64), **common)
    return Platform(
        kind="cuda",
        arch=f"sm_{props.major}{props.minor}",
        warp_size=int(getattr(props, "warp_size", 32) or 32),
        **common,
    )


@functools.cache
def current_platform() -> Platform:
    """The platform of this process, detected once from torch (``current_platform.cache_clear()``
    to re-detect)."""
    return _detect()


def get_platform(kind: str | Platform = "auto", *, allow_unavailable: bool = False) -> Platform:
    """The platform for ``kind`` ("auto" | "cuda" | "rocm" | "cpu", or a Platform, returned as is).

    "auto" is :func:`current_platform`; "cpu" is always available. Asking for a GPU kind this machine
    does not have raises RuntimeError, unless ``allow_unavailable=True`` (graph-only tests and FX
    snapshots), which returns ``Platform.mock(kind)`` with ``available=False``."""
    if isinstance(kind, Platform):
        return kind
    name = str(kind).strip().lower()
    if name not in PLATFORM_CHOICES:
        raise ValueError(f"unknown platform {kind!r}; valid values: {', '.join(PLATFORM_CHOICES)}")
    current = current_platform()
    if name in ("auto", current.kind):
        return current
    if name == "cpu":
        return _cpu_platform()
    if allow_unavailable:
        return Platform.mock(name, available=False)
    raise RuntimeError(
        f"platform {name!r} requested but this machine is {current.describe()}; "
        "pass allow_unavailable=True for graph-only tests"
    )


def is_cuda() -> bool:
    """True on NVIDIA CUDA (not on ROCm builds of torch)."""
    return current_platform().kind == "cuda"


def is_rocm() -> bool:
    return current_platform().kind == "rocm"


def supports_flash_attention() -> bool:
    return current_platform().supports_flash_attention()


# ---------------------------------------------------------------------------------------------- UVA
_UVA_ENTRY_POINTS = {"cuda": "cudaHostGetDevicePointer", "rocm": "hipHostGetDevicePointer"}
_UVA_LIBRARIES = {
    "cuda": ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"),
    "rocm": ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5"),
}


def uva_entry_point(kind: str) -> str:
    """The runtime function that maps a pinned host pointer to its device pointer."""
    try:
        return _UVA_ENTRY_POINTS[kind]
    except KeyError:
        raise ValueError(f"no UVA entry point for platform kind {kind!r}; GPU kinds: cuda, rocm") from None


def uva_library_names(kind: str) -> tuple[str, ...]:
    """Shared-library names of the runtime providing :func:`uva_entry_point` (tried in order)."""
    try:
        return _UVA_LIBRARIES[kind]
    except KeyError:
        raise ValueError(f"no GPU runtime library for platform kind {kind!r}; GPU kinds: cuda, rocm") from None


def _library_candidates(kind: str) -> list[str]:
    names = list(uva_library_names(kind))
    stem = names[0]  # e.g. libcudart.so
    dirs = [os.path.join(os.path.dirname(torch.__file__), "lib")]
    for path in sys.path:
        dirs.append(os.path.join(path, "nvidia", "cuda_runtime", "lib"))
    dirs += ["/usr/local/cuda/lib64", "/opt/rocm/lib"]
    for d in dirs:
        names += sorted(glob.glob(os.path.join(d, stem + "*")))
    return names


def _load_runtime(kind: str) -> ctypes.CDLL:
    errors = []
    for name in _library_candidates(kind):
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    raise OSError(f"could not load the {kind} runtime ({'; '.join(errors[:4])})")


def probe_uva(platform: Platform | None = None) -> bool:
    """True when a pinned host buffer's device pointer (from :func:`uva_entry_point`) equals its host
    pointer. False on CPU, on mock/unavailable platforms and on any failure (reason logged)."""
    p = platform or current_platform()
    if not p.is_gpu:
        logger.info("UVA off: platform %s has no GPU", p.kind)
        return False
    if not p.available:
        logger.info("UVA off: platform %s is not this machine", p.kind)
        return False
    try:
        entry = uva_entry_point(p.kind)
        host = torch.empty(64, dtype=torch.uint8, pin_memory=True)
        lib = _load_runtime(p.kind)
        fn = getattr(lib, entry)
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        device_ptr = ctypes.c_void_p()
        err = fn(ctypes.byref(device_ptr), ctypes.c_void_p(host.data_ptr()), 0)
        if err != 0:
            logger.info("UVA off: %s returned error %d", entry, err)
            return False
        if device_ptr.value != host.data_ptr():
            logger.info("UVA off: device pointer %#x != host pointer %#x", device_ptr.value or 0, host.data_ptr())
            return False
        return True
    except Exception as exc:  # any failure means "no UVA"
        logger.info("UVA off: probe failed: %s", exc)
        return False


def uva_enabled(platform: Platform | None = None) -> bool:
    """Whether to use UVA, from ``RLT_UVA``: "0" never, "1" always on a GPU (no probe), "auto"
    (default) when :func:`probe_uva` succeeds. Always False on CPU."""
    mode = envs.rlt_uva()
    p = platform or current_platform()
    if mode == "0":
        return False
    if not p.is_gpu:
        if mode == "1":
            logger.warning("RLT_UVA=1 ignored: platform %s has no GPU", p.kind)
        return False
    if mode == "1":
        return True
    return probe_uva(p)


# ---------------------------------------------------------------------------------------------- PDL
@functools.cache
def triton_supports_pdl() -> bool:
    """Whether the installed Triton can build and launch PDL kernels: ``triton.language.extra.cuda``
    has ``gdc_wait`` and ``gdc_launch_dependents`` and the NVIDIA backend's ``CUDAOptions`` has a
    ``launch_pdl`` field (the launch option). Cached; ``triton_supports_pdl.cache_clear()`` re-checks."""
    try:
        from triton.language.extra import cuda as tl_cuda

        if not (hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")):
            logger.info("PDL off: this Triton has no tl.extra.cuda.gdc_wait / gdc_launch_dependents")
            return False
        from triton.backends.nvidia.compiler import CUDAOptions

        if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
            logger.info("PDL off: this Triton's CUDAOptions has no launch_pdl option")
            return False
        return True
    except Exception as exc:  # no triton, no NVIDIA backend: no PDL
        logger.info("PDL off: Triton feature check failed: %s", exc)
        return False


_PDL_WARNED: set[str] = set()


def pdl_enabled(platform: Platform | None = None) -> bool:
    """Whether to use Programmatic Dependent Launch, from ``RLT_PDL``: "0" never; "auto" (default)
    where :attr:`Platform.supports_pdl`; "1" the same, with a warning (once per platform) where the
    platform cannot do it. Cheap: one environment read per call, the Triton check is cached."""
    mode = envs.rlt_pdl()
    if mode == "0":
        return False
    p = platform or current_platform()
    if p.supports_pdl:
        return True
    if mode == "1":
        key = p.describe()
        if key not in _PDL_WARNED:
            _PDL_WARNED.add(key)
            if p.kind != "cuda":
                why = f"PDL is NVIDIA-only, this platform is {p.kind}"
            elif p.capability is None or p.capability[0] < 9:
                why = f"PDL needs compute capability >= 9.0, this GPU has {p.capability}"
            else:
                why = "this Triton lacks gdc_wait / gdc_launch_dependents or the launch_pdl option"
            logger.warning("RLT_PDL=1 ignored: %s", why)
    return False


def replace(platform: Platform, **changes) -> Platform:
    """A copy of ``platform`` with some fields changed (frozen dataclass)."""
    return dataclasses.replace(platform, **changes)
