"""Probe: causal prefill of fresh sequences (no cached prefix) read from the step's contiguous q/k/v
through TMA tensor descriptors, against SDPA and the paged unified kernel on the same data.

At a fresh prefill every key a query attends to is one of the step's own rows, which lie contiguous
in the k/v projections; a kernel that reads them there (not from the paged cache) can use Hopper's
TMA loads, which the paged gathers cannot. This measures whether that closes the gap to SDPA
(docs/benchmarks.md: the paged kernel is 0.46-0.58x of SDPA at prefill) before any integration::

    python benchmarks/fresh_prefill_probe.py --out FILE        # H200, ~1 minute
    python benchmarks/fresh_prefill_probe.py --smoke           # CPU interpreter, parity only
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _fresh_prefill_kernel(
    q_desc,
    k_desc,
    v_desc,
    out_ptr,
    qsl_ptr,
    num_seqs,
    stride_ot,
    stride_oh,
    scale_log2,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEQ_P: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SEQ_P)
    starts = tl.load(qsl_ptr + offs_s, mask=offs_s <= num_seqs, other=1 << 28)
    seq = tl.sum((starts // BLOCK_M + offs_s <= pid).to(tl.int32), axis=0) - 1
    if seq >= num_seqs:
        return
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    num_tiles = tl.cdiv(q_len, BLOCK_M)
    tile = pid - (q_start // BLOCK_M + seq)
    if tile >= num_tiles:
        return
    tile = num_tiles - 1 - tile  # heaviest first
    m0 = tile * BLOCK_M
    kv_col = (head // GROUP) * HEAD_DIM
    q = q_desc.load([q_start + m0, head * HEAD_DIM])
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(0, m0, BLOCK_N):  # below the diagonal: no mask
        k = k_desc.load([q_start + start, kv_col])
        v = v_desc.load([q_start + start, kv_col])
        m_i, l_i, acc = _tile(q, k, v, m_i, l_i, acc, scale_log2, offs_m, start + offs_n, False)
    for start in range(m0, tl.minimum(m0 + BLOCK_M, q_len), BLOCK_N):  # the diagonal tiles
        k = k_desc.load([q_start + start, kv_col])
        v = v_desc.load([q_start + start, kv_col])
        m_i, l_i, acc = _tile(q, k, v, m_i, l_i, acc, scale_log2, offs_m, start + offs_n, True)
    out = acc / l_i[:, None]
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (q_start + offs_m).to(tl.int64)
    o_ptrs = out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(offs_m < q_len)[:, None])


@triton.jit
def _tile(q, k, v, m_i, l_i, acc, scale_log2, q_pos, k_pos, MASKED: tl.constexpr):
    s = tl.dot(q, tl.trans(k)) * scale_log2
    if MASKED:
        s = tl.where(q_pos[:, None] >= k_pos[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


_KERNEL = {}


def fresh_prefill(q, k, v, qsl, num_seqs, scale, block_m=128, block_n=64, warps=8, stages=3):
    """``q [T, H, D]``, ``k/v [T, Hkv, D]`` contiguous, ``qsl`` the query start offsets (fresh
    sequences: every sequence's keys are its own rows) -> ``out [T, H, D]``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    t, h, d = q.shape
    hkv = k.shape[1]
    interpret = q.device.type == "cpu"
    kernel = _KERNEL.get(interpret)
    if kernel is None:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            kernel = InterpretedFunction(_fresh_prefill_kernel)
        else:
            kernel = triton.JITFunction(_fresh_prefill_kernel)
        _KERNEL[interpret] = kernel
    out = torch.empty_like(q)
    q_desc = TensorDescriptor(q.view(t, h * d), [t, h * d], [h * d, 1], [block_m, d])
    k_desc = TensorDescriptor(k.view(t, hkv * d), [t, hkv * d], [hkv * d, 1], [block_n, d])
    v_desc = TensorDescriptor(v.view(t, hkv * d), [t, hkv * d], [hkv * d, 1], [block_n, d])
    grid = (t // block_m + num_seqs + 1, h)
    from rlt_compile.kernels.triton_attention import _interpreter_scope

    with _interpreter_scope(interpret):
        _launch(
            kernel,
            grid,
            q_desc,
            k_desc,
            v_desc,
            out,
            qsl,
            num_seqs,
            scale,
            h // hkv,
            d,
            block_m,
            block_n,
            warps,
            stages,
        )
    return out


def _launch(kernel, grid, q_desc, k_desc, v_desc, out, qsl, num_seqs, scale, group, d, block_m, block_n, warps, stages):
    kernel[grid](
        q_desc,
        k_desc,
        v_desc,
        out,
        qsl,
        num_seqs,
        out.stride(0),
        out.stride(1),
        scale * 1.4426950408889634,
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SEQ_P=triton.next_power_of_2(num_seqs + 1),
        num_warps=warps,
        num_stages=stages,
    )


def reference(q, k, v, lengths, scale):
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start : start + n].transpose(0, 1).float() for x in (q, k, v))
        rep = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        s = (qs @ ks.transpose(1, 2)) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        outs.append((s.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs).to(q.dtype)


CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 2)]


