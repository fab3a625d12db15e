"""Where the time of the depth-batching engine goes: Ouro-1.4B (random bf16 weights), compile + graphs,
continuous depth batching, ``--requests`` requests with at most ``--batch`` running, request i exits at
step i % 4. Prints output tok/s, prefill-step and depth-pass times, and a cProfile of the timed run.

    python benchmarks/depth_engine_profile.py [--requests 128] [--batch 32]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from rlt_compile.bench import CONFIGS, build_random_model
from rlt_compile.engine import LLMEngine, SamplingParams


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    model = build_random_model(CONFIGS["ouro-1.4b"], torch.bfloat16, torch.device("cuda"))
    eng = LLMEngine(model, num_blocks=args.requests * (-(-(args.prompt + args.tokens) // 16)) + 16,
                    max_num_seqs=args.batch, max_model_len=args.prompt + args.tokens + 16,
                    enable_prefix_caching=False, compile=True, use_cuda_graphs=True, depth_batching=True,
                    model_options={"kv_layout": "last-exited"})  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (args.prompt,), generator=gen).tolist() for _ in range(args.requests)]

    def run(n: int) -> dict[str, list[float]]:
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, exit_policy="fixed", exit_step=i % 4)
            eng.add_request(None, p, params)
        times: dict[str, list[float]] = {"prefill": [], "pass": []}
        while eng.has_unfinished():
            before = eng.stats.prefill_tokens
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            times["prefill" if eng.stats.prefill_tokens != before else "pass"].append(time.perf_counter() - t0)
        return times

    run(2)  # compile and capture
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    times = run(args.tokens)
    profile.disable()
    elapsed = time.perf_counter() - t0
    print(f"{args.requests * args.tokens / elapsed:.0f} output tok/s in {elapsed:.2f} s")
    for kind, values in times.items():
        mean = 1e3 * sum(values) / max(1, len(values))
        print(f"{kind} steps: {len(values)}, {mean:.1f} ms each, {sum(values):.2f} s in all")
    pstats.Stats(profile).sort_stats("cumtime").print_stats(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
