"""``python -m rlt_compile.generate`` end to end on a tiny checkpoint, in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from rlt_compile import LLM, SamplingParams, load_model

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "rlt_compile.generate", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )


def test_generate_cli_prints_the_engine_text(tiny_dirs):
    model_dir = str(tiny_dirs["nanbeige"])
    proc = _run("--model", model_dir, "--prompt", "the capital of france is", "--max-tokens", "5", "--verbose")
    assert proc.returncode == 0, proc.stderr
    llm = LLM(load_model(model_dir), num_blocks=16)
    expected = llm.generate("the capital of france is", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert proc.stdout.strip() == expected[0].outputs[0].text.strip()
    assert "tok/s" in proc.stderr and "output_tokens=" in proc.stderr
    ttft, total = (float(re.search(rf"{key}=([0-9.]+)s", proc.stderr).group(1)) for key in ("ttft", "generate"))
    assert 0 < ttft <= total


def test_generate_cli_reports_bad_arguments(tiny_dirs):
    proc = _run("--model", str(tiny_dirs["nanbeige"]), "--prompt", "hello", "--top-p", "0")
    assert proc.returncode == 2 and "top_p" in proc.stderr
    proc = _run("--model", str(tiny_dirs["nanbeige"]), "--prompt", "hello", "--frequency-penalty", "3")
    assert proc.returncode == 2 and "frequency_penalty" in proc.stderr


def test_generate_cli_reports_a_bad_checkpoint(tmp_path):
    proc = _run("--model", str(tmp_path / "missing"), "--prompt", "hello")
    assert proc.returncode == 2 and "not a directory" in proc.stderr and "Traceback" not in proc.stderr


def test_generate_cli_prefill_graphs_give_the_same_text(tiny_dirs):
    """``--cuda-graphs --cuda-graph-prefill-tokens``: on the CPU the graph runners' static-buffer steps,
    the text of the plain engine; a bad bucket list is an argument error."""
    model_dir = str(tiny_dirs["ouro"])
    args = ("--model", model_dir, "--prompt", "the capital of france is", "--max-tokens", "5")
    plain = _run(*args)
    graphs = _run(*args, "--cuda-graphs", "--cuda-graph-prefill-tokens", "8,32")
    assert plain.returncode == graphs.returncode == 0, graphs.stderr
    assert graphs.stdout == plain.stdout and plain.stdout.strip()
    bad = _run(*args, "--cuda-graphs", "--cuda-graph-prefill-tokens", "0,x")
    assert bad.returncode == 2 and "--cuda-graph-prefill-tokens" in bad.stderr
