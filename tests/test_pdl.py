"""Programmatic Dependent Launch (PDL, NVIDIA sm_90+): the ``RLT_PDL`` knob, ``Platform.supports_pdl``,
``pdl_enabled``, the Inductor patch ``triton.enable_pdl`` and the ``gdc_wait`` prologue of our kernels.

CPU: knob parsing and platform gating on mock platforms; the patch ``compile_model`` hands Inductor
(checked on the built patches, nothing is compiled for CUDA); every kernel starts with the PDL
prologue (AST); the launchers pass ``USE_PDL`` / ``launch_pdl`` at every launch site, False on the
``meta`` tensors of ``aot.py``; and each kernel compiled ahead of time for sm_90 with PDL on has
``griddepcontrol.wait`` before its first global load, store or branch (PTX, ptxas from the wheel).
GPU (``-m gpu``, sm_90+): the kernels with PDL forced on, chained in one CUDA graph, against the
references, and a tiny compiled Ouro with CUDA graphs gives the same logits with PDL on and off.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import textwrap

import pytest
import torch

from rlt_compile import envs, platform
from rlt_compile.compiler import PDL_PATCH, compile_model, inductor_patches
from rlt_compile.kernels import aot, attention_common, decode_attention, rmsnorm, triton_attention
from rlt_compile.kernels import launch as kernel_launch
from rlt_compile.platform import Platform, pdl_enabled

CUDA = torch.cuda.is_available()
KERNELS = {
    "_kv_write_kernel",
    "_paged_attention_kernel",
    "_paged_attention_decode_kernel",
    "_prefill_tma_kernel",
    "_split_reduce_kernel",
    "_fused_rmsnorm_kernel",
    "_gemv_kernel",
    "_rope_columns_kernel",
    "_silu_gate_kernel",
}
# Launched without PDL: the Gluon prefill kernel (an ordinary launch waits for the kernel before it, and
# the kernels after it wait for it in their own prologues)
NO_PDL = {"_gluon_prefill_kernel"}
# Kernels allowed to read some inputs before the prologue: inputs no kernel of the step's chain writes
# (the decode GEMV's and the norms' weights, the decode attention's metadata), so reading them early
# overlaps the previous kernel's tail. With the early trigger a kernel may launch several kernels
# ahead, so these must be written before the chain starts (docs/compiler.md, PDL).
EARLY_READS = {
    "_gemv_kernel": {"w_ptr"},
    "_fused_rmsnorm_kernel": {"wa_ptr", "wb_ptr"},
    "_paged_attention_decode_kernel": {
        "query_start_ptr",
        "seq_lens_ptr",
        "block_tables_ptr",
        "slot_ptr",
        "k_cache_ptr",  # only an L2 prefetch hint of cached rows (l2_prefetch), never a load
        "v_cache_ptr",
    },
}
# The one early return allowed before the wait: the decode kernel's ``early_exit`` probe, for splits
# other than split 0 (which always waits, so the grid still completes after the previous one).
EARLY_EXITS = {"_paged_attention_decode_kernel": "if (split > 0) & (split >= active):\n    return"}
EARLY_TRIGGER = "pdl_trigger_first(USE_PDL)"
WAIT = "pdl_wait(USE_PDL)"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("RLT_PDL", raising=False)
    monkeypatch.setattr(platform, "_PDL_WARNED", set())


@pytest.fixture
def triton_pdl(monkeypatch):
    """Pretend the installed Triton has the GDC intrinsics and ``launch_pdl`` (whatever it is)."""
    monkeypatch.setattr(platform, "triton_supports_pdl", lambda: True)


# ------------------------------------------------------------------------------------------ knob
def test_rlt_pdl_parsing(monkeypatch):
    assert envs.rlt_pdl() == "auto" and envs.RLT_PDL == "auto"
    assert envs.ENV_VARS["RLT_PDL"][0] == "auto"
    assert "RLT_PDL" in envs.__doc__
    for raw, want in [("0", "0"), ("1", "1"), ("auto", "auto"), (" AUTO ", "auto"), ("true", "1"), ("On", "1")]:
        monkeypatch.setenv("RLT_PDL", raw)
        assert envs.rlt_pdl() == want, raw
    for raw, want in [("off", "0"), ("no", "0"), ("false", "0"), ("", "auto")]:
        monkeypatch.setenv("RLT_PDL", raw)
        assert envs.rlt_pdl() == want, raw
    for raw in ("2", "maybe", "enable"):
        monkeypatch.setenv("RLT_PDL", raw)
        with pytest.raises(ValueError, match="RLT_PDL"):
            envs.rlt_pdl()
        with pytest.raises(ValueError, match="RLT_PDL"):
            pdl_enabled(Platform.mock("cuda"))


# ------------------------------------------------------------------------------------- platform
def test_supports_pdl_per_platform(triton_pdl):
    assert Platform.mock("cuda").supports_pdl  # H200 mock: sm_90
    assert Platform.mock("cuda", arch="sm_100").supports_pdl
    assert not Platform.mock("cuda", arch="sm_80").supports_pdl
    assert not Platform.mock("cuda", arch="sm_89").supports_pdl
    assert not Platform.mock("cuda", capability=None).supports_pdl
    assert not Platform.mock("rocm", arch="gfx942").supports_pdl  # capability (9, 4) but AMD: never
    assert not Platform.mock("rocm", arch="gfx950", capability=(9, 5)).supports_pdl
    assert not Platform.mock("cpu").supports_pdl


def test_supports_pdl_needs_a_triton_with_pdl(monkeypatch):
    monkeypatch.setattr(platform, "triton_supports_pdl", lambda: False)
    assert not Platform.mock("cuda").supports_pdl


def test_triton_feature_detection(monkeypatch):
    import triton.language.extra.cuda as tl_cuda

    platform.triton_supports_pdl.cache_clear()
    try:
        real = platform.triton_supports_pdl()
        assert real == (hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents"))
        if not real:
            pytest.skip("this Triton has no PDL (nothing more to detect away)")
        platform.triton_supports_pdl.cache_clear()
        with monkeypatch.context() as m:
            m.delattr(tl_cuda, "gdc_wait")
            assert not platform.triton_supports_pdl()
        platform.triton_supports_pdl.cache_clear()
        with monkeypatch.context() as m:
            m.delattr(tl_cuda, "gdc_launch_dependents")
            assert not platform.triton_supports_pdl()
        platform.triton_supports_pdl.cache_clear()
        from triton.backends.nvidia.compiler import CUDAOptions

        with monkeypatch.context() as m:
            fields = {k: v for k, v in CUDAOptions.__dataclass_fields__.items() if k != "launch_pdl"}
            m.setattr(CUDAOptions, "__dataclass_fields__", fields)
            assert not platform.triton_supports_pdl()
    finally:
        platform.triton_supports_pdl.cache_clear()
    assert platform.triton_supports_pdl() == real


def test_launch_pdl_is_a_launch_option_of_this_triton():
    """``kernel[grid](..., launch_pdl=True)``: the binder of ``JITFunction.run`` turns it into the
    CUDA option (for sm_90). The HIP backend has no such option, and ``JITFunction.run`` refuses a
    keyword its backend does not know, which is why the launchers never pass ``launch_pdl=False``."""
    if not platform.triton_supports_pdl():
        pytest.skip("this Triton has no PDL")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    jit = triton_attention.kernel_for(attention_common._split_reduce_kernel, False)
    args = [torch.empty(8, device="meta")] * 4 + [1, 128] + [16] * 8
    for target, want in ((GPUTarget("cuda", 90, 32), True), (GPUTarget("hip", "gfx942", 64), None)):
        backend = make_backend(target)
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        _, _, options = binder(*args, NUM_SPLITS=4, BLOCK_D=128, USE_PDL=True, num_warps=4, launch_pdl=True)
        parsed = backend.parse_options(options)
        assert getattr(parsed, "launch_pdl", None) is want
        if want is None and hasattr(jit, "_pack_args"):
            bound_args, specialization, options = binder(
                *args, NUM_SPLITS=4, BLOCK_D=128, USE_PDL=False, launch_pdl=False
            )
            with pytest.raises(KeyError, match="launch_pdl"):
                jit._pack_args(backend, {"launch_pdl": False}, bound_args, specialization, options)


def test_pdl_enabled_modes(monkeypatch, triton_pdl, caplog):
    h200, a100 = Platform.mock("cuda"), Platform.mock("cuda", arch="sm_80")
    rocm, cpu = Platform.mock("rocm"), Platform.mock("cpu")
    # auto (unset or explicit): exactly where supported, no warning
    for raw in (None, "auto"):
        if raw is not None:
            monkeypatch.setenv("RLT_PDL", raw)
        with caplog.at_level(logging.WARNING, logger="rlt_compile.platform"):
            assert pdl_enabled(h200)
            assert not pdl_enabled(a100) and not pdl_enabled(rocm) and not pdl_enabled(cpu)
        assert not caplog.records
    monkeypatch.setenv("RLT_PDL", "0")
    assert not pdl_enabled(h200)
    monkeypatch.setenv("RLT_PDL", "1")
    assert pdl_enabled(h200)
    with caplog.at_level(logging.WARNING, logger="rlt_compile.platform"):
        assert not pdl_enabled(a100)
        assert not pdl_enabled(a100)  # warned once per platform
        assert not pdl_enabled(rocm)
        assert not pdl_enabled(cpu)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3, warnings
    assert "RLT_PDL=1 ignored" in warnings[0] and "compute capability" in warnings[0]
    assert "NVIDIA-only" in warnings[1] and "rocm" in warnings[1]
    assert "cpu" in warnings[2]


def test_pdl_enabled_defaults_to_this_machine(monkeypatch, triton_pdl):
    monkeypatch.setattr(platform, "current_platform", lambda: Platform.mock("cuda"))
    assert pdl_enabled()
    monkeypatch.setattr(platform, "current_platform", lambda: Platform.mock("cpu"))
    assert not pdl_enabled()


def test_pdl_enabled_is_false_without_triton_support(monkeypatch):
    monkeypatch.setattr(platform, "triton_supports_pdl", lambda: False)
    monkeypatch.setenv("RLT_PDL", "1")
    assert not pdl_enabled(Platform.mock("cuda"))


# ------------------------------------------------------------------------------- inductor patch
def test_inductor_patches_add_enable_pdl_where_pdl_is_on(monkeypatch, triton_pdl):
    h200 = Platform.mock("cuda")
    assert inductor_patches(None, None, h200) == {PDL_PATCH: True}
    assert inductor_patches("max-autotune", None, h200)[PDL_PATCH] is True
    assert inductor_patches(None, {"max_autotune": True}, h200) == {PDL_PATCH: True, "max_autotune": True}
    for p in (Platform.mock("cuda", arch="sm_80"), Platform.mock("rocm"), Platform.mock("cpu"), None):
        assert PDL_PATCH not in inductor_patches(None, None, p), p
        assert PDL_PATCH not in inductor_patches("max-autotune", None, p), p
    monkeypatch.setenv("RLT_PDL", "0")
    assert inductor_patches(None, None, h200) == {}


def test_user_inductor_config_wins_over_the_pdl_patch(triton_pdl):
    h200 = Platform.mock("cuda")
    assert inductor_patches(None, {PDL_PATCH: False}, h200) == {PDL_PATCH: False}
    assert inductor_patches(None, {"triton": {"enable_pdl": False}}, h200) == {"triton": {"enable_pdl": False}}
    # and a user may turn it on where we would not
    assert inductor_patches(None, {PDL_PATCH: True}, Platform.mock("cpu")) == {PDL_PATCH: True}


def test_pdl_patch_needs_the_inductor_option(monkeypatch, triton_pdl):
    import torch._inductor.config as inductor_config

    assert hasattr(inductor_config.triton, "enable_pdl")  # torch 2.13 here; torch 2.11 on the H200 too
    monkeypatch.setattr("rlt_compile.compiler._inductor_has_pdl", lambda: False)
    assert inductor_patches(None, None, Platform.mock("cuda")) == {}


def test_compile_model_hands_the_pdl_patch_to_every_unit(tiny_dirs, triton_pdl):
    """compile_model builds the patches for its resolved platform (mock platforms: graph only, nothing
    is compiled here) and hands them to each unit's backend."""
    from rlt_compile import load_model

    def patches(plat, **options):
        model = load_model(tiny_dirs["ouro"], load_tokenizer=False)
        cm = compile_model(model, platform=plat, inductor=False, **options)
        configs = [unit.backend.inductor_config for unit in cm.units.values()]
        cm.uninstall()
        assert len(configs) == len(model.compile_units)
        assert all(c == configs[0] for c in configs)
        return configs[0]

    assert patches(Platform.mock("cuda")) == {PDL_PATCH: True}
    assert patches(Platform.mock("cuda"), inductor_config={PDL_PATCH: False}) == {PDL_PATCH: False}
    assert PDL_PATCH not in patches(Platform.mock("rocm"))
    assert PDL_PATCH not in patches("cpu")
    assert PDL_PATCH not in patches(Platform.mock("cuda", arch="sm_80"))


