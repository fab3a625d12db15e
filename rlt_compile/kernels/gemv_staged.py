"""Decode GEMV whose weights are staged in shared memory by TMA before the PDL wait (Gluon, Hopper).

At batch-1 decode HBM idles while the latency-bound kernels run (decode attention at a short
context, the norms: ~9 of an Ouro layer's ~36 us on the H200, docs/benchmarks.md sessions 8-14).
The Triton GEMV (``gemv``) reads only its first weight tile per *resident* program before its
``gdc_wait()``: registers bound how much is in flight, and later waves start after the wait. Here one
program per SM (or a few) owns a contiguous range of output rows and, before the wait, issues TMA
copies of its first ``STAGES`` weight tiles into a ring of shared-memory stages (up to ~200 KiB per
SM, no registers held). Launched early through PDL, a GEMV two or three kernels downstream can so
pull most of its weights while the attention or a norm still runs. After the wait it loads ``x``
once into shared memory, then consumes the ring tile by tile, refilling each stage as it frees.

``y = x @ W.T`` for one row ``x`` ``[K]`` and ``W`` ``[N, K]`` (16-bit, contiguous), fp32 accumulation
(a 2-D accumulator reduced once per row block), one rounding to the output dtype. NVIDIA sm_90+ only;
the Triton interpreter cannot run Gluon, so it is tested on the device and compiled offline.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from rlt_compile.kernels.launch import pdl_launch_options, pdl_mode, sm_count

__all__ = ["STAGED_TILE", "linear_staged", "staged_plan", "supports_staged"]

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# and a shared-memory view with another layout _reinterpret; later versions reinterpret
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

# block_n x block_k: one TMA tile (4 KiB in bf16); stages: the ring's tiles (48 x 4 KiB = 192 KiB, one program per
# SM); programs_per_sm: how many programs share an SM (the ring shrinks to fit); warps: per program
STAGED_TILE = {"block_n": 16, "block_k": 128, "stages": 48, "programs_per_sm": 1, "warps": 4, "ws": 0}
_SMEM_BUDGET = 200 * 1024  # per SM, for the rings of its programs (sm_90: 227 KiB per block at most)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _issue(w_desc, bars, ring, t, n0, KB: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
           STAGES: gl.constexpr, pred):  # fmt: skip
    """TMA copy of tile ``t`` (row block ``t // KB``, key block ``t % KB`` of the program's rows from
    ``n0``) into stage ``t % STAGES``, signalled on that stage's barrier."""
    stage = t % STAGES
    mbarrier.expect(bars.index(stage), BLOCK_N * BLOCK_K * w_desc.dtype.primitive_bitwidth // 8, pred=pred)
    _tma_load(w_desc, [n0 + (t // KB) * BLOCK_N, (t % KB) * BLOCK_K], bars.index(stage), ring.index(stage), pred=pred)


@gluon.jit
def _staged_gemv_kernel(
    w_desc, x_ptr, y_ptr, N, rb_per_program,
    K: gl.constexpr, KB: gl.constexpr, KB_PAD: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr, USE_PDL: gl.constexpr, layout: gl.constexpr, x_layout: gl.constexpr,
):  # fmt: skip
    pid = gl.program_id(0)
    num_rb = gl.cdiv(N, BLOCK_N)
    rb0 = pid * rb_per_program
    n_rb = gl.minimum(rb_per_program, num_rb - rb0)
    n0 = rb0 * BLOCK_N
    tiles = n_rb * KB
    if USE_PDL:
        _gdc_launch_dependents()

    ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()
    # the weights never depend on the previous kernel: fill the ring before the PDL wait
    for s in gl.static_range(STAGES):
        _issue(w_desc, bars, ring, s, n0, KB, BLOCK_N, BLOCK_K, STAGES, s < tiles)
    if USE_PDL:
        _gdc_wait()

    x_smem = gl.allocate_shared_memory(w_desc.dtype, [KB_PAD, BLOCK_K], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    x_rows = _x_rows(x_ptr, x_smem, K, KB_PAD, BLOCK_K, x_layout)

    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    col_layout: gl.constexpr = gl.SliceLayout(0, layout)
    for rb in range(n_rb):
        acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
        for kb in range(KB):
            t = rb * KB + kb
            stage = t % STAGES
            mbarrier.wait(bars.index(stage), (t // STAGES) & 1)
            w = ring.index(stage).load(layout).to(gl.float32)
            xk = x_rows.index(kb).load(col_layout).to(gl.float32)
            acc += w * xk[None, :]
            _barrier()  # every warp has read the stage before TMA refills it
            _issue(w_desc, bars, ring, t + STAGES, n0, KB, BLOCK_N, BLOCK_K, STAGES, t + STAGES < tiles)
        rows = n0 + rb * BLOCK_N + offs_n
        gl.store(y_ptr + rows, gl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rows < N)

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


@gluon.jit
def _x_rows(x_ptr, x_smem, K: gl.constexpr, KB_PAD: gl.constexpr, BLOCK_K: gl.constexpr, x_layout: gl.constexpr):
    """``x`` ``[K]`` into ``x_smem`` as ``[KB_PAD, BLOCK_K]`` (key block kb is row kb); returns the same
    bytes (row-major, unswizzled) with a rank-1 layout, so that ``.index(kb)`` gives key block kb."""
    offs_xb = gl.arange(0, KB_PAD, layout=gl.SliceLayout(1, x_layout))
    offs_xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_layout))
    x_offs = offs_xb[:, None] * BLOCK_K + offs_xk[None, :]
    x_smem.store(gl.load(x_ptr + x_offs, mask=x_offs < K, other=0.0))
    row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    if _PUBLIC_REINTERPRET:
        x_rows = x_smem.reinterpret(x_smem.dtype, [KB_PAD, BLOCK_K], row_layout)
    else:
        x_rows = x_smem._reinterpret(x_smem.dtype, [KB_PAD, BLOCK_K], row_layout)
    _barrier()
    return x_rows


@gluon.jit
def _ws_consume(ring, bars, x_smem, x_ptr, y_ptr, N, n0, n_rb, K: gl.constexpr, KB: gl.constexpr,
                KB_PAD: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                USE_PDL: gl.constexpr, layout: gl.constexpr, x_layout: gl.constexpr):  # fmt: skip
    """The consumer warps: after the PDL wait, ``x`` into shared memory, then each tile as it lands
    (barrier ``stage``), freeing its stage (barrier ``STAGES + stage``) for the copy warp."""
    if USE_PDL:
        _gdc_wait()
    x_rows = _x_rows(x_ptr, x_smem, K, KB_PAD, BLOCK_K, x_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    col_layout: gl.constexpr = gl.SliceLayout(0, layout)
    for rb in range(n_rb):
        acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
        for kb in range(KB):
            t = rb * KB + kb
            stage = t % STAGES
            mbarrier.wait(bars.index(stage), (t // STAGES) & 1)
            w = ring.index(stage).load(layout).to(gl.float32)
            xk = x_rows.index(kb).load(col_layout).to(gl.float32)
            acc += w * xk[None, :]
            _barrier()  # every consumer warp has read the stage before the one thread's arrive
            mbarrier.arrive(bars.index(STAGES + stage))
        rows = n0 + rb * BLOCK_N + offs_n
        gl.store(y_ptr + rows, gl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rows < N)


@gluon.jit
def _ws_copy(w_desc, ring, bars, n0, tiles, KB: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
             STAGES: gl.constexpr):  # fmt: skip
    """The copy warp: every weight tile in order, each into its stage once the consumers freed it (the
    first round's waits pass at once), with no PDL wait: the weights never depend on the previous kernel."""
    for t in range(tiles):
        stage = t % STAGES
        mbarrier.wait(bars.index(STAGES + stage), ((t // STAGES) & 1) ^ 1)
        _issue(w_desc, bars, ring, t, n0, KB, BLOCK_N, BLOCK_K, STAGES, True)


@gluon.jit
def _staged_gemv_ws_kernel(
    w_desc, x_ptr, y_ptr, N, rb_per_program,
    K: gl.constexpr, KB: gl.constexpr, KB_PAD: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr, USE_PDL: gl.constexpr, layout: gl.constexpr, x_layout: gl.constexpr,
):  # fmt: skip
    """``_staged_gemv_kernel`` with the copies in a warp of their own (``gl.warp_specialize``): no CTA
    barrier around each TMA issue in the consumers' loop."""
    pid = gl.program_id(0)
    num_rb = gl.cdiv(N, BLOCK_N)
    rb0 = pid * rb_per_program
    n_rb = gl.minimum(rb_per_program, num_rb - rb0)
    n0 = rb0 * BLOCK_N
    ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    x_smem = gl.allocate_shared_memory(w_desc.dtype, [KB_PAD, BLOCK_K], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    for s in gl.static_range(2 * STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()
    if USE_PDL:
        _gdc_launch_dependents()
    gl.warp_specialize(
        [(_ws_consume, (ring, bars, x_smem, x_ptr, y_ptr, N, n0, n_rb, K, KB, KB_PAD, BLOCK_N, BLOCK_K, STAGES,
                        USE_PDL, layout, x_layout)),
         (_ws_copy, (w_desc, ring, bars, n0, n_rb * KB, KB, BLOCK_N, BLOCK_K, STAGES))],
        [1],
        [24],
    )  # fmt: skip


def supports_staged(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One 16-bit row on an sm_90+ GPU, a contiguous weight whose rows are 16-byte aligned."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and x.is_contiguous()
        and weight.shape[1] == x.shape[1]
        and weight.shape[1] % 8 == 0
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def staged_plan(n: int, k: int, sms: int, config: dict | None = None) -> dict:
    """The launch of an ``[n, k]`` GEMV: tile, ring depth, row blocks per program and the grid."""
    tile = {**STAGED_TILE, **(config or {})}
    tile["block_k"] = min(tile["block_k"], max(64, triton.next_power_of_2(k)))  # short rows: a narrower tile
    block_n, block_k = tile["block_n"], tile["block_k"]
    num_rb = triton.cdiv(n, block_n)
    programs = sms * tile["programs_per_sm"]
    rb_per_program = triton.cdiv(num_rb, programs)
    kb = triton.cdiv(k, block_k)
    tile_bytes = block_n * block_k * 2
    budget = _SMEM_BUDGET // tile["programs_per_sm"] - triton.next_power_of_2(kb) * block_k * 2
    stages = max(2, min(tile["stages"], rb_per_program * kb, budget // tile_bytes))
    return {
        **tile,
        "stages": stages,
        "rb_per_program": rb_per_program,
        "grid": triton.cdiv(num_rb, rb_per_program),
        "kb": kb,
    }


def _layouts(block_n: int, block_k: int, kb_pad: int, warps: int):
    vec = 8  # 16 bytes of a 16-bit row per lane
    lanes_k = min(32, block_k // vec)
    tile = gl.BlockedLayout([1, vec], [32 // lanes_k, lanes_k], [warps, 1], [1, 0])
    x_lanes_k = min(32, block_k // vec)
    x_tile = gl.BlockedLayout([1, vec], [32 // x_lanes_k, x_lanes_k], [warps, 1], [1, 0])
    return tile, x_tile


def linear_staged(
    x: torch.Tensor, weight: torch.Tensor, config: dict | None = None, pdl: int | None = None
) -> torch.Tensor:
    """``x @ weight.T`` for one row through ``_staged_gemv_kernel`` (``supports_staged`` must hold);
    ``pdl``: the PDL mode (default: ``launch.pdl_mode``, early trigger on Hopper)."""
    n, k = weight.shape
    pdl = pdl_mode(x) if pdl is None else pdl
    plan = staged_plan(n, k, sm_count(x.device), config)
    block_n, block_k = plan["block_n"], plan["block_k"]
    kb_pad = triton.next_power_of_2(plan["kb"])
    dtype = gl.bfloat16 if weight.dtype == torch.bfloat16 else gl.float16
    smem_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], dtype)
    w_desc = TensorDescriptor(weight, [n, k], [k, 1], [block_n, block_k], smem_layout)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    layout, x_layout = _layouts(block_n, block_k, kb_pad, plan["warps"])
    kernel = _staged_gemv_ws_kernel if plan["ws"] else _staged_gemv_kernel
    kernel[(plan["grid"],)](
        w_desc, x, y, n, plan["rb_per_program"],
        K=k, KB=plan["kb"], KB_PAD=kb_pad, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=plan["stages"],
        USE_PDL=pdl, layout=layout, x_layout=x_layout, num_warps=plan["warps"], **pdl_launch_options(pdl),
    )  # fmt: skip
    return y
