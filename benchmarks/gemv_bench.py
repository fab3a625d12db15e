"""Decode GEMV bandwidth: cuBLAS (``F.linear``) vs the Triton GEMV of ``kernels/gemv.py``.

    python benchmarks/gemv_bench.py [--rows 1,8] [--sweep] [--out FILE]

(the Triton GEMV is ``benchmarks/gemv_kernel.py``, a study kept out of the package)

For the linears of Ouro-1.4B, Nanbeige4.2-3B and Huginn-0125 (fused q/k/v and gate/up shapes) and
a few row counts, each variant is captured in a CUDA graph that cycles through enough distinct
weight copies (>= 256 MB) that L2 never holds the weight, and timed by replay (median of 20).
Reported: us per call and GB/s (weight bytes / time), against the device-to-device copy
bandwidth measured in the same run. ``--sweep`` also times a grid of tile configs per shape and
prints the best, so the shape heuristic in ``gemv_config`` can be checked. The fused variants
(RMSNorm prologue, SiLU-mul prologue) are compared with the unfused sequence they replace
(Inductor-style norm kernel + cuBLAS), timed the same way.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemv_kernel as gemv  # noqa: E402

SHAPES = {  # name: (N, K)
    "ouro qkv": (6144, 2048),
    "ouro o": (2048, 2048),
    "ouro gate_up": (11264, 2048),
    "ouro down": (2048, 5632),
    "nanbeige qkv": (8192, 3072),
    "nanbeige o": (3072, 6144),
    "nanbeige gate_up": (21504, 3072),
    "nanbeige down": (3072, 10752),
    "huginn qkv": (15840, 5280),
    "huginn down": (5280, 17920),
}


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() / statistics.median(times)


def time_graph(fn, args_list, reps: int = 20) -> float:
    """Seconds per call of ``fn`` over ``args_list`` (one call per entry), replayed in a graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in args_list[:2]:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in args_list:
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times) / len(args_list)


def weights(n: int, k: int, copies_bytes: int = 256 << 20) -> list[torch.Tensor]:
    copies = max(4, -(-copies_bytes // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]


def check(y, ref, what):
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    if not err < 2e-2:
        raise AssertionError(f"{what}: relative error {err:.3g}")
    return err


def sweep_configs():
    for bn, bk, (warps, stages) in itertools.product((16, 32, 64), (128, 256, 512), ((4, 3), (4, 4), (8, 3), (4, 6))):
        yield {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out")
    a = p.parse_args(argv)
    rows = [int(r) for r in a.rows.split(",")]
    bw = copy_bandwidth()
    lines = [
        f"copy bandwidth {bw / 1e12:.2f} TB/s",
        "",
        "| shape (N x K) | rows | cuBLAS us | cuBLAS TB/s | Triton us | Triton TB/s | best sweep us (config) | rel err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, (n, k) in SHAPES.items():
        ws = weights(n, k)
        nbytes = n * k * 2
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            err = check(gemv.gemv_triton(x, ws[0]), F.linear(x, ws[0]), name)
            t_blas = time_graph(F.linear, [(x, w) for w in ws])
            t_tri = time_graph(gemv.gemv_triton, [(x, w) for w in ws])
            best = ""
            if a.sweep:
                results = []
                for cfg in sweep_configs():
                    try:
                        t = time_graph(
                            lambda x, w, c=cfg: gemv.gemv_triton(x, w, config=c), [(x, w) for w in ws], reps=5
                        )
                    except Exception as exc:  # a config that does not compile (shared memory): skip
                        print("skip", cfg, type(exc).__name__)
                        continue
                    results.append((t, cfg))
                t_best, cfg = min(results, key=lambda r: r[0])
                best = (
                    f"{t_best * 1e6:.1f} ({cfg['BLOCK_N']},{cfg['BLOCK_K']},{cfg['num_warps']}w,{cfg['num_stages']}s)"
                )
            lines.append(
                f"| {name} ({n} x {k}) | {m} | {t_blas * 1e6:.1f} | {nbytes / t_blas / 1e12:.2f} | "
                f"{t_tri * 1e6:.1f} | {nbytes / t_tri / 1e12:.2f} | {best} | {err:.1e} |"
            )
            print(lines[-1], flush=True)
        del ws
    # fused prologues vs the unfused pair they replace (Ouro shapes, 1 row)
    lines += ["", "| fused op (Ouro, 1 row) | unfused us | fused us | speedup |", "|---|---|---|---|"]
    n, k = SHAPES["ouro qkv"]
    ws = weights(n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    nw = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    check(gemv.rmsnorm_linear_triton(x, nw, 1e-6, ws[0]), F.linear(gemv.rmsnorm_reference(x, nw, 1e-6), ws[0]), "norm")
    norm_c = torch.compile(gemv.rmsnorm_reference)
    t_un = time_graph(lambda x, w: F.linear(norm_c(x, nw, 1e-6), w), [(x, w) for w in ws])
    t_fu = time_graph(lambda x, w: gemv.rmsnorm_linear_triton(x, nw, 1e-6, w), [(x, w) for w in ws])
    lines.append(f"| rmsnorm + qkv | {t_un * 1e6:.1f} | {t_fu * 1e6:.1f} | {t_un / t_fu:.2f}x |")
    n, k = SHAPES["ouro down"]
    ws = weights(n, k)
    gu = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
    check(gemv.silu_mul_linear_triton(gu, ws[0]), F.linear(gemv.silu_mul_reference(gu), ws[0]), "silu")
    act_c = torch.compile(gemv.silu_mul_reference)
    t_un = time_graph(lambda g, w: F.linear(act_c(g), w), [(gu, w) for w in ws])
    t_fu = time_graph(lambda g, w: gemv.silu_mul_linear_triton(g, w), [(gu, w) for w in ws])
    lines.append(f"| silu*mul + down | {t_un * 1e6:.1f} | {t_fu * 1e6:.1f} | {t_un / t_fu:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