# ------------------------------------------------------------------------------------- kernels
def _function_ast(fn) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


def test_pdl_helpers_trigger_and_wait():
    """The prologue's two helpers: the early trigger only with ``USE_PDL == 2``; the wait, then the
    trigger, with any PDL mode."""
    trigger = _function_ast(kernel_launch.pdl_trigger_first.fn).body[1:]  # after the docstring
    assert [ast.unparse(s) for s in trigger] == ["if USE_PDL == 2:\n    tl.extra.cuda.gdc_launch_dependents()"]
    wait = _function_ast(kernel_launch.pdl_wait.fn).body[1:]
    assert [ast.unparse(s) for s in wait] == [
        "if USE_PDL:\n    tl.extra.cuda.gdc_wait()\n    tl.extra.cuda.gdc_launch_dependents()"
    ]


def test_every_kernel_starts_with_the_pdl_prologue():
    """``pdl_trigger_first`` first (``RLT_PDL_TRIGGER=early``), then ``pdl_wait`` before anything
    else (a docstring aside): no load, store or early return may come first, except loads of inputs
    listed in ``EARLY_READS`` (never written by a previous kernel) and the returns in ``EARLY_EXITS``.
    A kernel added without it fails here."""
    kernels = aot.discover_kernels()
    assert {name.rsplit(".", 1)[-1] for name in kernels} == KERNELS | NO_PDL
    for name, obj in kernels.items():
        if name.rsplit(".", 1)[-1] in NO_PDL:
            continue
        fn = getattr(obj, "fn", obj)
        param = inspect.signature(fn).parameters.get("USE_PDL")
        assert param is not None and aot._is_constexpr_annotation(param.annotation), name
        body = _function_ast(fn).body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        assert ast.unparse(body[0]) == EARLY_TRIGGER, name
        body = body[1:]
        short = name.rsplit(".", 1)[-1]
        at = next(i for i, s in enumerate(body) if ast.unparse(s) == WAIT)
        before = body[:at]
        pointers = {n.id for s in before for n in ast.walk(s) if isinstance(n, ast.Name) and n.id.endswith("_ptr")}
        assert pointers <= EARLY_READS.get(short, set()), (name, pointers)
        exits = [n for s in before for n in ast.walk(s) if isinstance(n, ast.If) and _returns(n)]
        assert [ast.unparse(n) for n in exits] == ([EARLY_EXITS[short]] if short in EARLY_EXITS else []), name
        returns = sum(isinstance(n, ast.Return) for s in before for n in ast.walk(s))
        assert returns == len(exits), name
        assert "tl.store" not in "".join(ast.unparse(s) for s in before), name
        if short not in EARLY_READS:
            assert at == 0, name