def probe_case(name, heads, kv_heads, dim, batch, ctx) -> list[str]:
    """Table rows of one causal prefill case: each config of ``CONFIGS`` against SDPA and the paged kernel."""
    from attention_bench import bench, make_paged, paged_attention_triton, sdpa, step_inputs

    device, dtype = torch.device("cuda"), torch.bfloat16
    qp, cache, tables, seq_lens, qsl, q_s, k_s, v_s = make_paged(batch, ctx, ctx, heads, kv_heads, dim, dtype, device)
    _, k, v = step_inputs(cache, tables, torch.arange(ctx, device=device))
    scale = dim**-0.5
    flops = batch * 2.0 * ctx * ctx * heads * dim
    ref = sdpa(q_s, k_s, v_s, scale, True).transpose(1, 2).reshape_as(qp)
    t_sdpa = bench(lambda: sdpa(q_s, k_s, v_s, scale, True), device)
    t_paged = bench(lambda: paged_attention_triton(qp, cache, tables, seq_lens, qsl, scale), device)
    lines = []
    for bm, bn, w, s in CONFIGS:
        label = f"m{bm} n{bn} w{w} s{s}"
        try:
            out = fresh_prefill(qp, k, v, qsl, batch, scale, bm, bn, w, s)
            err = (out.float() - ref.float()).abs().max().item()
            t = bench(lambda bm=bm, bn=bn, w=w, s=s: fresh_prefill(qp, k, v, qsl, batch, scale, bm, bn, w, s), device)
        except Exception as exc:
            print(f"{name} {batch}x{ctx} {label}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        line = (
            f"| {name} {batch} x {ctx} | {label} | {t * 1e3:.0f} | {flops / (t * 1e-3) / 1e12:.0f} | "
            f"{t_paged * 1e3:.0f} | {t_sdpa * 1e3:.0f} | {t_sdpa / t:.2f}x | {err:.1e} |"
        )
        print(line, flush=True)
        lines.append(line)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        for heads, kv_heads, lengths in ((4, 4, [40, 17, 64]), (6, 2, [33, 80])):
            gen = torch.Generator().manual_seed(heads)
            t = sum(lengths)
            q, k, v = (torch.randn(t, n, 16, generator=gen) for n in (heads, kv_heads, kv_heads))
            qsl = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            out = fresh_prefill(q, k, v, qsl, len(lengths), 0.25, block_m=32, block_n=16, warps=4, stages=1)
            err = (out - reference(q, k, v, lengths, 0.25)).abs().max().item()
            print(f"heads {heads}/{kv_heads} lengths {lengths}: max abs err {err:.2e}")
            assert err < 1e-4
        return 0

    from attention_bench import MODELS

    lines = [
        "| case | config | fresh TMA us | TFLOP/s | paged kernel us | SDPA us | fresh / SDPA | max err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, dims in MODELS.items():
        for batch, ctx in ((8, 1024), (1, 8192)):
            lines += probe_case(name, *dims, batch, ctx)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
