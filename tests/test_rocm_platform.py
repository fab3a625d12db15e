"""The ROCm platform end to end, on a machine without an AMD GPU.

The platform is forced to "rocm" (``get_platform("rocm", allow_unavailable=True)`` /
``Platform.mock("rocm", arch=...)``) and every ROCm-specific decision is checked: attention backend
order, FlashAttention never looked up nor imported (fresh interpreter), the reasoned error when it is
asked for, "ieee" dot precision for every dtype through the real pass pipeline, the HIP entry point of
the UVA probe (ctypes mocked), the CUDA/HIP graph API, and the environment knobs.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_passes import loop_step_inputs, tiny_model

from rlt_compile import envs, platform
from rlt_compile.compiler import capture_unit_graph, run_passes
from rlt_compile.passes.manager import is_op
from rlt_compile.platform import Platform, get_platform

ROOT = Path(__file__).resolve().parents[1]
ROCM_ARCHES = ("gfx942", "gfx950", "gfx90a")  # MI300, MI350, MI200
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_OP = torch.ops.rlt.attention_triton.default
AMD_KNOBS = ("HIP_FORCE_DEV_KERNARG", "HSA_ENABLE_INTERRUPT")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("RLT_UVA", "RLT_ATTENTION_BACKEND", "TRITON_INTERPRET"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def matmul_precision_high():
    """The setting under which CUDA *would* pick tf32 for fp32: ROCm must still say ieee."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(old)


# ------------------------------------------------------------------------------- forced platform
def test_forced_rocm_platform():
    p = get_platform("rocm", allow_unavailable=True)
    assert (p.kind, p.warp_size, p.available, p.device_type) == ("rocm", 64, False, "cuda")
    assert p.arch.startswith("gfx") and p.supports_graphs
    for arch in ROCM_ARCHES:
        assert Platform.mock("rocm", arch=arch).arch == arch


@pytest.mark.parametrize("arch", ROCM_ARCHES)
def test_auto_attention_order_is_triton_then_torch(arch, monkeypatch):
    p = Platform.mock("rocm", arch=arch)
    assert p.attention_backends() == ["triton", "torch"]
    assert p.select_attention_backend() == "triton"
    assert p.select_attention_backend("auto") == "triton"
    # Even with flash_attn claimed installed, ROCm never offers it.
    assert Platform.mock("rocm", arch=arch, flash_attn_installed=True).attention_backends() == ["triton", "torch"]
    monkeypatch.setenv("RLT_ATTENTION_BACKEND", "torch")  # the env override is honoured on ROCm
    assert p.select_attention_backend() == "torch"