def _returns(node: ast.If) -> bool:
    """Whether ``node`` is an ``if`` whose whole body is one ``return``."""
    return len(node.body) == 1 and isinstance(node.body[0], ast.Return) and not node.orelse


def _launches(pdl: int = 0, workloads=aot.WORKLOADS[:1], dtypes=(torch.float16,)):
    """Launches recorded on meta tensors for a mock H200; ``pdl`` forces the launchers' PDL mode
    (0: their own choice, which on meta tensors is off)."""
    return aot.capture_launches(Platform.mock("cuda"), workloads, dtypes, pdl=pdl)


def test_launchers_pass_use_pdl_and_launch_pdl_at_every_launch_site():
    """Every launch site passes the PDL mode; the Gluon prefill (the mock H200's default prefill)
    launches without PDL."""
    for pdl in (2, 1, 0):
        launches = _launches(pdl)
        assert {launch.kernel.rsplit(".", 1)[-1] for launch in launches} == KERNELS | NO_PDL
        for launch in launches:
            if launch.kernel.rsplit(".", 1)[-1] in NO_PDL:
                assert not {"USE_PDL", "launch_pdl"} & set(launch.kwargs), launch.kernel
                continue
            assert launch.kwargs["USE_PDL"] == pdl, launch.kernel
            # launch_pdl=True when on; absent when off (ROCm's Triton rejects the unknown keyword)
            assert launch.kwargs.get("launch_pdl", "absent") == (True if pdl else "absent"), launch.kernel


