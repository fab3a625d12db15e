"""``python -m rlt_compile.inspect --model DIR --out DIR``: dump what the compiler made of a model.

Compiles the model with ``compile_model(..., dump_dir=OUT)``, runs one prefill and a few decode
steps so every compile unit is traced and compiled, and leaves in ``OUT``:

    SUMMARY.md                         platform, attention backend, graphs per unit, pass log, file list
    <unit>.<n>.before.txt / .after.txt Dynamo's FX graph of compile unit <unit> (graph n) before / after
                                       our passes, one line per node with dtype and shape
    <unit>.<n>.before.py / .after.py   the same graphs as Python (GraphModule.code)
    <unit>.<n>.passes.txt              what each pass changed in that graph
    <unit>.<n>.inductor.py             Inductor's generated code for the post-pass graph
    depyf/                             depyf's dump: Dynamo-transformed bytecode decompiled to Python
                                       (full_code_for_*, __transformed_code_*), the captured graphs at
                                       each stage (__compiled_fn_*.*.py) and Inductor kernels

``--model`` is a checkpoint folder, or ``tiny:<family>`` for a tiny random model built on the fly.
docs/inspecting.md explains how to read the dump.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import torch

from rlt_compile.compiler import compile_model, resolve_platform
from rlt_compile.kernels.metadata import build_metadata

BLOCK_SIZE = 16


def _load(spec: str, dtype: torch.dtype | None, device: torch.device):
    from rlt_compile.models.loader import load_model

    if spec.startswith("tiny:"):
        from rlt_compile.tiny import write_tiny_checkpoint

        folder = Path(tempfile.mkdtemp(prefix="rlt_tiny_"))
        write_tiny_checkpoint(spec.split(":", 1)[1], folder, with_tokenizer=False)
        spec = str(folder)
    return load_model(spec, dtype=dtype, device=device, load_tokenizer=False)


def run_inspect(
    model_spec: str,
    out: str | Path,
    platform: str = "auto",
    dtype: str | None = None,
    prompt_len: int = 8,
    decode_steps: int = 2,
    num_steps: int | None = None,
    **compile_options,
) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plat = resolve_platform(platform)
    device = plat.torch_device()
    torch_dtype = getattr(torch, dtype) if dtype else None
    model = _load(model_spec, torch_dtype, device)
    cm = compile_model(model, platform=plat, dump_dir=out, **compile_options)
    options = {"num_steps": num_steps} if num_steps else {}
    if model.family == "huginn":
        options["init_scale"] = 0.0
    steps = num_steps or model.default_steps
    total = prompt_len + decode_steps
    blocks = -(-total // BLOCK_SIZE)
    planes = model.allocate_kv_cache(blocks, BLOCK_SIZE, max_steps=steps)
    table = [list(range(blocks))]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (prompt_len,), generator=gen).to(device)
    meta = build_metadata([prompt_len], [0], table, BLOCK_SIZE, device=device)
    last = torch.tensor([prompt_len - 1], device=device)
    logits = cm(ids, torch.arange(prompt_len, device=device), planes, meta, last, **options)
    length = prompt_len
    for _ in range(decode_steps):
        token = logits.argmax(-1)
        meta = build_metadata([1], [length], table, BLOCK_SIZE, device=device)
        logits = cm(token, torch.tensor([length], device=device), planes, meta, torch.zeros_like(last), **options)
        length += 1
    write_summary(cm, out, model_spec)
    return out


def write_summary(cm, out: Path, model_spec: str) -> None:
    lines = [
        f"# rlt_compile inspect: {model_spec}",
        "",
        f"- model: {type(cm.model).__name__} ({cm.model.family}), compile units: {', '.join(cm.units)}",
        f"- platform: {cm.platform.describe()}",
        f"- attention backend: {cm.attention_backend}",
        f"- passes (in order): {', '.join(cm.manager.names) or '(none)'}",
        f"- Dynamo graphs per unit: {cm.graph_counts()}",
        f"- compile time (passes + Inductor): {cm.compile_seconds():.1f} s",
        "",
        "## Pass log",
        "",
    ]
    lines += [f"- {r}" for r in cm.pass_log] or ["- (no pass changed anything)"]
    lines += ["", "## Files", ""]
    for path in sorted(out.rglob("*")):
        if path.is_file() and path.name != "SUMMARY.md":
            lines.append(f"- {path.relative_to(out)}")
    lines += ["", "How to read these files: docs/inspecting.md", ""]
    (out / "SUMMARY.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlt_compile.inspect", description="Dump the compiler's view of a model (depyf, FX, Inductor)."
    )
    parser.add_argument("--model", required=True, help="checkpoint folder, or tiny:<family> (ouro, nanbeige, huginn)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--platform", default="auto", help="auto | cuda | rocm | cpu (default auto)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=2)
    parser.add_argument("--num-steps", type=int, default=None, help="loop steps / recurrences per forward")
    parser.add_argument("--attention-backend", default=None, help="auto | triton | torch")
    parser.add_argument("--no-inductor", action="store_true", help="stop after our passes (no Inductor code)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        out = run_inspect(
            args.model,
            args.out,
            platform=args.platform,
            dtype=args.dtype,
            prompt_len=args.prompt_len,
            decode_steps=args.decode_steps,
            num_steps=args.num_steps,
            attention_backend=args.attention_backend,
            inductor=not args.no_inductor,
        )
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((out / "SUMMARY.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
