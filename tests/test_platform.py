"""Platform: backend order, dot precision, FlashAttention gating, env overrides, UVA knobs."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import pytest
import torch

from rlt_compile import envs, platform
from rlt_compile.platform import Platform, get_platform, uva_enabled, uva_entry_point

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("RLT_UVA", "RLT_ATTENTION_BACKEND", "TRITON_INTERPRET"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_flash_lookup_on_rocm(monkeypatch):
    """Fail if anything looks up (let alone imports) flash_attn."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name.split(".")[0] == "flash_attn":
            raise AssertionError("flash_attn was looked up")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


# ------------------------------------------------------------------------------------ construction
def test_mock_defaults():
    rocm = Platform.mock("rocm", arch="gfx942")
    assert (rocm.kind, rocm.arch, rocm.warp_size, rocm.available) == ("rocm", "gfx942", 64, False)
    cuda = Platform.mock("cuda")
    assert (cuda.arch, cuda.capability, cuda.warp_size) == ("sm_90", (9, 0), 32)
    assert Platform.mock("cuda", arch="sm_80").capability == (8, 0)
    assert Platform.mock("cpu").available
    with pytest.raises(dataclasses.FrozenInstanceError):
        rocm.kind = "cuda"
    with pytest.raises(ValueError, match="valid"):
        Platform.mock("tpu")
    assert "gfx942" in rocm.describe()


def test_tma_and_wgmma_are_hopper_capabilities():
    """TMA from compute capability 9.0 on; Gluon's warp-group MMA on 9.x only (Blackwell's tensor
    cores take other instructions); neither on ROCm or the CPU."""
    cases = {"sm_80": (False, False), "sm_90": (True, True), "sm_100": (True, False)}
    for arch, (tma, wgmma) in cases.items():
        p = Platform.mock("cuda", arch=arch)
        assert (p.supports_tma, p.supports_wgmma) == (tma, wgmma), arch
    for kind in ("rocm", "cpu"):
        assert not Platform.mock(kind).supports_wgmma and not Platform.mock(kind).supports_tma


def test_graph_api_and_device_type():
    for kind in ("cuda", "rocm"):
        p = Platform.mock(kind)
        assert p.graph_api == "torch.cuda.CUDAGraph"  # HIP graphs come through the same API
        assert p.device_type == "cuda" and p.supports_graphs
    cpu = Platform.mock("cpu")
    assert cpu.graph_api is None and cpu.device_type == "cpu" and not cpu.supports_graphs


def test_current_platform_matches_torch():
    p = platform.current_platform()
    assert p is platform.current_platform()  # cached
    assert p.available
    if not CUDA:
        assert p.kind == "cpu" and not platform.is_cuda() and not platform.is_rocm()
    else:
        assert p.kind in ("cuda", "rocm")
        assert platform.is_rocm() == (p.kind == "rocm")


def test_get_platform_kinds():
    assert get_platform("auto") is platform.current_platform()
    assert get_platform("CPU").kind == "cpu"
    p = Platform.mock("rocm")
    assert get_platform(p) is p
    with pytest.raises(ValueError, match="auto, cuda, rocm, cpu"):
        get_platform("tpu")
    missing = [k for k in ("cuda", "rocm") if k != platform.current_platform().kind]
    for kind in missing:
        with pytest.raises(RuntimeError, match="allow_unavailable"):
            get_platform(kind)
        mocked = get_platform(kind, allow_unavailable=True)
        assert mocked.kind == kind and not mocked.available


# ---------------------------------------------------------------------------------- backend order
def test_backend_order_cuda():
    assert Platform.mock("cuda", flash_attn_installed=True).attention_backends() == ["flash", "triton", "torch"]
    assert Platform.mock("cuda", flash_attn_installed=False).attention_backends() == ["triton", "torch"]
    # FlashAttention needs sm80+ even when installed.
    old = Platform.mock("cuda", capability=(7, 5), arch="sm_75", flash_attn_installed=True)
    assert old.attention_backends() == ["triton", "torch"]


def test_backend_order_cuda_uses_find_spec(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "flash_attn" else real(n, *a))
    assert Platform.mock("cuda").attention_backends()[0] == "flash"
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real(n, *a))
    assert Platform.mock("cuda").attention_backends()[0] == "triton"