def test_meta_and_cpu_tensors_never_use_pdl(monkeypatch, triton_pdl):
    """aot.py records on meta tensors while ``current_platform()`` is the (PDL-capable) target: the
    kernels must still be built without PDL there, even with RLT_PDL=1; CPU tensors (interpreter) too."""
    monkeypatch.setenv("RLT_PDL", "1")
    monkeypatch.setattr(platform, "current_platform", lambda: Platform.mock("cuda"))
    assert pdl_enabled()
    assert not triton_attention.pdl_mode(torch.empty(1, device="meta"))
    assert not triton_attention.pdl_mode(torch.empty(1))
    for launch in _launches():
        assert launch.kwargs.get("USE_PDL", 0) == 0 and "launch_pdl" not in launch.kwargs, launch.kernel


def test_use_pdl_follows_pdl_enabled_for_cuda_tensors(monkeypatch):
    class FakeCuda:
        is_cuda = True

    monkeypatch.setattr(platform, "pdl_enabled", lambda p=None: True)
    monkeypatch.delenv("RLT_PDL_TRIGGER", raising=False)
    assert triton_attention.pdl_mode(FakeCuda()) == 2  # the trigger first by default
    monkeypatch.setenv("RLT_PDL_TRIGGER", "wait")
    assert triton_attention.pdl_mode(FakeCuda()) == 1
    monkeypatch.setenv("RLT_PDL_TRIGGER", "sometimes")
    with pytest.raises(ValueError, match="RLT_PDL_TRIGGER"):
        triton_attention.pdl_mode(FakeCuda())
    monkeypatch.setattr(platform, "pdl_enabled", lambda p=None: False)
    assert triton_attention.pdl_mode(FakeCuda()) == 0


