"""Decode GEMV whose weights are staged in shared memory by TMA before the PDL wait (Gluon, Hopper).

At batch-1 decode HBM idles while the latency-bound kernels run (decode attention at a short
context, the norms: ~9 of an Ouro layer's ~36 us on the H200, docs/benchmarks.md sessions 8-14).
The Triton GEMV (``gemv``) holds only its first weight tile per *resident* program before its
``gdc_wait()``: registers bound how much is in flight, and later waves start after the wait. Here one
program per SM owns a contiguous range of output rows; a copy warp (``gl.warp_specialize``) streams
its weight tiles by TMA into a ring of shared-memory stages from the program's first instruction, PDL
wait or not (the weights never depend on the previous kernel), so up to ~200 KiB per SM land while
the kernels before it still run, in no register. The consumer warps wait, load ``x`` once into shared
memory and multiply the tiles as they land, freeing each stage for the copy warp. By default every
program takes an equal share of the tiles (``balanced``): Ouro's 5632 gate/up outputs in whole
blocks would leave 14 of 132 SMs idle, so a block cut between two programs is finished by the second
of them from both partial sums (a counter per boundary, zero between launches).

``y = x @ W.T`` for one row ``x`` ``[K]`` and ``W`` ``[N, K]`` (16-bit, contiguous), fp32 accumulation
(a 2-D accumulator reduced once per output block), one rounding to the output dtype; ``swiglu``:
``silu(gate) * up`` of a gate/up pair, rounded as the Triton GEMV's epilogue rounds it. NVIDIA sm_90+
only; Triton's interpreter cannot run Gluon, so it is tested on the device and compiled offline.
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
REQUIRES = "supports_wgmma"  # the Platform capability this module's kernel is built for (kernels/aot.py)

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# and a shared-memory view with another layout _reinterpret; later versions reinterpret
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

# block_n x block_k: one TMA tile (block_n 0: staged_plan picks 32, 16 or 8 rows); stages: the ring's tiles at most
# (the plan fills _SMEM_BUDGET); programs_per_sm: how many programs share an SM (the ring shrinks to fit); warps:
# the consumer warps of a program (plus one copy warp); balanced: 1 gives every program an equal share of the tiles,
# cut inside an output block where it falls (the two programs of such a block add their partial sums), 0 whole blocks
STAGED_TILE = {"block_n": 0, "block_k": 256, "stages": 64, "programs_per_sm": 1, "warps": 4, "balanced": 1}
_SMEM_BUDGET = 200 * 1024  # per SM, for the rings and x rows of its programs (sm_90: 227 KiB per block at most)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _issue(w_desc, bars, ring, g, i, half_rows, TILES: gl.constexpr, KB: gl.constexpr, BLOCK_N: gl.constexpr,
           BLOCK_K: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """TMA copy of tile ``g`` (the program's ``i``-th) into stage ``i % STAGES``, signalled on that
    stage's barrier. Tiles run block by block, ``TILES`` per block of ``BLOCK_N`` outputs: key block
    ``g % KB`` of the block's rows, with the SwiGLU epilogue first the gate rows, then the up rows
    ``half_rows`` further."""
    stage = i % STAGES
    r = g % TILES
    row = (g // TILES) * BLOCK_N + (r // KB) * half_rows
    mbarrier.expect(bars.index(stage), BLOCK_N * BLOCK_K * w_desc.dtype.primitive_bitwidth // 8)
    _tma_load(w_desc, [row, (r % KB) * BLOCK_K], bars.index(stage), ring.index(stage))


@gluon.jit
def _x_rows(x_ptr, x_smem, K: gl.constexpr, KB_PAD: gl.constexpr, BLOCK_K: gl.constexpr, layout: gl.constexpr):
    """``x`` ``[K]`` into ``x_smem`` as ``[KB_PAD, BLOCK_K]`` (key block kb is row kb); returns the same
    bytes (row-major, unswizzled) with a rank-1 layout, so that ``.index(kb)`` gives key block kb."""
    offs_xb = gl.arange(0, KB_PAD, layout=gl.SliceLayout(1, layout))
    offs_xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
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
def _dot_x(ring, bars, x_rows, g_lo, g_hi, t_begin, kb0, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
           STAGES: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """Tiles ``g_lo .. g_hi`` (key blocks ``g - kb0``) of one block's rows times ``x`` as they land,
    each stage freed after it is read; ``[BLOCK_N]`` fp32 (a 2-D accumulator, reduced once; zeros for
    no tiles)."""
    acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
    for g in range(g_lo, g_hi):
        i = g - t_begin
        stage = i % STAGES
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        w = ring.index(stage).load(layout).to(gl.float32)
        xk = x_rows.index(g - kb0).load(gl.SliceLayout(0, layout)).to(gl.float32)
        acc += w * xk[None, :]
        _barrier()  # every consumer warp has read the stage before the one thread's arrive
        mbarrier.arrive(bars.index(STAGES + stage))
    return gl.sum(acc, axis=1)


@gluon.jit
def _epilogue(gate, up, dtype: gl.constexpr, SWIGLU: gl.constexpr):
    """The outputs from fp32 sums: rounded once, or with ``SWIGLU`` gate and up rounded, then
    ``silu(gate) * up`` rounded as eager rounds it (``gemv._silu_gate``)."""
    out = gate.to(dtype)
    if SWIGLU:
        g = out.to(gl.float32)
        act = (g / (1.0 + gl.exp(-g))).to(dtype)
        out = (act.to(gl.float32) * up.to(dtype).to(gl.float32)).to(dtype)
    return out


@gluon.jit
def _consume(ring, bars, x_smem, x_ptr, y_ptr, partial_ptr, counter_ptr, n_out, t_begin, t_end, K: gl.constexpr,
             KB: gl.constexpr, KB_PAD: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
             STAGES: gl.constexpr, SWIGLU: gl.constexpr, USE_PDL: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """The consumer warps: after the PDL wait, ``x`` into shared memory, then the program's tiles block
    by block. A block whose tiles all belong to this program is stored at once; a block it shares with
    its neighbour (balanced ranges) leaves its partial sums in ``partial_ptr`` and counts on the
    boundary's counter, and the second of the two to arrive adds both, stores the outputs and zeroes
    the counter for the next launch."""
    if USE_PDL:
        _gdc_wait()
    if USE_PDL == 1:  # RLT_PDL_TRIGGER=wait: the next kernel launches once this one has passed its wait
        _gdc_launch_dependents()
    x_rows = _x_rows(x_ptr, x_smem, K, KB_PAD, BLOCK_K, layout)
    dtype: gl.constexpr = y_ptr.dtype.element_ty
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    TILES: gl.constexpr = KB * (2 if SWIGLU else 1)
    pid = gl.program_id(0)
    for blk in range(t_begin // TILES, (t_end - 1) // TILES + 1):
        b0 = blk * TILES
        lo = gl.maximum(t_begin, b0)
        hi = gl.minimum(t_end, b0 + TILES)
        gate = _dot_x(ring, bars, x_rows, lo, gl.minimum(hi, b0 + KB), t_begin, b0, BLOCK_N, BLOCK_K, STAGES, layout)
        up = gate
        if SWIGLU:
            up = _dot_x(ring, bars, x_rows, gl.maximum(lo, b0 + KB), hi, t_begin, b0 + KB, BLOCK_N, BLOCK_K, STAGES,
                        layout)  # fmt: skip
        rows = blk * BLOCK_N + offs_n
        if (lo == b0) & (hi == b0 + TILES):
            gl.store(y_ptr + rows, _epilogue(gate, up, dtype, SWIGLU), mask=rows < n_out)
        else:  # shared with the neighbour: boundary pid (this program holds its head) or pid - 1 (its tail)
            head = lo == b0
            boundary = gl.where(head, pid, pid - 1)
            mine = partial_ptr + (boundary * 2 + gl.where(head, 0, 1)) * 2 * BLOCK_N
            gl.store(mine + offs_n, gate)
            gl.store(mine + BLOCK_N + offs_n, up)
            _barrier()  # every lane's partial sums before the one thread's count
            if gl.atomic_add(counter_ptr + boundary, 1) == 1:
                other = partial_ptr + (boundary * 2 + gl.where(head, 1, 0)) * 2 * BLOCK_N
                gate += gl.load(other + offs_n, cache_modifier=".cg")
                up += gl.load(other + BLOCK_N + offs_n, cache_modifier=".cg")
                gl.store(y_ptr + rows, _epilogue(gate, up, dtype, SWIGLU), mask=rows < n_out)
                gl.atomic_xchg(counter_ptr + boundary, 0)


@gluon.jit
def _copy(w_desc, ring, bars, t_begin, t_end, half_rows, TILES: gl.constexpr, KB: gl.constexpr,
          BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """The copy warp: every weight tile in order, each into its stage once the consumers freed it (the
    first round's waits pass at once), with no PDL wait: the weights never depend on the previous kernel."""
    for g in range(t_begin, t_end):
        i = g - t_begin
        mbarrier.wait(bars.index(STAGES + i % STAGES), ((i // STAGES) & 1) ^ 1)
        _issue(w_desc, bars, ring, g, i, half_rows, TILES, KB, BLOCK_N, BLOCK_K, STAGES)


@gluon.jit
def _staged_gemv_kernel(
    w_desc, x_ptr, y_ptr, partial_ptr, counter_ptr, n_out, blocks_per_program,
    K: gl.constexpr, KB: gl.constexpr, KB_PAD: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr, SWIGLU: gl.constexpr, BALANCED: gl.constexpr, USE_PDL: gl.constexpr,
    layout: gl.constexpr,
):  # fmt: skip
    """Program ``p`` takes a contiguous range of the weight tiles (``TILES`` per output block of
    ``BLOCK_N`` rows): whole blocks ``[p * blocks_per_program, ...)``, or with ``BALANCED`` an equal
    share of all tiles, cut anywhere. A copy warp streams them through a ring of ``STAGES``
    shared-memory stages, the consumer warps (``num_warps``) multiply them by ``x`` once the PDL wait
    has passed."""
    TILES: gl.constexpr = KB * (2 if SWIGLU else 1)
    pid = gl.program_id(0)
    blocks = gl.cdiv(n_out, BLOCK_N)
    if BALANCED:
        t_begin = pid * (blocks * TILES) // gl.num_programs(0)
        t_end = (pid + 1) * (blocks * TILES) // gl.num_programs(0)
    else:
        t_begin = pid * blocks_per_program * TILES
        t_end = gl.minimum((pid + 1) * blocks_per_program, blocks) * TILES
    ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    x_smem = gl.allocate_shared_memory(w_desc.dtype, [KB_PAD, BLOCK_K], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    if USE_PDL == 2:  # the early trigger (launch.pdl_trigger_first's rule)
        _gdc_launch_dependents()
    for s in gl.static_range(2 * STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [(_consume, (ring, bars, x_smem, x_ptr, y_ptr, partial_ptr, counter_ptr, n_out, t_begin, t_end, K, KB, KB_PAD,
                     BLOCK_N, BLOCK_K, STAGES, SWIGLU, USE_PDL, layout)),
         (_copy, (w_desc, ring, bars, t_begin, t_end, n_out, TILES, KB, BLOCK_N, BLOCK_K, STAGES))],
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


def staged_plan(n_out: int, k: int, sms: int, config: dict | None = None, swiglu: bool = False) -> dict:
    """The launch of a GEMV with ``n_out`` outputs over rows of ``k``: tile (``block_n`` by default the
    tallest of 32 / 16 / 8 rows with a block per program to balance, else the one that leaves the
    busiest program the fewest rows), ring depth (filling
    ``_SMEM_BUDGET`` over the programs of an SM, at most what a program reads), the grid, and either
    an equal share of the tiles per program (``balanced``, where every program gets at least a block's
    tiles, so no block has more than two) or ``blocks_per_program`` whole blocks."""
    tile = {**STAGED_TILE, **(config or {})}
    tile["block_k"] = block_k = min(tile["block_k"], max(64, triton.next_power_of_2(k)))  # short rows: narrower
    programs = sms * tile["programs_per_sm"]

    def rows_of_busiest(block_n):
        return block_n * triton.cdiv(triton.cdiv(n_out, block_n), programs)

    block_n = tile["block_n"]
    if not block_n and tile["balanced"]:  # the tallest block that still leaves every program a block's tiles
        block_n = next((bn for bn in (32, 16, 8) if triton.cdiv(n_out, bn) >= programs), 0)
    block_n = block_n or min((32, 16, 8), key=lambda bn: (rows_of_busiest(bn), -bn))
    blocks = triton.cdiv(n_out, block_n)
    kb = triton.cdiv(k, block_k)
    tiles_per_block = kb * (2 if swiglu else 1)
    balanced = bool(tile["balanced"]) and blocks * tiles_per_block >= programs * tiles_per_block
    per_program = triton.cdiv(blocks, programs)
    grid = programs if balanced else triton.cdiv(blocks, per_program)
    tiles = triton.cdiv(blocks * tiles_per_block, grid) if balanced else per_program * tiles_per_block
    budget = _SMEM_BUDGET // tile["programs_per_sm"] - triton.next_power_of_2(kb) * block_k * 2
    stages = max(2, min(tile["stages"], tiles, budget // (block_n * block_k * 2)))
    return {**tile, "block_n": block_n, "stages": stages, "blocks_per_program": per_program, "grid": grid, "kb": kb,
            "balanced": balanced}  # fmt: skip


def _layout(block_k: int, warps: int):
    """Registers of a ``[rows, block_k]`` tile: 16 bytes of a 16-bit row per lane, warps over rows."""
    lanes_k = min(32, block_k // 8)
    return gl.BlockedLayout([1, 8], [32 // lanes_k, lanes_k], [warps, 1], [1, 0])


def linear_staged(
    x: torch.Tensor, weight: torch.Tensor, config: dict | None = None, swiglu: bool = False, pdl: int | None = None
) -> torch.Tensor:
    """``x @ weight.T`` for one row ``x`` ``[1, K]`` through ``_staged_gemv_kernel`` (``supports_staged``
    must hold); with ``swiglu`` (``weight`` a gate/up pair ``[2I, K]``, gate rows first), ``silu(gate) *
    up`` ``[1, I]``. ``pdl``: the PDL mode (default ``launch.pdl_mode``: the early trigger on Hopper)."""
    n, k = weight.shape
    if swiglu and n % 2:
        raise ValueError(f"linear_staged with swiglu needs a gate/up pair of rows, got weight {tuple(weight.shape)}")
    n_out = n // 2 if swiglu else n
    pdl = pdl_mode(x) if pdl is None else pdl
    plan = staged_plan(n_out, k, sm_count(x.device), config, swiglu)
    block_n, block_k = plan["block_n"], plan["block_k"]
    dtype = gl.bfloat16 if weight.dtype == torch.bfloat16 else gl.float16
    smem_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], dtype)
    w_desc = TensorDescriptor(weight, [n, k], [k, 1], [block_n, block_k], smem_layout)
    y = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    scratch = _scratch(x.device) if plan["balanced"] else None
    if scratch is None:  # whole blocks (no scratch yet during a CUDA-graph capture)
        plan = staged_plan(n_out, k, sm_count(x.device), {**(config or {}), "balanced": 0}, swiglu)
    partials, counters = scratch or _unused(x.device)
    layout = _layout(block_k, plan["warps"])
    _staged_gemv_kernel[(plan["grid"],)](
        w_desc, x, y, partials, counters, n_out, plan["blocks_per_program"],
        K=k, KB=plan["kb"], KB_PAD=triton.next_power_of_2(plan["kb"]), BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=plan["stages"], SWIGLU=swiglu, BALANCED=plan["balanced"], USE_PDL=pdl, layout=layout,
        num_warps=plan["warps"], **pdl_launch_options(pdl),
    )  # fmt: skip
    return y


# Balanced launches: per device, the partial sums of the blocks two programs share ([boundary, head/tail,
# gate/up, BLOCK_N] fp32) and one counter per boundary, zero between launches (the second program to count
# sets it back). Launches that use them run one after another (one stream, as the engine's steps and graphs do;
# under PDL a kernel touches them only after its wait, when the previous one has completed).
_MAX_PROGRAMS = 4096
_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _unused(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins of the scratch's dtypes for launches of whole blocks, which never touch them."""
    return torch.empty(1, device=device), torch.empty(1, dtype=torch.int32, device=device)


def _scratch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(partials, counters)`` on ``device``, made (counters zeroed) at the first balanced launch there;
    None during a CUDA-graph capture before they exist (a buffer made there would stay unzeroed until the
    graph's first replay)."""
    if device.type == "meta":
        return _unused(device)
    if device not in _SCRATCH:
        if torch.cuda.is_current_stream_capturing():
            return None
        _SCRATCH[device] = (
            torch.empty(_MAX_PROGRAMS * 2 * 2 * 32, dtype=torch.float32, device=device),
            torch.zeros(_MAX_PROGRAMS, dtype=torch.int32, device=device),
        )
    return _SCRATCH[device]
