"""Attention kernel benchmark: Triton paged attention vs torch SDPA on the same KV made contiguous.

Decode: GB/s of KV bytes read (K and V of every context token, once) and that as a % of the
device-to-device copy bandwidth measured in the same run (copy bandwidth = 2 x bytes / time, read
plus write). Prefill: causal attention TFLOP/s (2 x S^2 x H x D FLOPs per sequence: two matmuls,
half of them masked). bf16, block size 16, medians of ``triton.testing.do_bench``. The SDPA
baseline gets K/V already gathered into contiguous [B, Hkv, S, D] tensors (the gather is not
timed), so it is an upper bound for a non-paged kernel.

    python benchmarks/attention_bench.py --out attention.md          # GPU, < 2 minutes
    python benchmarks/attention_bench.py --smoke                     # tiny shapes, runs on CPU too
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rlt_compile.kernels.triton_attention import paged_attention_triton  # noqa: E402

MODELS = {  # name -> (q heads, kv heads, head dim)
    "Ouro MHA 16x128": (16, 16, 128),
    "Nanbeige GQA 48/8x128": (48, 8, 128),
}
BLOCK_SIZE = 16


def bench(fn, device: torch.device) -> float:
    """Median milliseconds."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[1]


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def make_paged(batch, ctx, q_len, heads, kv_heads, dim, dtype, device, seed=0):
    """A paged cache holding ``batch`` sequences of ``ctx`` tokens in shuffled blocks, queries for the
    last ``q_len`` positions of each, and the same K/V gathered contiguous for SDPA."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm.view(batch, blocks_per_seq).to(device=device, dtype=torch.int32)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, dim, dtype=dtype, device=device)
    q = torch.randn(batch * q_len, heads, dim, dtype=dtype, device=device)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * q_len
    idx = tables.long()
    k = cache[0][idx].reshape(batch, blocks_per_seq * BLOCK_SIZE, kv_heads, dim)[:, :ctx].transpose(1, 2).contiguous()
    v = cache[1][idx].reshape(batch, blocks_per_seq * BLOCK_SIZE, kv_heads, dim)[:, :ctx].transpose(1, 2).contiguous()
    q_sdpa = q.view(batch, q_len, heads, dim).transpose(1, 2).contiguous()
    return q, cache, tables, seq_lens, qsl, q_sdpa, k, v


def sdpa(q, k, v, scale, causal):
    if q.shape[1] != k.shape[1]:
        try:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal, enable_gqa=True)
        except TypeError:  # torch < 2.5
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal)


def decode_rows(device, dtype, batches, contexts, copy_gbps):
    rows = []
    for name, (heads, kv_heads, dim) in MODELS.items():
        for ctx in contexts:
            for batch in batches:
                q, cache, tables, seq_lens, qsl, q_s, k_s, v_s = make_paged(
                    batch, ctx, 1, heads, kv_heads, dim, dtype, device
                )
                scale = dim**-0.5
                kv_bytes = 2 * batch * ctx * kv_heads * dim * cache.element_size()

                def run_triton(split=None, q=q, cache=cache, tables=tables, seq_lens=seq_lens, qsl=qsl, scale=scale):
                    return paged_attention_triton(q, cache, tables, seq_lens, qsl, scale, split_k=split)

                out = run_triton()
                ref = sdpa(q_s, k_s, v_s, scale, False).transpose(1, 2).reshape_as(out)
                err = (out.float() - ref.float()).abs().max().item()
                t_auto = bench(run_triton, device)
                t_nosplit = bench(lambda: run_triton(False), device)
                t_sdpa = bench(lambda q_s=q_s, k_s=k_s, v_s=v_s, scale=scale: sdpa(q_s, k_s, v_s, scale, False), device)
                gbps = kv_bytes / (t_auto * 1e-3) / 1e9
                rows.append(
                    [
                        name,
                        batch,
                        ctx,
                        f"{t_auto * 1e3:.1f}",
                        f"{gbps:.0f}",
                        f"{100 * gbps / copy_gbps:.0f}%",
                        f"{kv_bytes / (t_nosplit * 1e-3) / 1e9:.0f}",
                        f"{t_sdpa * 1e3:.1f}",
                        f"{kv_bytes / (t_sdpa * 1e-3) / 1e9:.0f}",
                        f"{t_sdpa / t_auto:.2f}x",
                        f"{err:.1e}",
                    ]
                )
                print(" | ".join(str(c) for c in rows[-1]), flush=True)
                del q, cache, tables, seq_lens, qsl, q_s, k_s, v_s, out, ref
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def prefill_rows(device, dtype, shapes):
    rows = []
    for name, (heads, kv_heads, dim) in MODELS.items():
        for batch, ctx in shapes:
            q, cache, tables, seq_lens, qsl, q_s, k_s, v_s = make_paged(
                batch, ctx, ctx, heads, kv_heads, dim, dtype, device
            )
            scale = dim**-0.5
            flops = batch * 2.0 * ctx * ctx * heads * dim  # causal: half of 4*S^2*H*D

            def run_triton(q=q, cache=cache, tables=tables, seq_lens=seq_lens, qsl=qsl, scale=scale):
                return paged_attention_triton(q, cache, tables, seq_lens, qsl, scale)

            out = run_triton()
            ref = sdpa(q_s, k_s, v_s, scale, True).transpose(1, 2).reshape_as(out)
            err = (out.float() - ref.float()).abs().max().item()
            t_tri = bench(run_triton, device)
            t_sdpa = bench(lambda q_s=q_s, k_s=k_s, v_s=v_s, scale=scale: sdpa(q_s, k_s, v_s, scale, True), device)
            rows.append(
                [
                    name,
                    batch,
                    ctx,
                    f"{t_tri * 1e3:.0f}",
                    f"{flops / (t_tri * 1e-3) / 1e12:.1f}",
                    f"{t_sdpa * 1e3:.0f}",
                    f"{flops / (t_sdpa * 1e-3) / 1e12:.1f}",
                    f"{t_sdpa / t_tri:.2f}x",
                    f"{err:.1e}",
                ]
            )
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
            del q, cache, tables, seq_lens, qsl, q_s, k_s, v_s, out, ref
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton interpreter, fp32)")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        global MODELS
        MODELS = {"tiny MHA 2x16": (2, 2, 16), "tiny GQA 4/2x16": (4, 2, 16)}
        batches, contexts, prefill, copy_bytes = [1, 2], [40], [(2, 32)], 1 << 20
    else:
        if device.type != "cuda":
            print("attention_bench: needs a GPU (use --smoke for a CPU check)", file=sys.stderr)
            return 2
        batches, contexts, prefill, copy_bytes = [1, 32, 128], [1024, 8192], [(8, 1024), (1, 8192)], 1 << 30
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.time()
    copy_gbps = copy_bandwidth(device, copy_bytes)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    print(f"# attention benchmark: {name}, {dtype}, block {BLOCK_SIZE}; d2d copy {copy_gbps:.0f} GB/s", flush=True)

    dec = decode_rows(device, dtype, batches, contexts, copy_gbps)
    pre = prefill_rows(device, dtype, prefill)
    report = [
        f"# Attention kernels: {name}",
        "",
        f"torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, KV block size {BLOCK_SIZE}, "
        f"medians of triton.testing.do_bench. Device-to-device copy bandwidth (same run): {copy_gbps:.0f} GB/s.",
        "",
        "## Decode (one query per sequence): KV bytes read per second",
        "",
        table(
            [
                "model",
                "batch",
                "context",
                "triton us",
                "triton GB/s",
                "% of copy BW",
                "no-split GB/s",
                "SDPA us",
                "SDPA GB/s",
                "speedup vs SDPA",
                "max abs err",
            ],
            dec,
        ),
        "",
        "## Prefill (causal, whole sequence): TFLOP/s",
        "",
        table(
            [
                "model",
                "seqs",
                "length",
                "triton us",
                "triton TFLOP/s",
                "SDPA us",
                "SDPA TFLOP/s",
                "speedup",
                "max abs err",
            ],
            pre,
        ),
        "",
        f"Total benchmark time {time.time() - start:.0f} s. SDPA reads K/V pre-gathered into contiguous tensors "
        "(gather not timed); triton reads the paged cache through shuffled block tables.",
        "",
    ]
    text = "\n".join(report)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
