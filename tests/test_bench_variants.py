"""``python -m rlt_compile.bench --variant``: launcher configs timed in one process, interleaved with
the baseline, each under its own environment variable and from the same decode position."""

from __future__ import annotations

import os

import pytest
import torch

from rlt_compile import bench
from rlt_compile.bench_variants import Variant, parse_variant, run_variants, scoped_env, variants_table


def test_parse_variant_takes_the_launch_time_variables_only():
    v = parse_variant("RLT_GEMV_CONFIG=only_n=2048,block_n=4;only_n=6144,block_k=2048")
    assert v == Variant("RLT_GEMV_CONFIG", "only_n=2048,block_n=4;only_n=6144,block_k=2048")
    assert parse_variant("RLT_ATTENTION_CONFIG=block_n=16").label == "RLT_ATTENTION_CONFIG=block_n=16"
    with pytest.raises(ValueError, match="RLT_ATTENTION_CONFIG, RLT_GEMV_CONFIG"):
        parse_variant("RLT_PDL=0")  # read when the graphs are built, not at each launch
    with pytest.raises(ValueError, match="RLT_GEMV_CONFIG must be key=int pairs"):
        parse_variant("RLT_GEMV_CONFIG=block_n=4;warps")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_variant("RLT_GEMV_CONFIG")


def test_scoped_env_restores_a_previous_value_and_an_absence(monkeypatch):
    monkeypatch.setenv("RLT_GEMV_CONFIG", "block_n=2")
    monkeypatch.delenv("RLT_ATTENTION_CONFIG", raising=False)
    with scoped_env("RLT_GEMV_CONFIG", "block_n=4"), scoped_env("RLT_ATTENTION_CONFIG", "splits=4"):
        assert os.environ["RLT_GEMV_CONFIG"] == "block_n=4"
        assert os.environ["RLT_ATTENTION_CONFIG"] == "splits=4"
    assert os.environ["RLT_GEMV_CONFIG"] == "block_n=2"
    assert "RLT_ATTENTION_CONFIG" not in os.environ


def test_variants_run_interleaved_each_under_its_variable(monkeypatch):
    monkeypatch.delenv("RLT_GEMV_CONFIG", raising=False)
    monkeypatch.setenv("RLT_ATTENTION_CONFIG", "splits=8")
    seen = []

    def measure():
        gemv, attention = os.environ.get("RLT_GEMV_CONFIG"), os.environ.get("RLT_ATTENTION_CONFIG")
        seen.append((gemv, attention))
        ms = {None: 2.0, "block_n=4": 1.0}[gemv] * (1.5 if attention == "block_n=16" else 1.0)
        logits = torch.tensor([1.0, -4.0]) + (0.5 if gemv else 0.0)  # the GEMV variant changes the results
        return ms, logits

    variants = [parse_variant("RLT_GEMV_CONFIG=block_n=4"), parse_variant("RLT_ATTENTION_CONFIG=block_n=16")]
    results, scale = run_variants(measure, variants, rounds=2)
    baseline = (None, "splits=8")  # the environment as given
    assert seen == [baseline, ("block_n=4", "splits=8"), (None, "block_n=16")] * 2
    assert os.environ["RLT_ATTENTION_CONFIG"] == "splits=8" and "RLT_GEMV_CONFIG" not in os.environ
    assert [r.mean_ms for r in results] == [2.0, 1.0, 3.0]
    assert [r.max_abs_diff for r in results] == [0.0, 0.5, 0.0]
    assert scale == 4.0
    table = variants_table(results, scale)
    assert "| RLT_GEMV_CONFIG=block_n=4 | 1.000 / 1.000 | 1.000 | -50.00% | 0.5 (0.12) |" in table
    assert "| RLT_ATTENTION_CONFIG=block_n=16 | 3.000 / 3.000 | 3.000 | +50.00% | 0 (0) |" in table


def test_a_failing_variant_is_reported_and_skipped_the_baseline_error_raised(monkeypatch):
    monkeypatch.delenv("RLT_GEMV_CONFIG", raising=False)
    calls = []

    def measure():
        calls.append(os.environ.get("RLT_GEMV_CONFIG"))
        if os.environ.get("RLT_GEMV_CONFIG") == "warps=3":
            raise ValueError("warps must be a power of two")
        return 1.0, torch.zeros(3)

    variants = [parse_variant("RLT_GEMV_CONFIG=warps=3"), parse_variant("RLT_GEMV_CONFIG=warps=8")]
    results, _ = run_variants(measure, variants, rounds=3)
    assert calls.count("warps=3") == 1 and calls.count("warps=8") == 3 and calls.count(None) == 3
    assert results[1].error == "ValueError: warps must be a power of two" and results[1].ms == []
    assert "| RLT_GEMV_CONFIG=warps=3 | error: ValueError: warps must be a power of two |" in variants_table(results, 1)

    def broken():
        raise RuntimeError("no graphs")

    with pytest.raises(RuntimeError, match="no graphs"):
        run_variants(broken, variants, rounds=1)


def test_bench_times_variants_from_the_same_position(capsys, monkeypatch):
    """On the CPU the variables change nothing (the torch reference attention and linears), so every
    measurement's first step must give the baseline's logits exactly: it starts from the same token at
    the same position after the earlier measurements decoded past it. The variants reuse the compiled
    model: Dynamo traces no new graph while they run."""
    from torch._dynamo.utils import counters

    new_graphs = []

    def counting(measure, variants, rounds):
        before = counters["stats"]["unique_graphs"]
        out = run_variants(measure, variants, rounds)
        new_graphs.append(counters["stats"]["unique_graphs"] - before)
        return out

    monkeypatch.setattr(bench, "run_variants", counting)
    argv = ["--device", "cpu", "--tiny", "--dtype", "float32", "--model", "ouro-1.4b", "--eager-steps", "0"]
    argv += ["--compiled-steps", "0", "--steps", "4", "--rounds", "2", "--variant", "RLT_ATTENTION_CONFIG=block_n=16"]
    assert bench.main(argv + ["--variant", "RLT_GEMV_CONFIG=only_n=64,block_n=4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| baseline", "| RLT_"))]
    assert new_graphs == [0]
    assert len(rows) == 6 and rows[:3] == rows[3:], rows  # the model's table, then the whole run's
    for row in rows[:3]:
        per_round, diff = row.split("|")[2], row.split("|")[5]
        assert len(per_round.split("/")) == 2 and diff.strip() == "0 (0)", row
