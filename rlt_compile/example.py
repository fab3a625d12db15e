"""The built-in example: write a tiny random checkpoint locally, compile it and generate from it.

``python -m rlt_compile.example [--family ouro|nanbeige|huginn] [--eager]`` needs no download; it
shows the whole path (checkpoint -> load_model -> compile_model -> engine -> text) on a model small
enough for a CPU, and checks the compiled engine's greedy tokens against the eager model's.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from rlt_compile.tiny import TINY_CONFIGS, write_tiny_checkpoint


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="ouro", choices=sorted(TINY_CONFIGS))
    parser.add_argument("--prompt", default="the capital of france is")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--eager", action="store_true", help="skip compile_model (and the comparison)")
    args = parser.parse_args(argv)

    from rlt_compile.engine import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(args.family, tmp)
        options = {"model_options": {"init_scale": 0.0}} if args.family == "huginn" else {}

        def run(compile: bool):
            start = time.perf_counter()
            llm = LLM(str(path), compile=compile, **options)
            out = llm.generate([args.prompt], greedy, use_tqdm=False)[0].outputs[0]
            return llm, out, time.perf_counter() - start

        llm, out, seconds = run(compile=not args.eager)
        how = "eager" if args.eager else f"compile_model, platform {llm.engine.runner.step_fn.platform.kind}"
        print(f"model: tiny random {args.family} ({sum(p.numel() for p in llm.model.parameters())} parameters)")
        print(f"prompt: {args.prompt!r}")
        print(f"output ({how}, {seconds:.1f} s): {out.text!r}  (random weights, so the words are arbitrary)")
        if args.eager:
            return 0
        _, reference, _ = run(compile=False)
        same = list(out.token_ids) == list(reference.token_ids)
        print(f"greedy tokens equal the eager model's: {'yes' if same else 'NO'}")
        return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