def test_backend_order_rocm(no_flash_lookup_on_rocm):
    rocm = Platform.mock("rocm", arch="gfx942")
    assert rocm.attention_backends() == ["triton", "torch"]
    assert not rocm.supports_flash_attention()
    # Even a claim that the package is there does not enable it on ROCm.
    assert Platform.mock("rocm", flash_attn_installed=True).attention_backends() == ["triton", "torch"]


def test_backend_order_cpu(monkeypatch):
    cpu = Platform.mock("cpu")
    assert cpu.attention_backends() == ["torch"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cpu.attention_backends() == ["triton", "torch"]


# ------------------------------------------------------------------------------- backend selection
def test_select_auto_and_requested():
    assert Platform.mock("cuda", flash_attn_installed=True).select_attention_backend() == "flash"
    assert Platform.mock("rocm").select_attention_backend() == "triton"
    assert Platform.mock("cpu").select_attention_backend() == "torch"
    assert Platform.mock("cpu").select_attention_backend("auto") == "torch"
    assert Platform.mock("rocm").select_attention_backend("torch") == "torch"
    assert Platform.mock("cuda", flash_attn_installed=True).select_attention_backend("Triton") == "triton"


def test_select_env_override(monkeypatch):
    monkeypatch.setenv("RLT_ATTENTION_BACKEND", "torch")
    assert Platform.mock("rocm").select_attention_backend() == "torch"
    assert Platform.mock("cuda", flash_attn_installed=True).select_attention_backend() == "torch"
    # An explicit request wins over the environment.
    assert Platform.mock("rocm").select_attention_backend("triton") == "triton"
    monkeypatch.setenv("RLT_ATTENTION_BACKEND", "auto")
    assert Platform.mock("rocm").select_attention_backend() == "triton"
    monkeypatch.setenv("RLT_ATTENTION_BACKEND", "bogus")
    with pytest.raises(ValueError, match="unknown attention backend 'bogus'.*RLT_ATTENTION_BACKEND"):
        Platform.mock("cpu").select_attention_backend()


def test_select_unknown_backend():
    with pytest.raises(ValueError, match="valid: auto, flash, triton, torch"):
        Platform.mock("cuda").select_attention_backend("xformers")


def test_flash_on_rocm_is_a_clear_error(monkeypatch, no_flash_lookup_on_rocm):
    with pytest.raises(ValueError, match="not supported on ROCm"):
        Platform.mock("rocm").select_attention_backend("flash")
    monkeypatch.setenv("RLT_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="not supported on ROCm"):
        Platform.mock("rocm", arch="gfx90a").select_attention_backend()
    assert "flash_attn" not in sys.modules


def test_flash_unavailable_errors():
    with pytest.raises(ValueError, match="not installed"):
        Platform.mock("cuda", flash_attn_installed=False).select_attention_backend("flash")
    with pytest.raises(ValueError, match="compute capability"):
        Platform.mock("cuda", capability=(7, 0), flash_attn_installed=True).select_attention_backend("flash")
    with pytest.raises(ValueError, match="NVIDIA GPU"):
        Platform.mock("cpu").select_attention_backend("flash")


def test_rocm_selection_never_imports_flash_attn():
    """In a fresh interpreter: selecting on a ROCm platform leaves flash_attn out of sys.modules."""
    code = (
        "import sys\n"
        "from rlt_compile.platform import get_platform\n"
        "p = get_platform('rocm', allow_unavailable=True)\n"
        "assert p.select_attention_backend() == 'triton', p.attention_backends()\n"
        "assert p.attention_backends() == ['triton', 'torch']\n"
        "try:\n"
        "    p.select_attention_backend('flash')\n"
        "except ValueError:\n"
        "    pass\n"
        "assert not any(m == 'flash_attn' or m.startswith('flash_attn.') for m in sys.modules), 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------------------- dot precision
def test_dot_precision_per_kind_and_dtype():
    old = torch.get_float32_matmul_precision()
    try:
        for setting in ("highest", "high", "medium"):
            torch.set_float32_matmul_precision(setting)
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                assert Platform.mock("rocm").dot_precision(dtype) == "ieee"
                assert Platform.mock("cpu").dot_precision(dtype) == "ieee"
            assert Platform.mock("cuda").dot_precision(torch.float16) == "ieee"
            assert Platform.mock("cuda").dot_precision(torch.bfloat16) == "ieee"
            expected = "ieee" if setting == "highest" else "tf32"
            assert Platform.mock("cuda").dot_precision(torch.float32) == expected
    finally:
        torch.set_float32_matmul_precision(old)


# ---------------------------------------------------------------------------------------------- UVA
def test_uva_entry_points():
    assert uva_entry_point("cuda") == "cudaHostGetDevicePointer"
    assert uva_entry_point("rocm") == "hipHostGetDevicePointer"
    assert platform.uva_library_names("rocm")[0] == "libamdhip64.so"
    assert platform.uva_library_names("cuda")[0] == "libcudart.so"
    with pytest.raises(ValueError):
        uva_entry_point("cpu")


def test_uva_env_modes(monkeypatch):
    probes = []
    monkeypatch.setattr(platform, "probe_uva", lambda p=None: probes.append(p) or True)
    rocm, cpu = Platform.mock("rocm"), Platform.mock("cpu")

    monkeypatch.setenv("RLT_UVA", "0")
    assert not uva_enabled(rocm) and probes == []
    monkeypatch.setenv("RLT_UVA", "1")
    assert uva_enabled(rocm) and probes == []  # forced on, no probe
    assert not uva_enabled(cpu)  # no device: never
    monkeypatch.setenv("RLT_UVA", "auto")
    assert uva_enabled(rocm) and probes == [rocm]
    monkeypatch.delenv("RLT_UVA")
    assert envs.rlt_uva() == "auto" and envs.RLT_UVA == "auto"
    assert uva_enabled(rocm) and len(probes) == 2
    monkeypatch.setenv("RLT_UVA", "maybe")
    with pytest.raises(ValueError, match="RLT_UVA"):
        uva_enabled(rocm)


def test_copy_stream_env(monkeypatch):
    monkeypatch.delenv("RLT_COPY_STREAM", raising=False)
    assert envs.rlt_copy_stream()
    for value, on in (("0", False), ("off", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("RLT_COPY_STREAM", value)
        assert envs.rlt_copy_stream() is on
    monkeypatch.setenv("RLT_COPY_STREAM", "2")
    with pytest.raises(ValueError, match="RLT_COPY_STREAM"):
        envs.rlt_copy_stream()


def test_uva_probe_fails_cleanly_without_a_device():
    assert not platform.probe_uva(Platform.mock("cpu"))
    assert not platform.probe_uva(Platform.mock("rocm"))  # not this machine
    if not CUDA:
        assert not uva_enabled()  # auto on a CPU machine


def test_uva_probe_failure_is_logged(monkeypatch, caplog):
    fake_gpu = dataclasses.replace(Platform.mock("cuda"), available=True)
    monkeypatch.setattr(platform, "_load_runtime", lambda kind: (_ for _ in ()).throw(OSError("no runtime")))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: torch.zeros(64, dtype=torch.uint8))
    with caplog.at_level("INFO", logger="rlt_compile.platform"):
        assert not platform.probe_uva(fake_gpu)
    assert "no runtime" in caplog.text


def test_envs_documents_amd_knobs():
    assert "HIP_FORCE_DEV_KERNARG" in envs.__doc__ and "HSA_ENABLE_INTERRUPT" in envs.__doc__
    assert set(envs.ENV_VARS) >= {"RLT_UVA", "RLT_ATTENTION_BACKEND"}
    with pytest.raises(KeyError):
        envs.get("RLT_NOPE")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA/ROCm GPU (run with -m gpu on the device)")
def test_gpu_detection_and_uva_probe():
    p = platform.current_platform()
    assert p.kind in ("cuda", "rocm") and p.available and p.num_sms > 0
    if p.kind == "cuda":
        assert p.arch == f"sm_{p.capability[0]}{p.capability[1]}" and p.warp_size == 32
    else:
        assert p.arch.startswith("gfx")
    assert isinstance(platform.probe_uva(p), bool)  # True on H200 / MI300 (pinned memory is UVA-mapped)
    print("UVA probe:", platform.probe_uva(p), p.describe())