def _first(lines: list[str], pred) -> int:
    return next((i for i, line in enumerate(lines) if pred(line)), len(lines))


def _mnemonic(line: str) -> str:
    """The instruction of a PTX line without its guard predicate (``@%p1 st.global.b16 [...]``)."""
    words = line.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def _compile_sm90(spec: aot.Specialisation):
    import triton
    from triton.compiler import ASTSource

    module_name, fn_name = spec.kernel.rsplit(".", 1)
    fn = getattr(importlib.import_module(module_name), fn_name)
    with aot._private_cache():
        source = ASTSource(aot._jit(fn), spec.signature, spec.constexprs, spec.attrs)
        return triton.compile(source, target=aot.gpu_target("cuda", "sm_90"), options=dict(spec.options))


@pytest.mark.parametrize("mode", [1, 2])
def test_sm90_ptx_waits_before_any_memory_access_or_branch(monkeypatch, mode):
    """Each kernel compiled for sm_90 with PDL on (ahead of time, on the CPU): ``launch_pdl`` in its
    metadata, ``griddepcontrol.wait`` then ``launch_dependents`` (mode 2, the early trigger:
    ``launch_dependents`` first) before the first global load, store, branch or return (stores only,
    for the ``EARLY_READS`` kernels); with PDL off no griddepcontrol at all. Prefill on the TMA kernel
    (``gluon_prefill=0``), whose launch site has the PDL mode."""
    if not platform.triton_supports_pdl():
        pytest.skip("this Triton has no PDL")
    monkeypatch.setenv("RLT_ATTENTION_CONFIG", "gluon_prefill=0")
    h200 = Platform.mock("cuda")
    target = aot.gpu_target("cuda", "sm_90")
    launches = aot.capture_launches(h200, aot.WORKLOADS[:1], (torch.float16,), ("prefill", "decode-split"), pdl=mode)
    specs: dict[str, aot.Specialisation] = {}
    for launch in launches:
        specs.setdefault(launch.kernel, aot._bind(launch, target))
    assert {k.rsplit(".", 1)[-1] for k in specs} == KERNELS
    for name, spec in specs.items():
        assert spec.options.get("launch_pdl") is True, name
        kernel = _compile_sm90(spec)
        assert kernel.metadata.launch_pdl, name
        lines = [line.strip() for line in kernel.asm["ptx"].splitlines()]
        wait = _first(lines, lambda s: s.startswith("griddepcontrol.wait"))
        launch = _first(lines, lambda s: s.startswith("griddepcontrol.launch_dependents"))
        # an early reader may load its EARLY_READS inputs (and branch on their masks) first, never store
        early = name.rsplit(".", 1)[-1] in EARLY_READS
        ops = ("st.global", "atom.", "red.", "ret", "exit")
        if not early:
            ops += ("ld.global", "bra")
        access = next((i for i, s in enumerate(lines) if _mnemonic(s).startswith(ops)), len(lines))
        if mode == 2:
            assert launch < wait < access < len(lines), (name, lines[launch : access + 1])
        else:
            assert wait < launch < access < len(lines), (name, lines[wait : access + 1])
    off = next(s for s in specs.values() if s.kernel.endswith("_fused_rmsnorm_kernel"))
    names = list(off.signature)
    constexprs = {k: (False if names[k[0]] == "USE_PDL" else v) for k, v in off.constexprs.items()}
    plain = aot.Specialisation(off.kernel, off.signature, constexprs, off.attrs, {**off.options, "launch_pdl": False})
    kernel = _compile_sm90(plain)
    assert not kernel.metadata.launch_pdl and "griddepcontrol" not in kernel.asm["ptx"]