@pytest.mark.parametrize("how", ["argument", "env"])
def test_asking_for_flash_on_rocm_raises_the_reasoned_error(how, monkeypatch):
    p = get_platform("rocm", allow_unavailable=True)
    if how == "env":
        monkeypatch.setenv("RLT_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError) as info:
        p.select_attention_backend("flash" if how == "argument" else None)
    message = str(info.value)
    assert "not supported on ROCm" in message and "NVIDIA-only" in message
    assert "'triton'" in message and "'torch'" in message  # says what to use instead
    assert not p.supports_flash_attention()


def test_flash_on_rocm_is_refused_by_the_pass_pipeline(ouro_graphs):
    gm = copy.deepcopy(ouro_graphs[torch.float32])
    with pytest.raises(ValueError, match="not supported on ROCm"):
        run_passes(gm, Platform.mock("rocm", arch="gfx942"), attention_backend="flash")


_FRESH_PROCESS = r"""
import importlib.abc, os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import torch
import rlt_compile  # the whole package: engine, models, kernels, backends table
from rlt_compile.compiler import capture_unit_graph, run_passes
from rlt_compile.kernels import backends
from rlt_compile.platform import Platform, get_platform
from test_passes import loop_step_inputs, tiny_model

seen = []  # every lookup of flash_attn from here on (find_spec and import both ask sys.meta_path)


class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "flash_attn":
            seen.append(name)
        return None


sys.meta_path.insert(0, Spy())

p = get_platform("rocm", allow_unavailable=True)
assert p.attention_backends() == ["triton", "torch"], p.attention_backends()
assert p.select_attention_backend() == "triton"
assert not p.supports_flash_attention()
try:
    p.select_attention_backend("flash")
except ValueError as exc:
    assert "ROCm" in str(exc), exc
else:
    raise AssertionError("flash accepted on ROCm")
model = tiny_model("ouro", num_hidden_layers=1)
gm = capture_unit_graph(model, "loop_step", *loop_step_inputs(model))
records = run_passes(gm, p, unit="loop_step")
assert [r.pass_name for r in records] == ["attention_swap", "dot_precision", "fuse_rmsnorm"], records
assert not seen, f"flash_attn looked up on ROCm: {seen}"
assert not [m for m in sys.modules if m.split(".")[0] == "flash_attn"], "flash_attn imported"
for knob in ("HIP_FORCE_DEV_KERNARG", "HSA_ENABLE_INTERRUPT"):
    assert knob not in os.environ, f"rlt_compile set {knob}"

# Control: the spy does see lookups (a fake flash_attn is on sys.path; CUDA looks it up).
assert Platform.mock("cuda").supports_flash_attention()
assert seen == ["flash_attn"], seen
assert "flash_attn" not in sys.modules  # looked up, still never imported
print("ROCM-CLEAN")
"""


def test_flash_attn_never_imported_on_rocm_in_a_fresh_process(tmp_path):
    """A fresh interpreter with a booby-trapped ``flash_attn`` on the path: importing rlt_compile,
    selecting the backend, asking for flash and running the pass pipeline for ROCm neither imports
    nor even looks up the package."""
    fake = tmp_path / "flash_attn"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('flash_attn must never be imported on ROCm')\n")
    env = {k: v for k, v in os.environ.items() if k not in AMD_KNOBS and not k.startswith(("RLT_", "TRITON_INTERPRET"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "ROCM-CLEAN" in done.stdout, done.stdout + done.stderr


# --------------------------------------------------------------------------------- dot precision
@pytest.fixture(scope="module")
def ouro_graphs() -> dict[torch.dtype, torch.fx.GraphModule]:
    """Pre-pass Dynamo graphs of a one-layer tiny Ouro ``loop_step``, one per dtype."""
    out = {}
    for dtype in DTYPES:
        torch.manual_seed(0)
        model = tiny_model("ouro", dtype, num_hidden_layers=1)
        out[dtype] = capture_unit_graph(model, "loop_step", *loop_step_inputs(model, dtype=dtype))
    return out


@pytest.mark.parametrize("setting", ["highest", "high", "medium"])
@pytest.mark.parametrize("arch", ROCM_ARCHES)
def test_platform_dot_precision_is_ieee_for_every_dtype(arch, setting):
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        p = Platform.mock("rocm", arch=arch)
        assert [p.dot_precision(d) for d in DTYPES] == ["ieee"] * 3
    finally:
        torch.set_float32_matmul_precision(old)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_dot_precision_pass_marks_every_triton_dot_ieee(ouro_graphs, dtype, arch, matmul_precision_high):
    gm = copy.deepcopy(ouro_graphs[dtype])
    records = run_passes(gm, Platform.mock("rocm", arch=arch), unit="loop_step")
    nodes = [n for n in gm.graph.nodes if is_op(n, TRITON_OP)]
    assert nodes, "attention_swap did not install the Triton op on ROCm"
    assert [n.args[-1] for n in nodes] == ["ieee"] * len(nodes)
    assert [r.pass_name for r in records] == ["attention_swap", "dot_precision", "fuse_rmsnorm"]
    assert "precision='ieee'" in records[1].message and "on rocm" in records[1].message


def test_dot_precision_control_cuda_fp32_is_tf32(ouro_graphs, matmul_precision_high):
    """Control for the test above: the same graph on CUDA gets tf32, so the check can fail."""
    gm = copy.deepcopy(ouro_graphs[torch.float32])
    run_passes(gm, Platform.mock("cuda", flash_attn_installed=False), unit="loop_step")
    assert {n.args[-1] for n in gm.graph.nodes if is_op(n, TRITON_OP)} == {"tf32"}


# ------------------------------------------------------------------------------------------- UVA
class _FakeRuntime:
    """Stands in for ``ctypes.CDLL``: records the libraries opened and the functions looked up; the
    looked-up function reports the host pointer back as the device pointer (UVA) and returns ``err``."""

    def __init__(self, err: int = 0, same_pointer: bool = True):
        self.opened: list[str] = []
        self.looked_up: list[str] = []
        self.calls: list[tuple] = []
        self.err, self.same_pointer = err, same_pointer

    def cdll(self, name, *args, **kwargs):
        self.opened.append(str(name))
        runtime = self

        class Library:
            def __getattr__(self, symbol):
                runtime.looked_up.append(symbol)

                def entry(device_ptr_ref, host_ptr, flags):
                    runtime.calls.append((symbol, host_ptr.value, flags))
                    device_ptr_ref._obj.value = host_ptr.value if runtime.same_pointer else host_ptr.value + 64
                    return runtime.err

                return entry

        return Library()


@pytest.fixture
def fake_runtime(monkeypatch):
    runtime = _FakeRuntime()
    monkeypatch.setattr(platform.ctypes, "CDLL", runtime.cdll)
    # Pinned host memory needs a GPU runtime; a plain CPU buffer stands in (the probe reads data_ptr()).
    buffer = torch.zeros(64, dtype=torch.uint8)
    monkeypatch.setattr(platform.torch, "empty", lambda *a, **k: buffer)
    return runtime


def _as_available(p: Platform) -> Platform:
    return platform.replace(p, available=True)


def test_uva_probe_calls_the_hip_entry_point(fake_runtime):
    rocm = _as_available(Platform.mock("rocm", arch="gfx942"))
    assert platform.probe_uva(rocm)
    assert fake_runtime.looked_up == ["hipHostGetDevicePointer"] == [platform.uva_entry_point("rocm")]
    assert fake_runtime.opened[0] == "libamdhip64.so"  # the HIP runtime, not libcudart
    assert not any("cudart" in name for name in fake_runtime.opened)
    ((symbol, host, flags),) = fake_runtime.calls
    assert symbol == "hipHostGetDevicePointer" and host != 0 and flags == 0


def test_uva_probe_control_cuda_uses_the_cuda_entry_point(fake_runtime):
    assert platform.probe_uva(_as_available(Platform.mock("cuda")))
    assert fake_runtime.looked_up == ["cudaHostGetDevicePointer"]
    assert fake_runtime.opened[0] == "libcudart.so"


def test_uva_probe_hip_failures_mean_no_uva(fake_runtime, caplog):
    rocm = _as_available(Platform.mock("rocm", arch="gfx950"))
    fake_runtime.err = 1
    with caplog.at_level("INFO", logger="rlt_compile.platform"):
        assert not platform.probe_uva(rocm)
    assert "hipHostGetDevicePointer returned error 1" in caplog.text
    fake_runtime.err, fake_runtime.same_pointer = 0, False
    assert not platform.probe_uva(rocm)


def test_rlt_uva_env_on_rocm(fake_runtime, monkeypatch):
    rocm = _as_available(Platform.mock("rocm", arch="gfx942"))
    monkeypatch.setenv("RLT_UVA", "0")
    assert not platform.uva_enabled(rocm) and fake_runtime.looked_up == []
    monkeypatch.setenv("RLT_UVA", "1")
    assert platform.uva_enabled(rocm) and fake_runtime.looked_up == []  # forced on: no probe
    monkeypatch.setenv("RLT_UVA", "auto")
    assert platform.uva_enabled(rocm) and fake_runtime.looked_up == ["hipHostGetDevicePointer"]


# ---------------------------------------------------------------------------------------- graphs
def test_graph_capture_goes_through_the_torch_cuda_graph_api():
    """HIP graphs on ROCm builds of torch come through ``torch.cuda.CUDAGraph`` / ``torch.cuda.graph``;
    the capture code has one path for both GPU kinds (no HIP-specific API or branch)."""
    try:
        graphs = importlib.import_module("rlt_compile.graphs")
    except ModuleNotFoundError as exc:
        if exc.name != "rlt_compile.graphs":
            raise
        pytest.skip("rlt_compile/graphs.py (CUDA/HIP graph capture) does not exist yet")
    tree = ast.parse(inspect.getsource(graphs))
    used = {ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert "torch.cuda.CUDAGraph" in used and "torch.cuda.graph" in used, sorted(used)
    assert not [name for name in used if "hip" in name.lower()], "HIP-specific code in rlt_compile.graphs"
    for kind in ("cuda", "rocm"):
        p = Platform.mock(kind)
        assert p.graph_api == "torch.cuda.CUDAGraph" and p.supports_graphs
    assert Platform.mock("cpu").graph_api is None


# ------------------------------------------------------------------------------------------ envs
def test_env_knobs_are_read_in_one_place():
    assert {"RLT_UVA", "RLT_ATTENTION_BACKEND"} <= set(envs.ENV_VARS)
    for knob in AMD_KNOBS:  # documented, never read or set
        assert knob in envs.__doc__ and knob in envs.AMD_RUNTIME_KNOBS and knob not in envs.ENV_VARS
    readers = []
    for path in sorted((ROOT / "rlt_compile").rglob("*.py")):
        if path.name == "envs.py":
            continue
        text = path.read_text()
        for name in ("RLT_UVA", "RLT_ATTENTION_BACKEND", *AMD_KNOBS):
            if re.search(rf"(environ|getenv|putenv)\W*[^\n]*['\"]{name}['\"]", text):
                readers.append(f"{path.relative_to(ROOT)}: {name}")
    assert not readers, f"environment knobs touched outside rlt_compile/envs.py: {readers}"
