"""The decode chain's load order in its sm_90 SASS, compiled ahead of time on the CPU (no GPU).

At batch-1 decode each kernel of the layer chain is latency-bound: after its PDL wait it should issue
every global load that does not depend on a reduction before the first barrier, or it waits for one
more memory round trip. ``aot.memory_order`` lists a kernel's global accesses, PDL wait (``WAIT``) and
barriers (``BAR``) in program order; these tests pin the orders docs/benchmarks.md (session 18)
records, for the variants an H200 launches (PDL mode 2, Ouro-1.4B's shapes, bf16).
"""

from __future__ import annotations

import pytest
import torch

from rlt_compile.kernels import aot, gemv, rmsnorm
from rlt_compile.platform import Platform

pytestmark = pytest.mark.skipif(not aot.nvdisasm_path().exists(), reason="this Triton wheel ships no nvdisasm")


def _orders(kernel: str, mode: str = "decode", **constexprs) -> list[str]:
    """The memory orders of the sm_90 specialisations of ``kernel`` (Ouro-1.4B's shapes, bf16,
    ``mode``) with these constexprs."""
    specs = aot.specialisations(
        Platform.mock("cuda", arch="sm_90"), None, aot.WORKLOADS[:1], (torch.bfloat16,), (mode,), pdl=2
    )
    chosen = [
        s
        for s in specs
        if s.kernel.endswith(kernel) and all(s.named_constexprs().get(k) == v for k, v in constexprs.items())
    ]
    assert chosen, (kernel, constexprs)
    return [aot.compile_specialisation(s, "cuda", "sm_90", sass=True).extra["memory_order"] for s in chosen]


def _after_wait(order: str) -> list[str]:
    """The tokens after the PDL wait, runs expanded (``BAR*2`` -> ``BAR BAR``)."""
    tokens = []
    for token in order.split("WAIT", 1)[1].split():
        name, _, count = token.partition("*")
        tokens += [name] * int(count or 1)
    return tokens


def _loads_right_after_wait(order: str) -> int:
    """The global loads a kernel issues after its PDL wait before anything else (a barrier, a store):
    the loads in flight together in its first round trip."""
    tokens = _after_wait(order)
    return next((i for i, token in enumerate(tokens) if token != "LDG"), len(tokens))


def test_memory_order_collapses_runs_in_program_order():
    sass = """
        /*0010*/                   LDG.E.128 R8, desc[UR10][R2.64] ;
        /*0020*/              @!P2 LDG.E.128 R4, desc[UR10][R12.64] ;
        /*0030*/                   ACQBULK ;
        /*0040*/                   REDUX.SUM.S32 UR7, R2 ;
        /*0048*/                   ATOMS.ADD R1, [R2], R3 ;
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0060*/                   LDGSTS.E.BYPASS.128 [R6], desc[UR10][R12.64], P4 ;
        /*0070*/                   ATOMG.E.ADD.STRONG.GPU PT, R5, desc[UR10][R2.64], R7 ;
        /*0080*/               @P0 STG.E.U16 desc[UR10][R2.64], R23 ;
    """
    assert aot.memory_order(sass) == "LDG*2 WAIT BAR LDGSTS ATOM STG"


def test_sandwich_norm_loads_its_input_and_residual_rows_before_its_first_barrier(monkeypatch):
    """Ouro's add_rmsnorm2 (``h = r + norm_a(y)``): ``y`` and ``r`` in one round trip (the residual
    used to follow norm a's reduction, as it still does with ``_EARLY_RESIDUAL`` off)."""
    (order,) = _orders("_fused_rmsnorm_kernel", RESIDUAL=2)
    assert _loads_right_after_wait(order) == 2, order
    monkeypatch.setattr(rmsnorm, "_EARLY_RESIDUAL", False)
    (order,) = _orders("_fused_rmsnorm_kernel", RESIDUAL=2)
    assert _loads_right_after_wait(order) == 1, order


def test_rotary_gemv_loads_cos_and_sin_with_its_input(monkeypatch):
    (order,) = _orders("_gemv_kernel", ROPE_HALF=64)  # acc_2d: the second weight tile's loads join them
    assert _after_wait(order)[-2:] == ["BAR", "STG"] and _loads_right_after_wait(order) > 3, order
    monkeypatch.setenv("RLT_GEMV_CONFIG", "acc_2d=0")  # a reduction per tile: its barrier splits them
    (order,) = _orders("_gemv_kernel", ROPE_HALF=64)
    assert _loads_right_after_wait(order) == 3, order  # x, cos, sin
    monkeypatch.setattr(gemv, "_EARLY_ROPE", False)
    (order,) = _orders("_gemv_kernel", ROPE_HALF=64)
    assert _loads_right_after_wait(order) == 1, order


def test_acc_2d_gemv_issues_every_load_after_the_wait_before_its_reduction(monkeypatch):
    """One-row GEMVs with ``acc_2d=0`` reduce each K tile behind a barrier, so the second weight
    tile's loads wait for the first tile's reduction; with ``acc_2d`` (the 16-bit default since
    session 19) every load comes before the single reduction (one barrier with 4 warps, more with 8)."""
    monkeypatch.setenv("RLT_GEMV_CONFIG", "acc_2d=0")
    for order in _orders("_gemv_kernel", BLOCK_M=1, ROPE_HALF=0, SILU_MUL=False):
        tokens = _after_wait(order)  # x, a reduction, the second tile, its reduction
        assert "LDG" in tokens[tokens.index("BAR") :], order
    monkeypatch.delenv("RLT_GEMV_CONFIG")
    # plain and SiLU prologue on the o and down projections (4 columns, 8 warps; 2048-long runs for the o,
    # 4096-long for the down), the q/k/v with its rotary epilogue and gate/up with its SwiGLU epilogue (2
    # columns, 4 warps)
    orders = _orders("_gemv_kernel", BLOCK_M=1, ACC_2D=True)
    assert len(orders) == 6, orders
    for order in orders:
        tokens = _after_wait(order)  # every load, then the reduction's barriers (1 with 4 warps), the store
        loads, bars = tokens.count("LDG"), tokens.count("BAR")
        assert tokens == ["LDG"] * loads + ["BAR"] * bars + ["STG"] and loads and bars, order
    assert sum(_after_wait(order).count("BAR") == 1 for order in orders) == 2, orders


def test_decode_attention_loads_q_and_the_written_kv_row_together(monkeypatch):
    """Split 0 of the fused-write decode kernel (batch-1 Ouro: 32 splits, the merge fused) loads q
    and this token's K/V row in one round trip, then stores the row; ``early_q=0`` is the order before
    session 18 (load k, store it, load v, store it, then q)."""
    (order,) = _orders("_paged_attention_decode_kernel", "decode-split", NUM_SPLITS=32)
    assert _loads_right_after_wait(order) == 3, order
    monkeypatch.setenv("RLT_ATTENTION_CONFIG", "early_q=0")
    (order,) = _orders("_paged_attention_decode_kernel", "decode-split", NUM_SPLITS=32)
    assert _after_wait(order)[:4] == ["LDG", "STG", "LDG", "STG"], order
