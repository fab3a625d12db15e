"""The built-in example: write a tiny random Ouro checkpoint locally and generate from it.

``python -m rlt_compile.example [--family ouro|nanbeige|huginn] [--compile]`` needs no download; it
shows the whole path (checkpoint -> load_model -> engine -> text) on a model small enough for a CPU.
"""

from __future__ import annotations

import argparse
import tempfile

from rlt_compile.tiny import TINY_CONFIGS, write_tiny_checkpoint


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="ouro", choices=sorted(TINY_CONFIGS))
    parser.add_argument("--prompt", default="the capital of france is")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--compile", action="store_true", help="run through compile_model")
    args = parser.parse_args(argv)

    from rlt_compile.engine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(args.family, tmp)
        options = {"model_options": {"init_scale": 0.0}} if args.family == "huginn" else {}
        llm = LLM(str(path), compile=args.compile, **options)
        out = llm.generate([args.prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=False)
        print(f"model: tiny random {args.family} ({sum(p.numel() for p in llm.model.parameters())} parameters)")
        print(f"prompt: {args.prompt!r}")
        print(f"output: {out[0].outputs[0].text!r}  (random weights, so the words are arbitrary)")


if __name__ == "__main__":
    main()
