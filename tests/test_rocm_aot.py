"""Ahead-of-time compilation of every Triton kernel for AMD (gfx942, gfx950) and NVIDIA (sm_90) on the CPU.

No GPU is needed (and none is used): ``rlt_compile.kernels.aot`` records the launches the real
launchers make on ``meta`` tensors, binds them like ``JITFunction.run`` would on each target, and runs
``triton.compile`` for ``GPUTarget("hip", "gfx942" | "gfx950", 64)`` and ``GPUTarget("cuda", 90, 32)``
(ptxas ships in the Triton wheel). The dot precision of each dtype is what
``Platform.mock(kind, arch=...).dot_precision(dtype)`` picks.

Set compiled here (representative but complete, < 2 min on 2 cores): every kernel x every dtype
(fp16, bf16, fp32) x every batch mode (prefill, decode, split-K decode: all tile configurations the
launchers choose) for the MHA workload (Ouro), plus the GQA workload (Nanbeige 48/8, a KV plane over
2 GiB, which changes the AMD buffer-op specialisation) in bf16, Ouro's bf16 decode at a
208-position table (the short-context 16-key tiles) and Huginn's bf16 decode GEMVs (2048-long runs).
The full matrix of all workloads is ``python -m rlt_compile.kernels.aot --jobs 2``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlt_compile.kernels import aot
from rlt_compile.platform import Platform

TARGETS = ("gfx942", "gfx950", "sm_90")
OURO, NANBEIGE, HUGINN = aot.WORKLOADS[0], aot.WORKLOADS[1], aot.WORKLOADS[-1]
# the bench's 208-position table: 16-bit decode takes its short-context 16-key tiles
SHORT_OURO = dataclasses.replace(OURO, name="ouro-1.4b-short", max_model_len=208)
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _specs(kind: str, arch: str, precision: str | None = None, **kw) -> list[aot.Specialisation]:
    return aot.specialisations(Platform.mock(kind, arch=arch), precision=precision, **kw)


def ci_specs(target: str) -> list[aot.Specialisation]:
    """The CI set for ``target``: all kernels x dtypes x modes for Ouro, plus Nanbeige in bf16, plus
    Ouro's short-context bf16 decode, plus Huginn's bf16 decode GEMVs (the 2048-long 2-column tiles:
    Ouro's o and down take 4-column tiles)."""
    kind, arch = aot.TARGETS[target]
    merged: dict[str, aot.Specialisation] = {}
    bf16 = (torch.bfloat16,)
    for spec in (
        _specs(kind, arch, workloads=(OURO,))
        + _specs(kind, arch, workloads=(NANBEIGE,), dtypes=bf16)
        + _specs(kind, arch, workloads=(SHORT_OURO,), dtypes=bf16, modes=("decode", "decode-split"))
        + [s for s in _specs(kind, arch, workloads=(HUGINN,), dtypes=bf16, modes=("decode",)) if "gemv" in s.short_name]
    ):
        if spec.key() in merged:
            merged[spec.key()].labels.extend(spec.labels)
        else:
            merged[spec.key()] = spec
    return list(merged.values())


@pytest.fixture(scope="module")
def executor():
    with aot.new_executor(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def reports(executor) -> dict[str, list[aot.KernelReport]]:
    """target -> one report per compiled specialisation (all three targets share the process pool)."""
    jobs = {t: ci_specs(t) for t in TARGETS}
    return {t: aot.compile_for(t, specs=jobs[t], executor=executor) for t in TARGETS}


# --------------------------------------------------------------------------------------- discovery
def test_discovers_every_triton_kernel():
    kernels = aot.discover_kernels()
    names = {k.rsplit(".", 1)[-1] for k in kernels}
    assert {"_kv_write_kernel", "_paged_attention_kernel", "_split_reduce_kernel"} <= names, names
    # Launchers and helpers are not kernels.
    assert not names & {"kv_write_triton", "paged_attention_triton", "choose_num_splits", "_tile_config"}


@pytest.mark.parametrize("target", TARGETS)
def test_ci_set_launches_every_kernel_in_every_dtype_and_mode(target):
    """Coverage of the CI set: a kernel added to rlt_compile/kernels that no launch reaches fails here."""
    specs = ci_specs(target)
    kind, arch = aot.TARGETS[target]
    assert {s.kernel for s in specs} == set(aot.discover_kernels(platform=Platform.mock(kind, arch=arch)))
    labels = {label for s in specs for label in s.labels}
    for dtype in aot.DTYPES:
        for mode in aot.MODES:
            assert f"{OURO.name}/{DTYPE_NAMES[dtype]}/{mode}" in labels
    paged = [s for s in specs if s.short_name == "paged_attention_kernel"]
    tiles = {(c["BLOCK_M"], c["BLOCK_N"], c["NUM_SPLITS"]) for c in (s.named_constexprs() for s in paged)}
    assert len(tiles) >= 5, tiles  # prefill / decode / split-K tiles for 16-bit and fp32 caches
    assert any(s.named_constexprs()["GROUP"] > 1 for s in paged)  # GQA
    # the one-row GEMV tiles the target's SM count picks: Ouro's o and down (4 columns, 2048-long runs), its
    # q/k/v and gate/up (2 x 1024), Huginn's (2 x 2048)
    gemv = {
        (c["BLOCK_N"], c["BLOCK_K"]) for c in (s.named_constexprs() for s in specs if s.short_name == "gemv_kernel")
    }
    assert {(4, 2048), (2, 2048), (2, 1024)} <= gemv, gemv


# ----------------------------------------------------------------------------------- AOT compiles
@pytest.mark.parametrize("target", TARGETS)
def test_aot_compiles_every_kernel(reports, target):
    kind, arch = aot.TARGETS[target]
    platform = Platform.mock(kind, arch=arch)
    got = reports[target]
    print(f"\n{aot.format_table(got)}")
    failed = [f"{r.spec.short_name} [{', '.join(r.spec.labels)}]: {r.error}" for r in got if not r.ok]
    assert not failed, "\n".join(failed)
    assert {r.spec.kernel for r in got} == set(aot.discover_kernels(platform=platform))
    for r in got:
        assert r.fits, f"{r.spec.short_name} needs {r.shared} B of shared memory, {target} has {r.max_shared}"
        assert r.extra["binary"] == ("hsaco" if kind == "rocm" else "cubin") and r.extra["binary_bytes"] > 0
        assert r.extra["warp_size"] == (64 if kind == "rocm" else 32)
        assert r.n_regs is not None and r.n_regs > 0 and r.n_spills is not None
        if r.precision is not None:  # the PRECISION constexpr is the Platform's choice for the dtype
            (dtype,) = {label.split("/")[1] for label in r.spec.labels}
            by_name = {v: k for k, v in DTYPE_NAMES.items()}
            assert r.precision == platform.dot_precision(by_name[dtype])
            if kind == "rocm":
                assert r.precision == "ieee"


def test_sm90_registers_and_spills_are_recorded(reports, record_property):
    got = reports["sm_90"]
    table = aot.format_table(got)
    print(f"\nsm_90 registers / spills (ptxas -v of the AOT compile):\n{table}")
    record_property("sm_90_registers", table)
    for r in got:
        assert isinstance(r.n_regs, int) and 0 < r.n_regs <= 255, r
        assert isinstance(r.n_spills, int) and r.n_spills >= 0, r
        assert r.spill_stores is not None and r.spill_loads is not None, r
        assert r.shared is not None


def test_no_register_spills_on_any_target(reports):
    """Every specialisation fits its target's registers (gfx942 takes Platform.compact_attention_tiles)."""
    spilled = [
        (t, r.spec.short_name, r.spec.dtypes(), r.n_spills) for t, rs in reports.items() for r in rs if r.n_spills
    ]
    assert not spilled, spilled


def test_no_wgmma_serialized_on_sm90(reports):
    """ptxas serializes every wgmma of a kernel (note C7515: each waits for the previous one) when it
    cannot keep their accumulators apart, e.g. with a score tile carried across loop iterations (the
    TMA prefill with the next tile's scores issued before this tile's softmax, tried offline in
    session 19). None of our kernels may trigger it."""
    assert all("ptxas_perf_warnings" in r.extra for r in reports["sm_90"] if r.ok)
    warned = [
        (r.spec.short_name, r.spec.describe(), w) for r in reports["sm_90"] for w in r.extra["ptxas_perf_warnings"]
    ]
    assert not warned, warned


def test_ptxas_performance_notes_are_parsed():
    log = (
        "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline "
        "stage in the function '_prefill_tma_kernel' in line 1942\n"
        "ptxas info    : Function properties for _prefill_tma_kernel\n"
        "ptxas info    : Used 220 registers, used 1 barriers\n"
    )
    info = aot._parse_ptxas_log(log, "_prefill_tma_kernel")
    assert info["n_regs"] == 220
    assert info["perf_warnings"] == [
        "(C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma "
        "instructions defining accumulator registers of a wgmma between start and end of the pipeline stage"
    ]
    assert aot._parse_ptxas_log("ptxas info    : Used 31 registers", "k")["perf_warnings"] == []


def test_amd_register_metadata_is_recorded(reports):
    for target in ("gfx942", "gfx950"):
        for r in reports[target]:
            assert 0 < r.n_regs <= 512 and r.n_spills is not None and r.extra["sgpr_count"] is not None, r


# ------------------------------------------------------------------------------ tf32 is rejected
def _tf32_paged_spec(kind: str, arch: str) -> aot.Specialisation:
    specs = _specs(kind, arch, "tf32", workloads=(OURO,), dtypes=(torch.float32,), modes=("decode",))
    (spec,) = [s for s in specs if s.short_name == "paged_attention_kernel"]
    assert spec.named_constexprs()["PRECISION"] == "tf32"
    return spec


def test_tf32_variant_is_rejected_on_gfx950():
    """The bug the dot-precision pass prevents: a tf32 tl.dot does not compile for MI350."""
    report = aot.compile_specialisation(_tf32_paged_spec("rocm", "gfx950"), "rocm", "gfx950")
    assert not report.ok
    assert report.error.startswith("CompilationError"), report.error
    assert "input_precision" in report.error and "tf32" in report.error
    # The same kernel with the Platform's precision compiles (see test_aot_compiles_every_kernel).
    assert Platform.mock("rocm", arch="gfx950").dot_precision(torch.float32) == "ieee"


def test_tf32_variant_compiles_on_sm90(monkeypatch):
    """Control: the tf32 specialisation itself is valid; rejecting it is gfx950's, not a broken spec."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert Platform.mock("cuda", arch="sm_90").dot_precision(torch.float32) == "tf32"
        report = aot.compile_specialisation(_tf32_paged_spec("cuda", "sm_90"), "cuda", "sm_90")
    finally:
        torch.set_float32_matmul_precision(old)
    assert report.ok, report.error
    assert report.precision == "tf32" and report.n_spills is not None
