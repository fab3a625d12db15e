"""What one synchronisation point costs on the GPU: a grid barrier inside a persistent kernel
(``kernels/decode_layer._grid_barrier``, both polling modes) vs a kernel boundary under PDL.

* barrier: one launch of ``nprog`` programs (one per SM) passing ``--count`` barriers in a row;
* PDL boundary: ``--count`` launches of a 132-program kernel that only waits for its predecessor
  (``gdc_wait``) and lets the next one launch, replayed as one CUDA graph.

Each program also stores a word between barriers (so the release/acquire pairs order real data)::

    python benchmarks/grid_barrier_bench.py            # H200: a few seconds
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from rlt_compile.kernels.decode_layer import _grid_barrier


@triton.jit
def _barriers_kernel(count_ptr, data_ptr, count, NPROG: tl.constexpr, POLL: tl.constexpr):
    pid = tl.program_id(0)
    for i in range(count):
        tl.store(data_ptr + pid, i)
        _grid_barrier(count_ptr, NPROG, POLL)


@triton.jit
def _pdl_kernel(data_ptr):
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    tl.store(data_ptr + tl.program_id(0), 1)


def time_graph(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--warps", type=int, default=8)
    args = parser.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    data = torch.zeros(1024, dtype=torch.int32, device="cuda")
    rows = []
    for nprog in (sms, 128, 64):
        for poll in (0, 1):

            def run(nprog=nprog, poll=poll):
                _barriers_kernel[(nprog,)](counter, data, args.count, NPROG=nprog, POLL=poll, num_warps=args.warps)

            ms = time_graph(run)
            rows.append((f"grid barrier, {nprog} programs, poll {poll}", ms))

    def chain():
        for _ in range(args.count):
            _pdl_kernel[(sms,)](data, num_warps=args.warps, launch_pdl=True)

    rows.append((f"PDL kernel boundary, {sms} programs", time_graph(chain)))
    print("| sync point | us each |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {1000 * ms / args.count:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
