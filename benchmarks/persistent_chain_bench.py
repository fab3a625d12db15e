"""A persistent-kernel experiment (issue 4): the GEMV-only Ouro-1.4B decode chain as ONE kernel.

The compiled model runs a token as ~6 kernels per layer application, chained through PDL; even the
pure chain of dependent GEMVs (``gemv_chain_bench.py --gemv-only``) stays near 3.3 TB/s. This asks
what one resident program per SM could do instead: every program walks all 96 x 4 GEMV phases
(q/k/v, o, gate/up, down, each with distinct weights, as ``--gemv-only`` does), a grid-wide barrier
(an arrival counter in global memory) between dependent phases, and before each barrier an L2
prefetch hint for the program's first weight rows of the next phase (weights never depend on the
barrier). It reports ms per chain against the Triton and cuBLAS GEMV chains in the same run, the
cost of the barriers alone (no GEMV work), and the relative error against the cuBLAS chain::

    python benchmarks/persistent_chain_bench.py --out FILE     # H200, ~1 minute

A benchmark, not a model path: the barrier spins, so it needs every program resident at once (one
per SM; the GPU must be otherwise idle) and cannot run in Triton's CPU interpreter (which runs the
programs one after another).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv_chain_bench import chain, time_graph  # noqa: E402

from rlt_compile.kernels import gemv as gemv_mod  # noqa: E402
from rlt_compile.kernels.triton_attention import _prefetch_l2  # noqa: E402


@triton.jit
def _grid_sync(counter_ptr, target):
    """Wait until ``target`` arrivals are counted (each program adds one per phase)."""
    tl.debug_barrier()  # every thread's stores of this phase precede the release below
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _prefetch_rows(w_ptr, pid, N, K: tl.constexpr, BLOCK_N: tl.constexpr, LINES: tl.constexpr):
    """L2 prefetch of this program's first row block of a ``[N, K]`` weight (the next phase's; no
    rows where ``N`` is 0)."""
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    line = tl.arange(0, LINES) * 64  # 64 bf16 elements = one 128-byte line
    ptrs = w_ptr + rows[:, None].to(tl.int64) * K + line[None, :]
    _prefetch_l2(ptrs, (rows[:, None] < N) & (line[None, :] < K))


@triton.jit
def _gemv_phase(
    w_ptr, x_ptr, y_ptr, pid, G,
    N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """``y[:N] = W @ x[:K]``: this program's row blocks, ``G`` programs apart. ``x`` was written by
    other SMs before the barrier: read through L2 (``.cg``), never a stale L1 line."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for rb in tl.range(pid * BLOCK_N, N, G * BLOCK_N, num_stages=STAGES):
        rows = rb + offs_n
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            cols = k0 + offs_k
            k_mask = cols < K
            x = tl.load(x_ptr + cols, mask=k_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            w = tl.load(
                w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :],
                mask=(rows[:, None] < N) & k_mask[None, :],
                other=0.0,
            )
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _persistent_chain_kernel(
    w_ptr, h_ptr, qkv_ptr, o_ptr, gu_ptr, counter_ptr, num_layers,
    HIDDEN: tl.constexpr, QKV: tl.constexpr, INTER: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
    LINES: tl.constexpr, LINES_DOWN: tl.constexpr, WORK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    # one layer's weights, flat: qkv [QKV, HIDDEN] | o [HIDDEN, HIDDEN] | gate/up [2 INTER, HIDDEN] | down [HIDDEN, INTER]
    o_off = QKV * HIDDEN
    gu_off = o_off + HIDDEN * HIDDEN
    down_off = gu_off + 2 * INTER * HIDDEN
    layer_elems = down_off + HIDDEN * INTER
    phase = 0
    for layer in range(num_layers):
        w = w_ptr + layer.to(tl.int64) * layer_elems
        if WORK:
            _gemv_phase(w, h_ptr, qkv_ptr, pid, G, QKV, HIDDEN, BLOCK_N, BLOCK_K, STAGES)
        if PREFETCH:
            _prefetch_rows(w + o_off, pid, HIDDEN, HIDDEN, BLOCK_N, LINES)
        phase += 1
        _grid_sync(counter_ptr, phase * G)
        if WORK:
            _gemv_phase(w + o_off, qkv_ptr, o_ptr, pid, G, HIDDEN, HIDDEN, BLOCK_N, BLOCK_K, STAGES)
        if PREFETCH:
            _prefetch_rows(w + gu_off, pid, 2 * INTER, HIDDEN, BLOCK_N, LINES)
        phase += 1
        _grid_sync(counter_ptr, phase * G)
        if WORK:
            _gemv_phase(w + gu_off, o_ptr, gu_ptr, pid, G, 2 * INTER, HIDDEN, BLOCK_N, BLOCK_K, STAGES)
        if PREFETCH:
            _prefetch_rows(w + down_off, pid, HIDDEN, INTER, BLOCK_N, LINES_DOWN)
        phase += 1
        _grid_sync(counter_ptr, phase * G)
        if WORK:
            _gemv_phase(w + down_off, gu_ptr, h_ptr, pid, G, HIDDEN, INTER, BLOCK_N, BLOCK_K, STAGES)
        if PREFETCH:
            next_rows = tl.where(layer + 1 < num_layers, QKV, 0)  # the next layer's q/k/v
            _prefetch_rows(w + layer_elems, pid, next_rows, HIDDEN, BLOCK_N, LINES)
        phase += 1
        _grid_sync(counter_ptr, phase * G)


class PersistentChain:
    """The flat weights and activation buffers of one run; ``__call__(x)`` runs the chain on ``x``."""

    def __init__(self, flat, num_layers, hidden, qkv, inter, programs, block_n, block_k, stages, prefetch, work=True):
        dev, dtype = flat.device, flat.dtype
        self.flat, self.num_layers, self.shape = flat, num_layers, (hidden, qkv, inter)
        self.h = torch.empty(hidden, device=dev, dtype=dtype)
        self.qkv = torch.empty(qkv, device=dev, dtype=dtype)
        self.o = torch.empty(hidden, device=dev, dtype=dtype)
        self.gu = torch.empty(2 * inter, device=dev, dtype=dtype)
        self.counter = torch.zeros(1, device=dev, dtype=torch.int32)
        self.programs = programs
        self.meta = dict(BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PREFETCH=prefetch, WORK=work)

    def _launch(self, grid, warmup=False):
        hidden, qkv, inter = self.shape
        launcher = _persistent_chain_kernel.warmup if warmup else _persistent_chain_kernel[grid]
        extra = {"grid": grid} if warmup else {}
        return launcher(
            self.flat, self.h, self.qkv, self.o, self.gu, self.counter, self.num_layers,
            HIDDEN=hidden, QKV=qkv, INTER=inter, LINES=hidden // 64,
            LINES_DOWN=triton.next_power_of_2(inter // 64), num_warps=8, **self.meta, **extra,
        )  # fmt: skip

    def resident_per_sm(self, props) -> int:
        """How many programs of the compiled kernel one SM holds at once (registers, shared memory,
        threads): the spinning barrier deadlocks if the grid exceeds this times the SM count."""
        kernel = self._launch((1,), warmup=True)
        kernel._init_handles()  # loads the binary: sets n_regs
        threads = 8 * 32
        by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(1, kernel.n_regs * threads)
        by_smem = props.shared_memory_per_multiprocessor // (kernel.metadata.shared + 1024)
        return min(by_regs, by_smem, props.max_threads_per_multi_processor // threads)

    def __call__(self, x):
        self.h.copy_(x.reshape(-1))
        self.counter.zero_()
        self._launch((self.programs,))
        return self.h.view(1, -1)


def layer_views(flat, num_layers, hidden, qkv, inter):
    """``gemv_chain_bench`` layers (``qkv``, ``o``, ``gu``, ``down``) as views of the flat weights."""
    shapes = (("qkv", qkv, hidden), ("o", hidden, hidden), ("gu", 2 * inter, hidden), ("down", hidden, inter))
    per_layer = sum(n * k for _, n, k in shapes)
    layers = []
    for i in range(num_layers):
        off, views = i * per_layer, {}
        for name, n, k in shapes:
            views[name] = flat[off : off + n * k].view(n, k)
            off += n * k
        layers.append(views)
    return layers, per_layer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--configs", default="2:1024:1,2:1024:3,4:1024:3,2:2048:3,4:2048:2,8:1024:2",
                        help="block_n:block_k:stages of the persistent kernel, comma-separated")  # fmt: skip
    parser.add_argument("--per-sm", default="1,2,4", help="programs per SM to try (all must be resident)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("persistent_chain_bench: needs a CUDA GPU (the grid barrier spins; the interpreter cannot run it)")
        return 0
    device, dtype = torch.device("cuda"), torch.bfloat16
    hidden, heads, dim, inter = 2048, 16, 128, 5632
    qkv = 3 * heads * dim
    per_layer = qkv * hidden + hidden * hidden + 2 * inter * hidden + hidden * inter
    flat = torch.empty(args.layers * per_layer, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    flat.normal_(generator=gen).mul_(hidden**-0.5)
    layers, _ = layer_views(flat, args.layers, hidden, qkv, inter)
    weight_bytes = args.layers * per_layer * flat.element_size()
    x = torch.randn(1, hidden, device=device, dtype=dtype)
    props = torch.cuda.get_device_properties(device)
    sms = props.multi_processor_count

    def gemv_chain(linear, n=args.layers):
        return lambda: chain(x, layers[:n], linear, None, None, heads, dim, gemv_only=True)

    ref2 = gemv_chain(F.linear, 2)()
    ref = gemv_chain(F.linear)()
    rows = [("cuBLAS chain", time_graph(gemv_chain(F.linear), args.reps), 0.0, 0.0)]
    triton_chain = gemv_chain(gemv_mod.linear_gemv)
    rows.append(("Triton GEMV chain (PDL)", time_graph(triton_chain, args.reps), _err(triton_chain(), ref), 0.0))
    for per_sm in [int(v) for v in args.per_sm.split(",")]:
        for spec in args.configs.split(","):
            block_n, block_k, stages = (int(v) for v in spec.split(":"))
            for prefetch in (True, False):
                name = f"persistent {per_sm}/SM n{block_n} k{block_k} s{stages}{'' if prefetch else ' no prefetch'}"
                try:
                    run = PersistentChain(
                        flat, args.layers, hidden, qkv, inter, per_sm * sms, block_n, block_k, stages, prefetch
                    )
                    fits = run.resident_per_sm(props)
                    if fits < per_sm:
                        print(f"{name}: skipped (an SM holds {fits} of its programs)", flush=True)
                        continue
                    short = PersistentChain(
                        flat, 2, hidden, qkv, inter, per_sm * sms, block_n, block_k, stages, prefetch
                    )
                    err2 = _err(short(x), ref2)
                    err = _err(run(x), ref)
                    ms = _time(lambda run=run: run(x), args.reps)
                except Exception as exc:  # a config that does not compile: report and go on
                    print(f"{name}: failed ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
                    continue
                rows.append((name, ms, err, err2))
                print(
                    f"{name:48s} {ms:7.3f} ms  {weight_bytes / ms / 1e9:5.2f} TB/s  err {err:.1e} / 2 layers {err2:.1e}"
                )
        barriers = PersistentChain(flat, args.layers, hidden, qkv, inter, per_sm * sms, 2, 1024, 1, False, work=False)
        ms = _time(lambda barriers=barriers: barriers(x), args.reps)
        rows.append((f"barriers only ({4 * args.layers}), {per_sm}/SM", ms, float("nan"), float("nan")))
        print(f"{rows[-1][0]:48s} {ms:7.3f} ms = {ms * 1e3 / (4 * args.layers):.2f} us per barrier", flush=True)

    base = rows[0][1]
    lines = [
        f"# Persistent GEMV chain: {args.layers} layer applications x 4 GEMVs, Ouro-1.4B shapes, "
        f"weights {weight_bytes / 1e9:.2f} GB, {sms} SMs",
        "",
        "| chain | ms | weight TB/s | vs cuBLAS | rel err vs cuBLAS (all layers / 2 layers) |",
        "|---|---|---|---|---|",
    ]
    for name, ms, err, err2 in rows:
        lines.append(
            f"| {name} | {ms:.3f} | {weight_bytes / ms / 1e9:.2f} | {base / ms:.2f}x | {err:.1e} / {err2:.1e} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


def _err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _time(fn, reps) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    raise SystemExit(main())
