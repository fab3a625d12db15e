"""The GPU benchmarks' CPU smoke modes (Triton's interpreter, tiny shapes): a benchmark broken by a
refactor should fail here, not in a scarce device session. Each one checks its kernels' outputs
against a reference itself and exits non-zero when they differ."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        ("attention_bench.py", ["--smoke"], "| tiny GQA 4/2x16 |"),
        ("attention_case.py", ["--smoke", "--batch", "2", "--ctx", "40"], "out (2, "),
        ("gemv_case.py", ["--smoke"], "relative error < 1e-2"),
        ("gemv_chain_bench.py", ["--smoke"], "| gemv + silu fold"),
        (
            "gemv_chain_bench.py",
            ["--smoke", "--variants", "--only", "model epilogues"],
            "| model epilogues, gemv acc_2d",
        ),
        ("prefill_tma_bench.py", ["--smoke", "--extra", "fold_scale=1,rescale_slack=8"], "rescale_slack=8"),
        ("prefill_tma_bench.py", ["--smoke", "--mixes", "20,5,50", "--default-tile-only"], "(average 4)"),
        ("prefill_graph_bench.py", ["--smoke"], "| 3 decodes + chunk 12 | 15 | (16, 4) |"),
    ],
)
def test_benchmark_smoke_mode_runs_and_checks_its_kernels(script, args, expected):
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert expected in run.stdout, run.stdout[-3000:]
    if script == "gemv_chain_bench.py":  # its table's last column: each chain's error against cuBLAS's
        rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and line.endswith("|")]
        errors = [float(row.split("|")[-2]) for row in rows[1:]]  # after the header
        assert errors and max(errors) < 1e-4, rows


def test_schedule_model_greedy_and_snake_orders():
    """The prefill kernel's scheduling model: greedy (one program per item) stays within 4% of the ideal
    load on every case; the snake order balances a single prompt, which the stride order does not."""
    sys.path.insert(0, str(BENCHMARKS))
    import schedule_model as model

    for _, batch, seq_len, heads in model.CASES:
        weights = model.item_weights(batch, seq_len, heads, fixed=1.5)
        assert model.greedy(weights, 264) <= 1.04 * sum(weights) / 264
    single = model.item_weights(1, 8192, 16, fixed=1.5)
    ideal = sum(single) / 264
    assert model.static(single, 264, snake=True) <= 1.01 * ideal < 1.05 * ideal <= model.static(single, 264, False)
