"""Environment knobs read by rlt_compile, all in one place.

Values are read when asked for (not at import), so tests can set them with ``monkeypatch.setenv``.

    RLT_UVA                  auto | 0 | 1 (default auto). Whether the engine may hand the GPU pinned host
                             buffers through unified virtual addressing instead of copying them. auto:
                             on only if ``platform.probe_uva()`` finds that the device pointer of a pinned
                             host buffer equals its host pointer; 0: off; 1: on without probing (GPU only).
    RLT_PDL                  auto | 0 | 1 (default auto). Programmatic Dependent Launch (NVIDIA sm_90+): our
                             Triton kernels are launched with ``launch_pdl`` and start with
                             ``gdc_wait()``, and Inductor's kernels get ``triton.enable_pdl``, so a kernel's
                             launch overlaps the tail of the previous one. auto: on when
                             ``Platform.supports_pdl`` (CUDA, capability >= 9, a Triton with the GDC
                             intrinsics); 0: off; 1: on, but still only where supported (warns otherwise).
    RLT_PDL_TRIGGER          early | wait (default early). Where our PDL kernels let the next grid launch:
                             ``early``: first thing, so the next kernel's programs can be resident (and
                             read their weights) while this one still waits for its predecessor;
                             ``wait``: after their own ``gdc_wait()``. Safe either way: a grid completes
                             only after its own wait, so every wait still orders the chain. Early was
                             1.03-1.04x end to end on the H200 (docs/benchmarks.md, session 13).
    RLT_COPY_STREAM          1 | 0 (default 1). Whether the engine's per-step H2D input copies run on a side
                             stream (``InputBuffers.copy_stream``; the compute stream waits on an event) or,
                             with 0, on the compute stream itself: the comparison the side stream is
                             measured by (``bench --engine-profile``).
    RLT_ATTENTION_BACKEND    auto | flash | triton | torch (default auto). Overrides the attention backend
                             the Platform picks (``Platform.select_attention_backend``).
    RLT_ATTENTION_CONFIG     ``key=int,...`` (default empty). Defaults for the Triton attention launchers'
                             ``config`` (keys in ``attention_config.CONFIG_KEYS``, e.g.
                             ``fuse_reduce=0,early_reads=0``), under any config a caller passes: for tuning
                             and A/B runs of whole models (``bench``) without code changes.
    RLT_GEMV_CONFIG          ``key=int,...`` (default empty). Defaults for the Triton decode GEMV's tiles and
                             options (``gemv.CONFIG_KEYS``, e.g. ``acc_2d=1``), under any config a caller
                             passes; for A/B runs of whole models, as ``RLT_ATTENTION_CONFIG``. ``only_n`` /
                             ``only_k`` limit it to weights of that shape.
    TRITON_INTERPRET         Triton's own knob; ``1`` runs Triton kernels on the CPU interpreter, and adds
                             "triton" to the CPU platform's backend order.

AMD runtime knobs we document but never set (they belong to the user's launch environment):

    HIP_FORCE_DEV_KERNARG    ROCm: place kernel arguments in device memory; lowers launch latency of
                             small kernels and graph replays on MI200/MI300.
    HSA_ENABLE_INTERRUPT     ROCm: 0 makes the host busy-wait on completion signals instead of sleeping
                             on interrupts (lower sync latency, one CPU core spinning).
"""

from __future__ import annotations

import os

# name -> (default, description)
ENV_VARS: dict[str, tuple[str, str]] = {
    "RLT_UVA": ("auto", "auto|0|1: use UVA for pinned host buffers (auto = probe)"),
    "RLT_PDL": ("auto", "auto|0|1: Programmatic Dependent Launch on sm_90+ (auto = where supported)"),
    "RLT_PDL_TRIGGER": ("early", "early|wait: PDL kernels let the next grid launch first or after their wait"),
    "RLT_COPY_STREAM": ("1", "1|0: H2D input copies on a side stream (0 = on the compute stream)"),
    "RLT_ATTENTION_BACKEND": ("auto", "auto|flash|triton|torch: override the attention backend"),
    "RLT_ATTENTION_CONFIG": ("", "key=int,...: default Triton attention launcher config (tuning)"),
    "RLT_GEMV_CONFIG": ("", "key=int,...: default Triton decode GEMV config (tuning)"),
    "TRITON_INTERPRET": ("0", "1 = run Triton kernels in the CPU interpreter"),
}

