"""One-shot generation from the command line.

    python -m rlt_compile.generate --model DIR --prompt "The capital of France is" --max-tokens 32
    python -m rlt_compile.generate --model DIR --prompt "hello" --chat --temperature 0.7 --seed 1 --verbose

Prints the generated text on stdout; ``--verbose`` adds token counts, timing and tok/s on stderr.
``--model-option KEY=VALUE`` (repeatable) passes a model forward option, e.g. ``num_steps=8`` for
Huginn (the value is read as JSON when it parses, else as a string).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_model_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> (key, JSON value, or the raw string when it is not JSON)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_int_list(text: str) -> list[int]:
    """``"64,128,256"`` -> ``[64, 128, 256]`` (positive integers)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_buckets(text: str) -> list[int]:
    """``parse_int_list``, or ``"off"`` -> ``[]`` (no buckets: no graphs of that kind)."""
    return [] if text.strip().lower() == "off" else parse_int_list(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlt_compile.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint folder (HF format)")
    p.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt with the tokenizer's chat template")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    p.add_argument("--compile", action="store_true", help="run the compiled step (rlt_compile.compiler)")
    p.add_argument("--cuda-graphs", action="store_true", help="replay decode steps as CUDA graphs")
    p.add_argument("--cuda-graph-prefill-tokens", type=parse_buckets, default=None, metavar="N,N,...|off",
                   help="with --cuda-graphs: token buckets of the prefill-step graphs (default on the GPU: "
                        "128,256,512,1024,2048; off: none)")  # fmt: skip
    p.add_argument("--model-option", type=parse_model_option, action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks sharing the model (under torchrun)")
    p.add_argument("--verbose", action="store_true", help="print token counts, timing and tok/s to stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rlt_compile.engine import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        llm = LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            compile=args.compile,
            use_cuda_graphs=args.cuda_graphs,
            cuda_graph_prefill_tokens=args.cuda_graph_prefill_tokens,
            model_options=dict(args.model_option),
            max_num_seqs=1,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    except ValueError as e:  # CheckpointError, an unknown model_type, a bad engine option
        print(f"error: {e}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    try:
        if args.chat:
            outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = outputs[0]
    completion = out.outputs[0]
    if args.tensor_parallel_size > 1 and int(os.environ.get("RANK", 0)) != 0:
        return 0  # every rank generated the same text; rank 0 prints it
    print(completion.text)
    if args.verbose:
        seconds = llm.last_run_seconds
        n = len(completion.token_ids)
        print(
            f"[rlt_compile] device={llm.engine.device} prompt_tokens={len(out.prompt_token_ids)} "
            f"output_tokens={n} finish_reason={completion.finish_reason} load={load_s:.2f}s "
            f"generate={seconds:.3f}s ttft={llm.last_first_token_seconds or 0.0:.3f}s {n / max(seconds, 1e-9):.1f} tok/s",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