# --------------------------------------------------------------------------------------------- GPU
def _gpu_has_pdl() -> bool:
    return CUDA and platform.current_platform().supports_pdl


gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA/ROCm GPU (run with -m gpu on the device)")
needs_pdl = pytest.mark.skipif(
    CUDA and not _gpu_has_pdl(), reason="needs an NVIDIA GPU with compute capability >= 9.0 and a Triton with PDL"
)


def _compiled_pdl_kernels(fn) -> list:
    """The compiled GPU variants of one of our kernels that were built with ``launch_pdl``."""
    jit = kernel_launch._KERNELS.get((fn.__name__, False))
    if jit is None:
        return []
    kernels = [k for entry in getattr(jit, "device_caches", {}).values() for k in entry[0].values()]
    return [k for k in kernels if getattr(k.metadata, "launch_pdl", False)]


@pytest.mark.gpu
@gpu
@needs_pdl
@pytest.mark.parametrize("trigger", ["wait", "early"])
def test_gpu_kernels_with_pdl_forced_on_in_a_cuda_graph(monkeypatch, trigger):
    """RLT_PDL=1 (``RLT_PDL_TRIGGER`` both ways): norm -> decode attention (KV write fused) -> split reduce -> KV write -> unified
    attention -> split reduce -> norm, captured in one CUDA graph, each stage reading the previous
    one's output, replayed with new inputs and metadata: every stage matches its reference applied
    to the graph's own output of the stage before (a stage that read before its producer finished
    would see the previous replay's values)."""
    from rlt_compile.kernels.metadata import build_metadata
    from rlt_compile.kernels.reference import kv_write_reference, paged_attention_reference

    monkeypatch.setenv("RLT_PDL", "1")
    monkeypatch.setenv("RLT_PDL_TRIGGER", trigger)
    dev, dt = "cuda", torch.bfloat16
    bs, heads, kv_heads, dim, block, max_blocks = 6, 16, 4, 128, 16, 32
    hidden, num_blocks, scale, eps = heads * dim, bs * max_blocks + 1, dim**-0.5, 1e-6
    y = torch.randn(bs, hidden, device=dev, dtype=dt)
    r = torch.randn(bs, hidden, device=dev, dtype=dt)
    wa = (1 + 0.1 * torch.randn(hidden, device=dev)).to(dt)
    wb = (1 + 0.1 * torch.randn(hidden, device=dev)).to(dt)
    k = torch.randn(bs, kv_heads, dim, device=dev, dtype=dt)
    v = torch.randn(bs, kv_heads, dim, device=dev, dtype=dt)
    cache_a = torch.randn(2, num_blocks, block, kv_heads, dim, device=dev, dtype=dt)
    cache_b = torch.randn_like(cache_a)
    static = build_metadata(
        [1] * bs, [0] * bs, [[i + 1] for i in range(bs)], block, device=dev, pad_blocks_to=max_blocks
    )

    def step():
        h, x = rmsnorm.add_rmsnorm2_triton(y, r, wa, wb, eps, eps)
        q = x.view(bs, heads, dim)
        att = triton_attention.attention_forward(q, k, v, cache_a, *static, scale, split_k=True)
        triton_attention.kv_write_triton(k, v, cache_b, static.slot_mapping)
        uni = triton_attention.paged_attention_triton(
            q, cache_b, *static[1:], scale, split_k=True, config={"decode": False}
        )
        out = rmsnorm.rmsnorm_triton(att.view(bs, hidden), wa, eps)
        return h, x, att, uni, out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, x, att, uni, out = step()
    tol = {"rtol": 2e-2, "atol": 2e-2}
    for trial in range(4):
        gen = torch.Generator().manual_seed(200 + trial)
        n_real = bs - trial % 2  # odd trials: the last row is padding
        ctx = torch.randint(0, max_blocks * block - 1, (n_real,), generator=gen).tolist()
        perm = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()
        tables = [perm[i * max_blocks : (i + 1) * max_blocks] for i in range(n_real)]
        md = build_metadata(
            [1] * n_real, ctx, tables, block, device=dev, pad_tokens_to=bs, pad_seqs_to=bs, pad_blocks_to=max_blocks
        )
        for dst, src in zip(static, md):
            dst.copy_(src)
        for t in (y, r, k, v):
            t.normal_()
        before_a, before_b = cache_a.clone(), cache_b.clone()
        graph.replay()
        torch.cuda.synchronize()
        want_h, want_x = rmsnorm.add_rmsnorm2_reference(y, r, wa, wb, eps, eps)
        torch.testing.assert_close(h.float(), want_h.float(), **tol)
        torch.testing.assert_close(x.float(), want_x.float(), **tol)
        q = x.view(bs, heads, dim)
        for cache, before, got in ((cache_a, before_a, att), (cache_b, before_b, uni)):
            ref_cache = before.clone()
            kv_write_reference(k, v, ref_cache, md.slot_mapping)
            assert torch.equal(cache, ref_cache)
            ref = paged_attention_reference(q, ref_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale)
            torch.testing.assert_close(got.float(), ref.float(), **tol)
            assert torch.count_nonzero(got[n_real:]) == 0
        want_out = rmsnorm.rmsnorm_reference(att.view(bs, hidden), wa, eps)
        torch.testing.assert_close(out.float(), want_out.float(), **tol)
    # the kernels really were built and launched with PDL
    for fn in (
        triton_attention._kv_write_kernel,
        triton_attention._paged_attention_kernel,
        decode_attention._paged_attention_decode_kernel,
        attention_common._split_reduce_kernel,
        rmsnorm._fused_rmsnorm_kernel,
    ):
        built = _compiled_pdl_kernels(fn)
        assert built, fn.__name__
        assert all("griddepcontrol.wait" in k.asm["ptx"] for k in built), fn.__name__