# Documented only; rlt_compile never sets or reads them.
AMD_RUNTIME_KNOBS: dict[str, str] = {
    "HIP_FORCE_DEV_KERNARG": "kernel arguments in device memory (lower launch latency)",
    "HSA_ENABLE_INTERRUPT": "0 = busy-wait on completion signals instead of interrupts",
}

UVA_VALUES = ("auto", "0", "1")
PDL_VALUES = ("auto", "0", "1")
_BOOL_ALIASES = {"true": "1", "on": "1", "yes": "1", "false": "0", "off": "0", "no": "0"}


def get(name: str) -> str:
    """The value of a known knob (its default when unset or empty), stripped and lower-cased."""
    if name not in ENV_VARS:
        raise KeyError(f"unknown rlt_compile environment variable {name!r}; known: {sorted(ENV_VARS)}")
    value = os.environ.get(name, "").strip().lower()
    return value or ENV_VARS[name][0]


def _choice(name: str, allowed: tuple[str, ...]) -> str:
    """A knob's value among ``allowed`` (true/false/on/off/yes/no read as 1/0), else a ValueError."""
    value = get(name)
    value = _BOOL_ALIASES.get(value, value)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {os.environ.get(name)!r}")
    return value


def rlt_uva() -> str:
    """``RLT_UVA``: "auto", "0" or "1" (also accepts true/false/on/off/yes/no)."""
    return _choice("RLT_UVA", UVA_VALUES)


def rlt_pdl() -> str:
    """``RLT_PDL``: "auto", "0" or "1" (also accepts true/false/on/off/yes/no)."""
    return _choice("RLT_PDL", PDL_VALUES)


def rlt_pdl_trigger() -> str:
    """``RLT_PDL_TRIGGER``: "early" (default) or "wait"."""
    return _choice("RLT_PDL_TRIGGER", ("early", "wait"))


def rlt_copy_stream() -> bool:
    """``RLT_COPY_STREAM``: True unless "0" (also accepts true/false/on/off/yes/no)."""
    return _choice("RLT_COPY_STREAM", ("0", "1")) == "1"


def rlt_attention_backend() -> str:
    """``RLT_ATTENTION_BACKEND`` ("auto" when unset); validated by the Platform."""
    return get("RLT_ATTENTION_BACKEND")


def rlt_attention_config() -> dict[str, int]:
    """``RLT_ATTENTION_CONFIG`` parsed: ``"fuse_reduce=0, waves=4"`` -> ``{"fuse_reduce": 0, "waves": 4}``
    (keys are checked by the attention launcher)."""
    return parse_config(os.environ.get("RLT_ATTENTION_CONFIG", ""), "RLT_ATTENTION_CONFIG")


def rlt_gemv_configs() -> list[dict[str, int]]:
    """``RLT_GEMV_CONFIG``: configs parsed like ``RLT_ATTENTION_CONFIG``, several separated by ``;``
    (each for the weight shape its ``only_n`` / ``only_k`` name; keys are checked by the GEMV launcher)."""
    raw = os.environ.get("RLT_GEMV_CONFIG", "")
    return [parse_config(part, "RLT_GEMV_CONFIG") for part in raw.split(";") if part.strip()]


def parse_config(raw: str, name: str = "RLT_ATTENTION_CONFIG") -> dict[str, int]:
    """``"key=int, key=int"`` -> ``{key: int}``, the format of ``RLT_ATTENTION_CONFIG`` and
    ``RLT_GEMV_CONFIG`` (``name`` is the variable an error message names)."""
    config: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        try:
            number = int(value)
        except ValueError:
            number = None
        if not sep or not key or number is None:
            raise ValueError(f"{name} must be key=int pairs separated by commas, got {raw!r}")
        config[key] = number
    return config


def triton_interpret() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the Triton CPU interpreter."""
    return get("TRITON_INTERPRET") in ("1", "true", "on", "yes")


def __getattr__(name: str) -> str:  # ``envs.RLT_UVA`` reads the environment now
    if name in ENV_VARS:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
