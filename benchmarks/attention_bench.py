"""Attention kernel benchmark: Triton paged attention vs torch SDPA on the same KV made contiguous.

Decode: GB/s of KV bytes read (K and V of every context token, once) and that as a % of the
device-to-device copy bandwidth measured in the same run (copy bandwidth = 2 x bytes / time, read
plus write). Prefill: causal attention TFLOP/s (2 x S^2 x H x D FLOPs per sequence: two matmuls,
half of them masked). bf16, block size 16. The SDPA baseline gets K/V already gathered into
contiguous [B, Hkv, S, D] tensors (the gather is not timed), so it is an upper bound for a
non-paged kernel; the "gather + SDPA" columns time the gather out of the paged cache with it, what a
paged runtime without its own attention kernel runs each step.

Timing (``--timer graph``, the default on CUDA): every call is captured once in a CUDA graph (as the
engine runs it) and the median of 50 replays is taken, each after a flush of the L2 that keeps the
GPU busy while the CPU enqueues the replay, so neither the Python launcher's host time nor an
L2-warm KV read is measured. ``--flush read`` (the default) reads 256 MiB, leaving the L2 full of
clean lines, as a decode step's preceding GEMVs do; ``--flush write`` (the default until session 17)
zeroes 128 MiB, leaving dirty lines that the timed call must write back as it reads (on the H200 up
to ~8 us more for a decode call reading tens of MB: docs/benchmarks.md, session 17). The copy
bandwidth is timed after the same flush.
``--timer do_bench``: ``triton.testing.do_bench`` medians (includes host launch time where the
kernel is shorter than it).

``--sweep``: for each decode case (Ouro MHA 16x128 and Nanbeige GQA 48/8x128, batch 1/32/128 x
context 128/1024/8192) time the op's whole decode call (KV write + attention, what
``rlt::attention_triton`` runs) for a small set of launcher configs (``config=`` of
``attention_forward``: the old unified kernel, the decode kernel's default and one-knob variations of
it), check each against SDPA (max abs err), and print the best per case next to the default.

``--extra "key=int,key=int;key=int"`` adds launcher configs to the decode sweep; ``--cases
32x1024,16x1024`` gives the decode sweep's (batch, context) cases (any, not only the grid above) and
limits the decode table to those among its own. ``--head-major`` stores the cache as ``[2, blocks,
Hkv, block_size, D]`` seen through the usual ``[2, blocks, block_size, Hkv, D]`` view;
``--block-size`` sets the cache's block size (16 by default) and ``--ordered-blocks`` lays each
sequence's blocks out consecutively instead of shuffled (how much DRAM locality the paging costs).

``--prefill-sweep``: for each causal prefill case (the two models, 8 x 1k and 1 x 8k) time the
unified kernel over a grid of tiles (``block_m`` x ``block_n`` x ``warps`` x ``stages``, the kernel's
default row layout and masking), then the kernel options (``mask_split`` off, ``reverse_tiles``,
``pad_group``) on the three fastest tiles, with TFLOP/s, SDPA's TFLOP/s on the same data and the max
abs error vs SDPA; combos that fail to compile or to fit in shared memory are printed and skipped.
On a GPU every round's kernels are first compiled in parallel worker processes (into Triton's disk
cache; ``--compile-jobs``), so the sweep's time is mostly the timing itself.

    python benchmarks/attention_bench.py --out attention.md                            # GPU, < 2 minutes
    python benchmarks/attention_bench.py --sweep --out attention.md                    # GPU, < 3 minutes
    python benchmarks/attention_bench.py --prefill-sweep --no-table --out prefill.md   # GPU, < 4 minutes
    python benchmarks/attention_bench.py --smoke [--sweep] [--prefill-sweep]           # tiny shapes, CPU too
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rlt_compile import envs  # noqa: E402
from rlt_compile.kernels import triton_attention as ta  # noqa: E402
from rlt_compile.kernels.triton_attention import attention_forward, paged_attention_triton  # noqa: E402

MODELS = {  # name -> (q heads, kv heads, head dim)
    "Ouro MHA 16x128": (16, 16, 128),
    "Nanbeige GQA 48/8x128": (48, 8, 128),
}
BLOCK_SIZE = 16  # --block-size
ORDERED_BLOCKS = False  # --ordered-blocks: each sequence's blocks consecutive in memory, not shuffled
HEAD_MAJOR = False  # --head-major: the cache's storage [2, blocks, Hkv, block_size, D]
EXTRA: list[tuple[str, dict]] = []  # --extra: more sweep candidates
CASES: set[tuple[int, int]] = set()  # --cases: only these (batch, context) sweep cases


TIMER = "graph"
FLUSH = "read"  # --flush: how bench_graph empties the L2 before each replay
_FLUSH: dict[str, torch.Tensor] = {}


def flush_l2(device: torch.device) -> None:
    """Evict the L2: ``FLUSH == "write"`` zeroes 128 MiB (dirty lines left behind), ``"read"`` sums 256 MiB
    (clean lines left behind)."""
    buf = _FLUSH.get(FLUSH)
    if buf is None:
        size = 128 << 20 if FLUSH == "write" else 256 << 20
        buf = _FLUSH[FLUSH] = torch.ones(size // 4, dtype=torch.int32, device=device)
    if FLUSH == "write":
        buf.zero_()
    else:
        buf.sum(dtype=torch.int64)


def bench_graph(fn, device: torch.device, reps: int = 50) -> float:
    """Median milliseconds of one CUDA-graph replay of ``fn`` (L2 flushed before each replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    graph.replay()
    for i in range(reps):
        flush_l2(device)
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    del graph
    return times[len(times) // 2]


def bench(fn, device: torch.device, reps: int = 50) -> float:
    """Median milliseconds."""
    if device.type == "cuda":
        if TIMER == "graph":
            return bench_graph(fn, device, reps)
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=4 * reps // 5, return_mode="median")
    fn()
    times = []
    for _ in range(3 if reps >= 3 else 1):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[1]


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":  # plain event timing (a 1 GiB copy inside a CUDA graph runs slower), same flush
        dst.copy_(src)
        times = []
        for _ in range(20):
            flush_l2(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ms = sorted(times)[len(times) // 2]
    else:
        ms = bench(lambda: dst.copy_(src), device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def make_paged(batch, ctx, q_len, heads, kv_heads, dim, dtype, device, seed=0):
    """A paged cache holding ``batch`` sequences of ``ctx`` tokens in shuffled blocks, queries for the
    last ``q_len`` positions of each, and the same K/V gathered contiguous for SDPA."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    perm = torch.arange(num_blocks) if ORDERED_BLOCKS else torch.randperm(num_blocks, generator=gen)
    tables = perm.view(batch, blocks_per_seq).to(device=device, dtype=torch.int32)
    if HEAD_MAJOR:  # each (block, KV head)'s rows contiguous in memory; the same [2, blocks, bs, Hkv, D] view
        cache = torch.randn(2, num_blocks, kv_heads, BLOCK_SIZE, dim, dtype=dtype, device=device).transpose(2, 3)
    else:
        cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, dim, dtype=dtype, device=device)
    q = torch.randn(batch * q_len, heads, dim, dtype=dtype, device=device)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * q_len
    idx = tables.long()
    k = cache[0][idx].reshape(batch, blocks_per_seq * BLOCK_SIZE, kv_heads, dim)[:, :ctx].transpose(1, 2).contiguous()
    v = cache[1][idx].reshape(batch, blocks_per_seq * BLOCK_SIZE, kv_heads, dim)[:, :ctx].transpose(1, 2).contiguous()
    q_sdpa = q.view(batch, q_len, heads, dim).transpose(1, 2).contiguous()
    return q, cache, tables, seq_lens, qsl, q_sdpa, k, v


def step_inputs(cache, tables, pos: torch.Tensor):
    """slot_mapping and this step's k/v rows for every sequence's positions ``pos`` (sequence-major):
    the rows already in the cache there, so the (fused) KV write leaves the cache and the SDPA
    reference unchanged."""
    slots = (tables[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1).contiguous()
    block, offset = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    return slots, cache[0][block, offset].clone(), cache[1][block, offset].clone()


def decode_step_inputs(cache, tables, ctx):
    """``step_inputs`` of a decode batch whose token sits at position ctx - 1."""
    return step_inputs(cache, tables, torch.tensor([ctx - 1], device=cache.device))


try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION)
except ImportError:  # older torch
    SDPA_BACKENDS = ()
    sdpa_kernel = None


def sdpa(q, k, v, scale, causal):
    if q.shape[1] != k.shape[1]:
        try:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal, enable_gqa=True)
        except TypeError:  # torch < 2.5
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal)


def gathered_sdpa(q, cache, tables, ctx, scale, causal):
    """SDPA on K/V gathered out of the paged cache in the same call: what a paged runtime without its
    own attention kernel runs each step (the gather timed with it)."""
    batch, blocks = tables.shape
    idx = tables.long()
    k, v = (
        cache[i][idx].reshape(batch, blocks * BLOCK_SIZE, *cache.shape[-2:])[:, :ctx].transpose(1, 2) for i in (0, 1)
    )
    return sdpa(q, k, v, scale, causal)


def decode_rows(device, dtype, batches, contexts, copy_gbps):
    rows = []
    for name, (heads, kv_heads, dim) in MODELS.items():
        for ctx in contexts:
            for batch in batches:
                if CASES and (batch, ctx) not in CASES:
                    continue
                q, cache, tables, seq_lens, qsl, q_s, k_s, v_s = make_paged(
                    batch, ctx, 1, heads, kv_heads, dim, dtype, device
                )
                scale = dim**-0.5
                kv_bytes = 2 * batch * ctx * kv_heads * dim * cache.element_size()

                def run_triton(
                    split=None, config=None, q=q, cache=cache, tables=tables, seq_lens=seq_lens, qsl=qsl, scale=scale
                ):
                    return paged_attention_triton(q, cache, tables, seq_lens, qsl, scale, split_k=split, config=config)

                out = run_triton()
                ref = sdpa(q_s, k_s, v_s, scale, False).transpose(1, 2).reshape_as(out)
                err = (out.float() - ref.float()).abs().max().item()
                t_auto = bench(run_triton, device)
                t_nosplit = bench(lambda: run_triton(False), device)
                old = {"decode": False}
                t_old = bench(lambda old=old: run_triton(config=old), device)
                err = max(err, (run_triton(False).float() - ref.float()).abs().max().item())
                err = max(err, (run_triton(config=old).float() - ref.float()).abs().max().item())
                t_sdpa = bench(lambda q_s=q_s, k_s=k_s, v_s=v_s, scale=scale: sdpa(q_s, k_s, v_s, scale, False), device)

                def run_gathered(q_s=q_s, cache=cache, tables=tables, ctx=ctx, scale=scale):
                    return gathered_sdpa(q_s, cache, tables, ctx, scale, False)

                err = max(
                    err, (run_gathered().transpose(1, 2).reshape_as(out).float() - ref.float()).abs().max().item()
                )
                t_gathered = bench(run_gathered, device)
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
                        f"{t_old * 1e3:.1f}",
                        f"{t_sdpa * 1e3:.1f}",
                        f"{kv_bytes / (t_sdpa * 1e-3) / 1e9:.0f}",
                        f"{t_sdpa / t_auto:.2f}x",
                        f"{t_gathered * 1e3:.1f}",
                        f"{t_gathered / t_auto:.2f}x",
                        f"{err:.1e}",
                    ]
                )
                print(" | ".join(str(c) for c in rows[-1]), flush=True)
                del q, cache, tables, seq_lens, qsl, q_s, k_s, v_s, out, ref
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


SWEEP_BATCHES, SWEEP_CONTEXTS = (1, 32, 128), (128, 1024, 8192)


def sweep_candidates(group: int, batch: int, ctx: int, kv_heads: int, num_sms: int) -> list[tuple[str, dict]]:
    """A small set of launcher configs around the default (one knob at a time)."""
    table_blocks = -(-ctx // BLOCK_SIZE)
    # the launcher's own bf16 defaults for these heads (tile, waves, whether the merge is fused)
    tiles = ta._decode_tile_config(
        False, 1 << (group - 1).bit_length(), 128, torch.bfloat16, {}, batch * kv_heads, num_sms
    )
    auto = ta.choose_decode_splits(
        batch, kv_heads, table_blocks, BLOCK_SIZE, tiles["block_n"], num_sms, tiles["waves"],
        cap_to_table=not tiles["fuse_reduce"],
    )  # fmt: skip
    cands = [
        ("old: write + unified", {"decode": False}),
        ("default", {}),
        ("default, write kernel", {"fuse_write": False}),
    ]
    splits = {1, max(1, auto // 2), auto * 2}
    max_splits = min(64, table_blocks)  # at least one KV block per split
    cands += [(f"splits={n}", {"splits": n}) for n in sorted(splits) if n != auto and n <= max_splits]
    for n in (32, 16 if ctx <= 1024 else 128):
        cands.append((f"block_n={n}", {"block_n": n}))
    cands.append(("waves=4", {"waves": 4}))
    cands.append(("warps=8" if group > 1 else "warps=2", {"warps": 8 if group > 1 else 2}))
    cands.append(("stages=3" if group > 1 else "stages=1", {"stages": 3 if group > 1 else 1}))
    cands.append(("no table prefetch", {"prefetch": False}))
    # the split merge the other way round
    cands.append(
        ("split reduce kernel", {"fuse_reduce": False})
        if tiles["fuse_reduce"]
        else ("fused merge", {"fuse_reduce": True})
    )
    if group > 1:
        # one stage: a third of the shared memory, so all programs of a 2-split grid fit in one wave
        cands.append(("stages=1", {"stages": 1}))
        cands.append((f"stages=1, splits={auto * 2}", {"stages": 1, "splits": auto * 2}))
        cands.append(("stages=1, block_n=128", {"stages": 1, "block_n": 128}))
    cands.append(("metadata after the PDL wait", {"early_reads": False}))
    cands += EXTRA
    if group == 1:
        cands.append(("multiply + sum (no tl.dot)", {"use_dot": False}))
        cands.append(("tl.dot 16-row tile", {"use_dot": True}))
        cands.append(("tl.dot 16-row tile, warps=8", {"use_dot": True, "warps": 8}))
        cands.append((f"tl.dot 16-row tile, splits={auto * 2}", {"use_dot": True, "splits": auto * 2}))
        cands.append(("stages=3", {"stages": 3}))
    seen, out = set(), []
    for name, cfg in cands:
        key = tuple(sorted(cfg.items()))
        if key not in seen:
            seen.add(key)
            out.append((name, cfg))
    return out


def sweep_rows(device, dtype, batches, contexts):
    """Per decode case: every candidate config's time (whole op: KV write + attention) and error."""
    num_sms = ta.sm_count(device)
    rows, detail = [], []
    for name, (heads, kv_heads, dim) in MODELS.items():
        for ctx in contexts:
            for batch in batches:
                if CASES and (batch, ctx) not in CASES:
                    continue
                q, cache, tables, seq_lens, qsl, q_s, k_s, v_s = make_paged(
                    batch, ctx, 1, heads, kv_heads, dim, dtype, device
                )
                slots, k_new, v_new = decode_step_inputs(cache, tables, ctx)
                scale = dim**-0.5
                ref = sdpa(q_s, k_s, v_s, scale, False).transpose(1, 2).reshape_as(q).float()
                t_sdpa = bench(lambda q_s=q_s, k_s=k_s, v_s=v_s, scale=scale: sdpa(q_s, k_s, v_s, scale, False), device)
                results = []
                for cname, cfg in sweep_candidates(heads // kv_heads, batch, ctx, kv_heads, num_sms):

                    def run(
                        cfg=cfg,
                        q=q,
                        k=k_new,
                        v=v_new,
                        cache=cache,
                        slots=slots,
                        tables=tables,
                        sl=seq_lens,
                        qsl=qsl,
                        scale=scale,
                    ):
                        return attention_forward(q, k, v, cache, slots, tables, sl, qsl, scale, config=cfg)

                    try:
                        err = (run().float() - ref).abs().max().item()
                        ms = bench(run, device)
                    except Exception as exc:  # a variant that does not compile / fit is reported, not fatal
                        print(f"  {name} b{batch} ctx{ctx} {cname}: FAILED {type(exc).__name__}: {exc}", flush=True)
                        continue
                    results.append((ms, cname, err))
                    detail.append([name, batch, ctx, cname, f"{ms * 1e3:.1f}", f"{err:.1e}"])
                    flag = "  <-- ERROR" if err > 5e-2 else ""
                    print(f"  {name} b{batch} ctx{ctx} {cname:24s} {ms * 1e3:8.1f} us  err {err:.1e}{flag}", flush=True)
                by_name = {c: (ms, err) for ms, c, err in results}
                best_ms, best_name, best_err = min(r for r in results if r[2] <= 5e-2)
                d_ms = by_name["default"][0]
                old_ms = by_name["old: write + unified"][0]
                kv_bytes = 2 * batch * ctx * kv_heads * dim * cache.element_size()
                rows.append(
                    [
                        name,
                        batch,
                        ctx,
                        f"{d_ms * 1e3:.1f}",
                        f"{kv_bytes / (d_ms * 1e-3) / 1e9:.0f}",
                        best_name,
                        f"{best_ms * 1e3:.1f}",
                        f"{d_ms / best_ms:.2f}x",
                        f"{old_ms * 1e3:.1f}",
                        f"{t_sdpa * 1e3:.1f}",
                        f"{max(e for _, _, e in results):.1e}",
                    ]
                )
                print(" | ".join(str(c) for c in rows[-1]), flush=True)
                del q, cache, tables, seq_lens, qsl, q_s, k_s, v_s, ref, k_new, v_new, slots
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows, detail


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

            # The op's whole prefill call (rlt::attention_triton): KV write of the step's rows (the
            # rows already cached there, so the cache stays as SDPA sees it), then the paged kernel.
            slots, k_new, v_new = step_inputs(cache, tables, torch.arange(ctx, device=cache.device))

            def run_op(q=q, k=k_new, v=v_new, cache=cache, slots=slots, tables=tables, sl=seq_lens, qsl=qsl,
                       scale=scale):  # fmt: skip
                return attention_forward(q, k, v, cache, slots, tables, sl, qsl, scale)

            out = run_triton()
            ref = sdpa(q_s, k_s, v_s, scale, True).transpose(1, 2).reshape_as(out)
            err = (out.float() - ref.float()).abs().max().item()
            t_tri = bench(run_triton, device)

            def run_sdpa(q_s=q_s, k_s=k_s, v_s=v_s, scale=scale):
                return sdpa(q_s, k_s, v_s, scale, True)

            t_sdpa = bench(run_sdpa, device)

            def run_gathered(q_s=q_s, cache=cache, tables=tables, ctx=ctx, scale=scale):
                return gathered_sdpa(q_s, cache, tables, ctx, scale, True)

            err = max(err, (run_gathered().transpose(1, 2).reshape_as(out).float() - ref.float()).abs().max().item())
            t_gathered = bench(run_gathered, device)
            row = [name, batch, ctx, f"{t_tri * 1e3:.0f}", f"{flops / (t_tri * 1e-3) / 1e12:.1f}"]
            t_op = bench(run_op, device)  # the op: KV write + the paged kernel
            err = max(err, (run_op().float() - ref.float()).abs().max().item())
            row += [f"{t_op * 1e3:.0f}", f"{flops / (t_op * 1e-3) / 1e12:.1f}"]
            for backend in SDPA_BACKENDS:
                try:
                    with sdpa_kernel(backend):
                        t = bench(run_sdpa, device)
                    row.append(f"{t * 1e3:.0f}")
                except Exception as exc:
                    print(f"SDPA {backend}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    row.append("failed")
            row += [
                f"{t_sdpa * 1e3:.0f}",
                f"{flops / (t_sdpa * 1e-3) / 1e12:.1f}",
                f"{t_sdpa / t_tri:.2f}x",
                f"{t_sdpa / t_op:.2f}x",
                f"{t_gathered * 1e3:.0f}",
                f"{t_gathered / t_op:.2f}x",
                f"{err:.1e}",
            ]
            rows.append(row)
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
            del q, cache, tables, seq_lens, qsl, q_s, k_s, v_s, out, ref
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


PREFILL_TILES = {  # the tile grid of --prefill-sweep
    "block_m": (64, 128),
    "block_n": (32, 64, 128),
    "warps": (4, 8),
    "stages": (2, 3, 4),
}
SMOKE_PREFILL_TILES = {"block_m": (16, 32), "block_n": (16, 32), "warps": (4,), "stages": (1, 2)}
# Kernel options tried on the fastest tiles (each one toggled from the kernel default).
PREFILL_OPTIONS = ({"mask_split": False}, {"reverse_tiles": True}, {"pad_group": True})
PREFILL_SWEEP_REPS = 10
PREFILL_TOP_TILES = 3
MAX_ERR = 5e-2  # bf16 prefill is ~1e-2 vs SDPA; a config far beyond that is broken, not "fast"


def config_name(cfg: dict) -> str:
    if not cfg:
        return "default"
    tile = ("block_m", "block_n", "warps", "stages")
    short = {"block_m": "m", "block_n": "n", "warps": "w", "stages": "s"}
    parts = [f"{short[k]}{cfg[k]}" for k in tile if k in cfg]
    parts += [f"{k}={v}" for k, v in cfg.items() if k not in tile]
    return " ".join(parts)


def prefill_cases(shapes):
    """(model name, heads, kv heads, dim, batch, length) of every prefill sweep case."""
    return [(name, *dims, batch, ctx) for name, dims in MODELS.items() for batch, ctx in shapes]


def prefill_inputs(case, dtype, device):
    _, heads, kv_heads, dim, batch, ctx = case
    return make_paged(batch, ctx, ctx, heads, kv_heads, dim, dtype, device)


@contextlib.contextmanager
def _compile_only():
    """Kernel launches compile (into Triton's in-memory and disk caches) but do not run."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        return original(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = original


def _compile_worker(jobs, dtype_name: str) -> int:
    """Process-pool worker: compile the launches of ``jobs`` ([(case, config)]) without running them.
    The same launcher and tensors as the timing process, so Triton's cache keys match there."""
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda")
    inputs, failed = {}, 0
    with _compile_only():
        for case, cfg in jobs:
            if case not in inputs:
                inputs[case] = prefill_inputs(case, dtype, device)
            q, cache, tables, seq_lens, qsl = inputs[case][:5]
            try:
                paged_attention_triton(q, cache, tables, seq_lens, qsl, case[3] ** -0.5, config=cfg)
            except Exception:  # reported by the timing process, which compiles it again
                failed += 1
    return failed


def precompile(jobs, dtype, workers: int) -> None:
    """Compile ``jobs`` in ``workers`` spawned processes (best effort: whatever fails here is
    compiled, or reported, by the timing loop itself)."""
    if workers <= 1 or not jobs:
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    start = time.time()
    workers = min(workers, len(jobs))
    chunks = [jobs[i::workers] for i in range(workers)]
    dtype_name = str(dtype).removeprefix("torch.")
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            failed = sum(pool.map(_compile_worker, chunks, [dtype_name] * workers))
    except Exception as exc:  # no pool (e.g. a sandbox): compile in the timing loop instead
        print(f"  precompile failed ({type(exc).__name__}: {exc}); compiling serially", flush=True)
        return
    print(f"  precompiled {len(jobs)} launches in {time.time() - start:.0f} s ({failed} failed)", flush=True)


def prefill_sweep_rows(device, dtype, shapes, tiles, compile_jobs):
    """Per causal prefill case: TFLOP/s of the tile grid, then of the options on the best tiles."""
    cases = prefill_cases(shapes)
    grid = [dict(zip(tiles, values)) for values in itertools.product(*tiles.values())]
    base = [{}, {"mask_split": False, "pad_group": True}, *grid]  # default, the old kernel's layout, tiles
    results = {case: [] for case in cases}
    rows, detail = [], []

    def time_round(round_cfgs):
        if device.type == "cuda":
            precompile([(c, cfg) for c in cases for cfg in round_cfgs[c]], dtype, compile_jobs)
        for case in cases:
            name, heads, kv_heads, dim, batch, ctx = case
            q, cache, tables, seq_lens, qsl, q_s, k_s, v_s = prefill_inputs(case, dtype, device)
            scale = dim**-0.5
            ref = sdpa(q_s, k_s, v_s, scale, True).transpose(1, 2).reshape_as(q).float()
            del q_s, k_s, v_s
            for cfg in round_cfgs[case]:

                def run(cfg=cfg, q=q, cache=cache, tables=tables, seq_lens=seq_lens, qsl=qsl, scale=scale):
                    return paged_attention_triton(q, cache, tables, seq_lens, qsl, scale, config=cfg)

                label = f"{name} {batch}x{ctx} {config_name(cfg)}"
                try:
                    err = (run().float() - ref).abs().max().item()
                    ms = bench(run, device, PREFILL_SWEEP_REPS)
                except Exception as exc:  # does not compile / fit in shared memory: reported, not fatal
                    print(f"  {label}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
                    continue
                tflops = batch * 2.0 * ctx * ctx * heads * dim / (ms * 1e-3) / 1e12
                results[case].append((tflops, cfg, err))
                flag = "  <-- ERROR" if err > MAX_ERR else ""
                print(f"  {label:56s} {ms * 1e3:9.1f} us {tflops:7.1f} TFLOP/s  err {err:.1e}{flag}", flush=True)
                detail.append([name, batch, ctx, config_name(cfg), f"{ms * 1e3:.1f}", f"{tflops:.1f}", f"{err:.1e}"])
            del q, cache, tables, seq_lens, qsl, ref
            if device.type == "cuda":
                torch.cuda.empty_cache()

    time_round({case: base for case in cases})
    options = {}
    for case in cases:
        ok = sorted((r for r in results[case] if r[2] <= MAX_ERR and r[1] in grid), key=lambda r: -r[0])
        group = case[1] // case[2]
        options[case] = [
            {**cfg, **opt}
            for _, cfg, _ in ok[:PREFILL_TOP_TILES]
            for opt in PREFILL_OPTIONS
            if group > 1 or "pad_group" not in opt
        ]
    time_round(options)

    for case in cases:
        name, heads, kv_heads, dim, batch, ctx = case
        q, cache, tables, seq_lens, qsl, q_s, k_s, v_s = prefill_inputs(case, dtype, device)
        t_sdpa = bench(lambda q_s=q_s, k_s=k_s, v_s=v_s, s=dim**-0.5: sdpa(q_s, k_s, v_s, s, True), device)
        del q, cache, tables, seq_lens, qsl, q_s, k_s, v_s
        sdpa_tflops = batch * 2.0 * ctx * ctx * heads * dim / (t_sdpa * 1e-3) / 1e12
        by_name = {config_name(cfg): tflops for tflops, cfg, _ in results[case]}
        ok = [r for r in results[case] if r[2] <= MAX_ERR]
        if not ok:
            rows.append([name, batch, ctx, "-", "-", "no config ran", "-", f"{sdpa_tflops:.1f}", "-", "-"])
            continue
        best_tflops, best_cfg, _ = max(ok, key=lambda r: r[0])
        default = by_name.get("default")
        old = by_name.get(config_name({"mask_split": False, "pad_group": True}))
        rows.append(
            [
                name,
                batch,
                ctx,
                "-" if old is None else f"{old:.1f}",
                "-" if default is None else f"{default:.1f}",
                config_name(best_cfg),
                f"{best_tflops:.1f}",
                f"{sdpa_tflops:.1f}",
                f"{best_tflops / sdpa_tflops:.2f}x",
                f"{max(e for _, _, e in results[case]):.1e}",
            ]
        )
        print(f"best {name} {batch}x{ctx}: config={best_cfg!r} {best_tflops:.1f} TFLOP/s", flush=True)
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    return rows, detail


def table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    global TIMER, FLUSH, MODELS, HEAD_MAJOR, CASES, BLOCK_SIZE, ORDERED_BLOCKS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton interpreter, fp32)")
    parser.add_argument("--sweep", action="store_true", help="time launcher configs per decode case first")
    parser.add_argument("--prefill-sweep", action="store_true", help="time unified-kernel configs per prefill case")
    parser.add_argument(
        "--compile-jobs",
        type=int,
        default=min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1),
        help="--prefill-sweep on a GPU: compile each round in this many processes first (1: no pool)",
    )
    parser.add_argument("--no-table", action="store_true", help="with a sweep: skip the decode/prefill tables")
    parser.add_argument("--timer", choices=("graph", "do_bench"), default="graph", help="CUDA timing method")
    parser.add_argument(
        "--flush", choices=("write", "read"), default="read", help="graph timer: L2 flush by memset or by a read"
    )
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="KV cache block size (positions)")
    parser.add_argument(
        "--ordered-blocks", action="store_true", help="blocks in sequence order in memory (default: shuffled)"
    )
    parser.add_argument("--head-major", action="store_true", help="cache storage [2, blocks, Hkv, bs, D] (a view)")
    parser.add_argument(
        "--extra", default="", help="with --sweep: more candidates, 'key=int,key=int;key=int' (one per ';')"
    )
    parser.add_argument("--cases", default="", help="decode: only these BATCHxCONTEXT cases, comma-separated")
    parser.add_argument("--models", default="", help="comma-separated name fragments: only these models")
    args = parser.parse_args(argv)
    TIMER, FLUSH = args.timer, args.flush
    BLOCK_SIZE, ORDERED_BLOCKS = args.block_size, args.ordered_blocks
    HEAD_MAJOR = args.head_major
    EXTRA.extend((item.strip(), envs.parse_config(item)) for item in filter(None, args.extra.split(";")))
    CASES = {tuple(int(n) for n in case.split("x")) for case in filter(None, args.cases.split(","))}

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        MODELS = {"tiny MHA 2x16": (2, 2, 16), "tiny GQA 4/2x16": (4, 2, 16)}
        batches, contexts, prefill, copy_bytes = [1, 2], [40], [(2, 32)], 1 << 20
        sweep_batches, sweep_contexts = [2], [40]
        prefill_tiles = SMOKE_PREFILL_TILES
    else:
        if device.type != "cuda":
            print("attention_bench: needs a GPU (use --smoke for a CPU check)", file=sys.stderr)
            return 2
        batches, contexts, prefill, copy_bytes = [1, 32, 128], [1024, 8192], [(8, 1024), (1, 8192)], 1 << 30
        sweep_batches, sweep_contexts = SWEEP_BATCHES, SWEEP_CONTEXTS
        if CASES:  # any batch and context, not only the default grid's
            sweep_batches, sweep_contexts = sorted({b for b, _ in CASES}), sorted({c for _, c in CASES})
        prefill_tiles = PREFILL_TILES
    fragments = [part for part in args.models.split(",") if part]
    if fragments:
        MODELS = {name: dims for name, dims in MODELS.items() if any(part in name for part in fragments)}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.time()
    copy_gbps = copy_bandwidth(device, copy_bytes)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    print(f"# attention benchmark: {name}, {dtype}, block {BLOCK_SIZE}; d2d copy {copy_gbps:.0f} GB/s", flush=True)

    timer = f"CUDA-graph replays, L2 flushed by a {FLUSH}" if TIMER == "graph" else "triton.testing.do_bench"
    report = [
        f"# Attention kernels: {name}",
        "",
        f"torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, KV block size {BLOCK_SIZE}, "
        f"medians of {timer}. Device-to-device copy bandwidth (same run): {copy_gbps:.0f} GB/s.",
        "",
    ]
    if args.sweep:
        print("# decode config sweep (whole op: KV write + attention)", flush=True)
        sweep, detail = sweep_rows(device, dtype, sweep_batches, sweep_contexts)
        report += [
            "## Decode config sweep: rlt::attention_triton's decode call (KV write + attention)",
            "",
            table(
                [
                    "model",
                    "batch",
                    "context",
                    "default us",
                    "default GB/s",
                    "best config",
                    "best us",
                    "default / best",
                    "old unified us",
                    "SDPA us",
                    "max abs err (all)",
                ],
                sweep,
            ),
            "",
            "<details><summary>every candidate</summary>",
            "",
            table(["model", "batch", "context", "config", "us", "max abs err"], detail),
            "",
            "</details>",
            "",
        ]
    if args.prefill_sweep:
        print("# prefill config sweep (unified kernel, causal)", flush=True)
        sweep, detail = prefill_sweep_rows(device, dtype, prefill, prefill_tiles, args.compile_jobs)
        report += [
            "## Prefill config sweep: the unified kernel on causal prefill (TFLOP/s)",
            "",
            table(
                [
                    "model",
                    "seqs",
                    "length",
                    "old layout",
                    "default",
                    "best config",
                    "best",
                    "SDPA",
                    "best / SDPA",
                    "max abs err (all)",
                ],
                sweep,
            ),
            "",
            '"old layout": `mask_split=False, pad_group=True` with the default tile (the pre-split kernel).',
            "",
            "<details><summary>every candidate</summary>",
            "",
            table(["model", "seqs", "length", "config", "us", "TFLOP/s", "max abs err"], detail),
            "",
            "</details>",
            "",
        ]
    if (args.sweep or args.prefill_sweep) and args.no_table:
        report.append(f"Total benchmark time {time.time() - start:.0f} s.")
        text = "\n".join(report)
        print(text)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        return 0
    dec = decode_rows(device, dtype, batches, contexts, copy_gbps)
    pre = prefill_rows(device, dtype, prefill)
    report += [
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
                "old unified us",
                "SDPA us",
                "SDPA GB/s",
                "speedup vs SDPA",
                "gather + SDPA us",
                "speedup vs gather + SDPA",
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
                "paged kernel us",
                "paged kernel TFLOP/s",
                "op us",
                "op TFLOP/s",
                "SDPA flash us",
                "SDPA cuDNN us",
                "SDPA us",
                "SDPA TFLOP/s",
                "kernel vs SDPA",
                "op vs SDPA",
                "gather + SDPA us",
                "op vs gather + SDPA",
                "max abs err",
            ],
            pre,
        ),
        "",
        f"Total benchmark time {time.time() - start:.0f} s. SDPA reads K/V pre-gathered into contiguous tensors "
        f"(gather not timed); 'gather + SDPA' times the gather out of the paged cache with it (what a paged "
        "runtime without its own kernel runs); triton reads the paged cache through "
        f"{'ordered' if ORDERED_BLOCKS else 'shuffled'} "
        "block tables. Prefill 'paged "
        "kernel': the unified kernel over the whole causal context; 'op': rlt::attention_triton's call (KV "
        "write + attention: the TMA prefill kernel where the GPU has TMA, else the paged kernel); 'SDPA flash' "
        "/ 'SDPA cuDNN': SDPA held to that backend.",
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
