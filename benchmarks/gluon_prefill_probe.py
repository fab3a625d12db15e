"""Probe (issue 3): causal prefill attention in Gluon with FlashAttention-3's in-warp-group overlap.

Triton waits for a score ``wgmma`` right after issuing it, so within a warp group the TMA prefill
kernel's softmax never runs while the tensor cores do (docs/benchmarks.md, session 24). Gluon
issues ``wgmma`` asynchronously with explicit waits. This kernel issues a key tile's scores and the previous tile's PV product back to back, and runs the
tile's softmax while the PV product is still in flight (FlashAttention-3's order):

    issue S(j) = Q K(j)^T, then acc += P(j-1) V(j-1)     tensor cores
    wait S(j) (the PV product may still run)
    softmax of S(j)                                     CUDA cores, while PV(j-1) runs
    wait PV(j-1); rescale acc

Issuing S(j+1) before the softmax of S(j), with acc rescaled while S(j+1) runs, made ptxas serialize
every wgmma (C7514, "non wgmma instructions reading accumulator registers"). In the SASS of this
order ptxas places the PV wait inside the softmax's row max, before its exponentials: how much of
the softmax the PV product hides is for the GPU to say.

It covers fresh causal prompts only: ``q`` ``[B, S, H, D]``, ``k``/``v`` ``[B, S, Hkv, D]`` (GQA or
MHA), bf16, ``S`` a multiple of the query tile. Q, K and V come through TMA, K/V in a ring of
``--stages`` buffers. It is not part of the package. If it beats the TMA prefill kernel on the GPU,
the prefill op can grow a Gluon path for fresh rows.

    python benchmarks/gluon_prefill_probe.py --compile-only [--tiles 64,64,3,4] [--sass FILE]   # offline, sm_90
    python benchmarks/gluon_prefill_probe.py [--tiles "64,64,3,4,1;64,64,3,4,0"]   # GPU: parity, TFLOP/s vs SDPA

Configs are ``block_m,block_n,stages,warps[,heads_first]``. ``heads_first`` (default 1) launches the
grid as (heads, prompts, tiles): the heaviest query tile of every head and prompt first, where
(tiles, heads, prompts) ran each head's tiles before the next head's, leaving the last heads'
heaviest tiles in the tail (session 25 on an H100, m64 n64 s3 w4, before this option: 0.84-0.89x
SDPA; a list-scheduling model of 264 resident programs puts that tail at 12-15% of Ouro's time). 64 query rows and 4 warps are one warp group per program
(two programs per SM, 112 KiB of shared memory each, as the TMA prefill kernel's default tile); 128
rows and 8 warps are two warp groups, which Triton keeps in step with a CTA barrier before each
copy into a freed stage.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_bench import bench  # noqa: E402  (the attention table's timer)

LOG2E = 1.4426950408889634
# triton 3.6 (the device image) names the TMA load async_copy_global_to_shared; later versions async_load
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile, row0, col, pred, BLOCK_N: gl.constexpr):
    """Start the TMA copies of key/value tile ``tile`` into ring stage ``tile % STAGES``."""
    stage = tile % k_smem.shape[0]
    nbytes: gl.constexpr = BLOCK_N * k_desc.block_type.shape[1] * 2
    mbarrier.expect(k_bars.index(stage), nbytes, pred=pred)
    tma_load(k_desc, [row0 + tile * BLOCK_N, col], k_bars.index(stage), k_smem.index(stage), pred)
    mbarrier.expect(v_bars.index(stage), nbytes, pred=pred)
    tma_load(v_desc, [row0 + tile * BLOCK_N, col], v_bars.index(stage), v_smem.index(stage), pred)


@gluon.jit
def _softmax(s, m_i, l_i, offs_m, tile, m0, scale_log2, BLOCK_N: gl.constexpr, col_layout: gl.constexpr):
    """Online softmax of one tile's raw scores (log2 domain, the scale folded into the exponent);
    the causal mask on the tiles that reach the query tile's diagonal."""
    if tile * BLOCK_N + BLOCK_N > m0:
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        s = gl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _attn_fwd(
    q_desc,
    k_desc,
    v_desc,
    out_ptr,
    seq_len,
    scale_log2,
    GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    HEADS_FIRST: gl.constexpr,
):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    num_m = seq_len // BLOCK_M
    if HEADS_FIRST:  # grid (heads, batch, tiles): the heaviest tile of every head and prompt first
        head = gl.program_id(0)
        batch = gl.program_id(1)
        rank = gl.program_id(2)
    else:  # grid (tiles, heads, batch): a head's tiles, heaviest first, then the next head's
        rank = gl.program_id(0)
        head = gl.program_id(1)
        batch = gl.program_id(2)
    tile_m = num_m - 1 - rank  # the causally heaviest tiles first
    m0 = tile_m * BLOCK_M
    row0 = batch * seq_len
    kv_col = (head // GROUP) * HEAD_DIM
    num_kv = (m0 + BLOCK_M) // BLOCK_N

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    mbarrier.expect(q_bar, BLOCK_M * HEAD_DIM * 2)
    tma_load(q_desc, [row0 + m0, head * HEAD_DIM], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, i, row0, kv_col, i < num_kv, BLOCK_N)

    offs_m = m0 + gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, layout=row_s)  # finite: no NaN before the first key
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, offs_m, 0, m0, scale_log2, BLOCK_N, col_s)

    for j in range(1, num_kv):
        prev = j - 1
        mbarrier.wait(k_bars.index(j % STAGES), (j // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(j % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bars.index(prev % STAGES), (prev // STAGES) & 1)
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        acc_next = warpgroup_mma(p_op, v_smem.index(prev % STAGES), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))  # S(j) done; PV(j-1) still runs during the softmax
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, offs_m, j, m0, scale_log2, BLOCK_N, col_s)
        acc = warpgroup_mma_wait(0, deps=(acc_next,))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        # tile j-1 is consumed (its scores and its PV): its stage takes tile j-1+STAGES
        _load_kv(
            k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, prev + STAGES, row0, kv_col, prev + STAGES < num_kv, BLOCK_N
        )

    last = num_kv - 1
    mbarrier.wait(v_bars.index(last % STAGES), (last // STAGES) & 1)
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    acc = warpgroup_mma(p_op, v_smem.index(last % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    out = acc / gl.convert_layout(l_i, row_o)[:, None]
    rows = (row0 + m0 + gl.arange(0, BLOCK_M, layout=row_o)).to(gl.int64)
    cols = head * HEAD_DIM + gl.arange(0, HEAD_DIM, layout=col_o)
    num_heads = gl.num_programs(0) if HEADS_FIRST else gl.num_programs(1)
    gl.store(out_ptr + rows[:, None] * (num_heads * HEAD_DIM) + cols[None, :], out.to(gl.bfloat16))


def _descriptors(q, k, v, block_m: int, block_n: int):
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, dim], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, dim], gl.bfloat16)
    q2 = q.reshape(batch * seq, heads * dim)
    k2 = k.reshape(batch * seq, kv_heads * dim)
    v2 = v.reshape(batch * seq, kv_heads * dim)
    return (
        TensorDescriptor.from_tensor(q2, [block_m, dim], q_layout),
        TensorDescriptor.from_tensor(k2, [block_n, dim], kv_layout),
        TensorDescriptor.from_tensor(v2, [block_n, dim], kv_layout),
    )


def _launch_args(q, k, v, out, scale, block_m, block_n, stages, warps, heads_first=1):
    batch, seq, heads, dim = q.shape
    if seq % block_m or block_m % block_n:
        raise ValueError(f"seq ({seq}) must be a multiple of block_m ({block_m}), block_m of block_n ({block_n})")
    q_desc, k_desc, v_desc = _descriptors(q, k, v, block_m, block_n)
    args = (q_desc, k_desc, v_desc, out, seq, scale * LOG2E)
    kwargs = dict(GROUP=heads // k.shape[2], HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, WARPS=warps,
                  HEADS_FIRST=bool(heads_first))  # fmt: skip
    grid = (heads, batch, seq // block_m) if heads_first else (seq // block_m, heads, batch)
    return grid, args, kwargs


def gluon_attention(q, k, v, scale: float, block_m=64, block_n=64, stages=3, warps=4, heads_first=1) -> torch.Tensor:
    """Causal attention of fresh prompts, ``[B, S, H, D]`` in and out (bf16, contiguous)."""
    out = torch.empty_like(q)
    grid, args, kwargs = _launch_args(q, k, v, out, scale, block_m, block_n, stages, warps, heads_first)
    _attn_fwd[grid](*args, **kwargs, num_warps=warps)
    return out


def compile_offline(block_m, block_n, stages, warps, heads_first=1, sass_out: Path | None = None) -> int:
    """Compile for sm_90 without a GPU (meta tensors for the signature) and report registers,
    spills, shared memory and the order of the key loop's wgmma issues and waits."""
    import triton
    from triton.experimental.gluon._runtime import GluonASTSource

    from rlt_compile.kernels.aot import Launch, _bind, _parse_ptxas_log, _ptxas_rerun, disassemble, gpu_target

    target = gpu_target("cuda", "sm_90")
    q = torch.empty(1, 1024, 16, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 1024, 16, 128, dtype=torch.bfloat16, device="meta")
    out = torch.empty_like(q)
    grid, args, kwargs = _launch_args(q, k, k, out, 128**-0.5, block_m, block_n, stages, warps, heads_first)
    launch = Launch(f"{__name__}._attn_fwd", _attn_fwd, args, {**kwargs, "num_warps": warps}, grid, "probe")
    spec = _bind(launch, target)  # the signature kernel[grid](...) would compile on an sm_90 GPU
    source = GluonASTSource(_attn_fwd, spec.signature, spec.constexprs, spec.attrs)
    kernel = triton.compile(source, target=target, options=dict(spec.options))
    sass = disassemble(kernel.asm["cubin"])
    if sass_out:
        sass_out.write_text(sass)
        sass_out.with_suffix(".ptx").write_text(kernel.asm["ptx"])
        sass_out.with_suffix(".ttgir").write_text(kernel.asm["ttgir"])
    usage = _parse_ptxas_log(_ptxas_rerun(kernel.asm["ptx"], 90), kernel.metadata.name)
    print(
        f"sm_90: {warps} warps, shared {kernel.metadata.shared} B, registers {usage.get('n_regs')}, "
        f"spill stores/loads {usage.get('spill_stores')}/{usage.get('spill_loads')} B"
    )
    for warning in usage.get("perf_warnings", []):
        print("ptxas:", warning)
    ops = []
    for line in sass.splitlines():
        m = re.search(r"\s(HGMMA\.\S+|WARPGROUP\.DEPBAR\S*|WARPGROUP\.ARRIVE|SYNCS\.PHASECHK\S*|MUFU\.EX2)", line)
        if m:
            op = m.group(1).split(".")[0] if m.group(1).startswith(("MUFU", "SYNCS")) else m.group(1)
            if not ops or ops[-1][0] != op:
                ops.append([op, 0])
            ops[-1][1] += 1
    print("wgmma / barrier / exp order:", " ".join(f"{op}x{n}" if n > 1 else op for op, n in ops))
    return 0


def run_gpu(cases, tiles: list[tuple[int, ...]]) -> int:
    """Each case: parity with SDPA (bf16), then the time of each tile config and of SDPA, with the
    attention table's timer (``attention_bench.bench``: median CUDA-graph replay, L2 flushed)."""
    names = [f"m{t[0]} n{t[1]} s{t[2]} w{t[3]}" + ("" if len(t) < 5 else f" h{t[4]}") for t in tiles]
    print("| case | " + " | ".join(f"{name} us (TFLOP/s)" for name in names) + " | SDPA us (TFLOP/s) | best vs SDPA |")
    print("|---|" + "---|" * (len(tiles) + 2))
    worst, device = 0.0, torch.device("cuda")
    for label, batch, seq, heads, kv_heads in cases:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(batch, seq, heads, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(batch, seq, kv_heads, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(batch, seq, kv_heads, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        scale = 128**-0.5
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        gqa = heads != kv_heads

        def sdpa(qt=qt, kt=kt, vt=vt, scale=scale, gqa=gqa):
            return torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa
            )

        ref = sdpa().transpose(1, 2).float()
        flops = 4 * batch * heads * 128 * seq * seq / 2  # causal: half the score matrix
        cells, best = [], float("inf")
        for tile in tiles:
            out = gluon_attention(q, k, v, scale, *tile)
            err = (out.float() - ref).abs().max().item()
            worst = max(worst, err)
            us = 1e3 * bench(
                lambda tile=tile, q=q, k=k, v=v, scale=scale: gluon_attention(q, k, v, scale, *tile), device
            )
            best = min(best, us)
            flag = f" ERR {err:.1e}" if err > 3e-2 else ""
            cells.append(f"{us:.1f} ({flops / us / 1e6:.0f}){flag}")
        t_sdpa = 1e3 * bench(sdpa, device)
        print(f"| {label} | {' | '.join(cells)} | {t_sdpa:.1f} ({flops / t_sdpa / 1e6:.0f}) | {t_sdpa / best:.2f}x |")
    print(f"bf16 max abs error against SDPA, every config: {worst:.2e}")
    return 0 if worst < 3e-2 else 1


CASES = [
    ("Ouro 8 x 1k", 8, 1024, 16, 16),
    ("Ouro 1 x 8k", 1, 8192, 16, 16),
    ("Nanbeige 8 x 1k", 8, 1024, 48, 8),
    ("Nanbeige 1 x 8k", 1, 8192, 48, 8),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 offline, no GPU needed")
    parser.add_argument("--sass", type=Path, default=None, help="--compile-only: write the SASS (and PTX, TTGIR) here")
    parser.add_argument(
        "--tiles",
        default="64,64,3,4,1;64,64,3,4,0",
        help="configs 'block_m,block_n,stages,warps[,heads_first];...' (heads_first: 1 unless 0; "
        "--compile-only: the first)",
    )
    args = parser.parse_args(argv)
    tiles = [tuple(int(x) for x in t.split(",")) for t in args.tiles.split(";") if t.strip()]
    if any(len(t) not in (4, 5) for t in tiles):
        parser.error(f"--tiles takes block_m,block_n,stages,warps[,heads_first] entries, got {args.tiles!r}")
    if args.compile_only:
        return compile_offline(*tiles[0], sass_out=args.sass)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("error: needs a Hopper GPU (or --compile-only)", file=sys.stderr)
        return 2
    return run_gpu(CASES, tiles)


if __name__ == "__main__":
    sys.exit(main())