def _compiled_ouro_run(tiny_dirs, monkeypatch, pdl: str, trigger: str = "early"):
    from test_graphs_gpu import BLOCK, decode_inputs, prompts_and_tables, run_prefill

    from rlt_compile import load_model
    from rlt_compile.graphs import CudaGraphRunner

    monkeypatch.setenv("RLT_PDL", pdl)
    monkeypatch.setenv("RLT_PDL_TRIGGER", trigger)
    model = load_model(tiny_dirs["ouro"], dtype=torch.float32, device="cuda", load_tokenizer=False)
    cm = compile_model(model, platform="cuda")
    assert cm.units["loop_step"].backend.inductor_config.get(PDL_PATCH, False) is (pdl == "1")
    planes = model.allocate_kv_cache(16, BLOCK)
    prompts, tables = prompts_and_tables(3, seed=1)
    logits = [run_prefill(cm, planes, prompts, tables, {})]
    runner = CudaGraphRunner(cm.run_compiled, planes, max_num_seqs=4, max_blocks_per_seq=4)
    runner.capture()
    lengths, tokens = [len(p) for p in prompts], logits[0].argmax(-1).tolist()
    for _ in range(4):
        ids, pos, meta, rows = decode_inputs(lengths, tables, tokens)
        logits.append(runner(ids, pos, meta, rows))
        lengths, tokens = [n + 1 for n in lengths], logits[-1].argmax(-1).tolist()
    assert runner.replays == 4 and runner.fallbacks == 0
    code = "\n".join(c for unit in model.compile_units for rec in cm.graph_records(unit) for c in rec.output_code)
    return logits, code


@pytest.mark.gpu
@gpu
@needs_pdl
def test_gpu_compiled_graphs_same_output_with_pdl_on_and_off(tiny_dirs, monkeypatch):
    """A tiny Ouro compiled (Inductor + our kernels) with CUDA-graph decode: the same logits and greedy
    tokens with RLT_PDL=1 (Inductor's triton.enable_pdl on, our kernels launched with PDL; their
    trigger first and, ``RLT_PDL_TRIGGER=wait``, after their wait) and RLT_PDL=0."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        on, code_on = _compiled_ouro_run(tiny_dirs, monkeypatch, "1")
        assert _compiled_pdl_kernels(rmsnorm._fused_rmsnorm_kernel)  # our norm ran with PDL
        assert _compiled_pdl_kernels(decode_attention._paged_attention_decode_kernel)  # decode steps too
        late, _ = _compiled_ouro_run(tiny_dirs, monkeypatch, "1", "wait")
        off, code_off = _compiled_ouro_run(tiny_dirs, monkeypatch, "0")
    finally:
        torch.set_float32_matmul_precision(old)
    assert "gdc_wait" in code_on and "gdc_wait" not in code_off
    for i, (a, b) in enumerate(zip(on + late, off + off)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"step {i}: {m}")
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist(), i
