"""Launcher-config variants timed in one process: ``python -m rlt_compile.bench --variant NAME=VALUE``.

``RLT_ATTENTION_CONFIG`` and ``RLT_GEMV_CONFIG`` are read by the kernel launchers at each call, not
when the model is compiled, so one compiled model serves every variant. Each variant is measured by
capturing the decode graphs afresh with its variable set (the capture's warm-up compiles any new
Triton config) and replaying the same positions from the same token. The baseline (the environment
as given) and the variants run interleaved, ``rounds`` times over (baseline, v1, v2, baseline, v1,
...), so the baseline's own spread shows the drift. One process per config used to cost ~40 s of
device time, mostly building and compiling the model; here a variant costs its capture and replays.

Each measurement also returns the logits of its first step, which are compared with the baseline's
first: a variant that changes the results, not just the time, shows up in the table.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from rlt_compile import envs

# Read at each kernel launch (envs.rlt_attention_config / rlt_gemv_configs), so a variant applies
# without recompiling; a variable read at compile time would silently time the baseline again.
RUNTIME_VARIABLES = ("RLT_ATTENTION_CONFIG", "RLT_GEMV_CONFIG")


@dataclass(frozen=True)
class Variant:
    """One environment variable's value for a measurement; ``name=None`` is the baseline."""

    name: str | None = None
    value: str = ""

    @property
    def label(self) -> str:
        return "baseline" if self.name is None else f"{self.name}={self.value}"


def parse_variant(spec: str) -> Variant:
    """``"RLT_GEMV_CONFIG=only_n=2048,block_n=4;only_n=6144,block_k=2048"`` -> a Variant, its value's
    format checked (the keys are checked by the launchers when the variant runs)."""
    name, sep, value = spec.partition("=")
    name = name.strip()
    if not sep or name not in RUNTIME_VARIABLES:
        raise ValueError(
            f"a variant is NAME=VALUE with NAME one of {', '.join(RUNTIME_VARIABLES)} (read at each kernel "
            f"launch), got {spec!r}"
        )
    parts = value.split(";") if name == "RLT_GEMV_CONFIG" else [value]
    for part in parts:
        envs.parse_config(part, name)
    return Variant(name, value.strip())


@contextlib.contextmanager
def scoped_env(name: str | None, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` inside the block, the previous value (or its absence) after it."""
    if name is None:
        yield
        return
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


@dataclass
class VariantResult:
    variant: Variant
    ms: list[float] = field(default_factory=list)
    max_abs_diff: float | None = None
    error: str | None = None

    @property
    def mean_ms(self) -> float | None:
        return statistics.fmean(self.ms) if self.ms else None


def run_variants(
    measure: Callable[[], tuple[float, torch.Tensor]], variants: Sequence[Variant], rounds: int
) -> tuple[list[VariantResult], float]:
    """``measure()`` (ms per token, first-step logits) under the baseline and each variant in turn,
    ``rounds`` times over. Returns the results, baseline first, and the largest absolute logit of
    the baseline's first measurement (the scale of the logit differences). A variant whose
    measurement raises is marked with the error and skipped after; the baseline's error propagates."""
    results = [VariantResult(Variant())] + [VariantResult(v) for v in variants]
    reference: torch.Tensor | None = None
    for _ in range(rounds):
        for result in results:
            if result.error is not None:
                continue
            try:
                with scoped_env(result.variant.name, result.variant.value):
                    ms, logits = measure()
            except Exception as e:
                if result.variant.name is None:
                    raise
                result.error = f"{type(e).__name__}: {e}"
                continue
            logits = logits.detach().float().cpu()
            if reference is None:
                reference = logits
            diff = (logits - reference).abs().max().item()
            result.ms.append(ms)
            result.max_abs_diff = max(result.max_abs_diff or 0.0, diff)
    assert reference is not None
    return results, reference.abs().max().item()


def variants_table(results: list[VariantResult], scale: float) -> str:
    """Markdown: each variant's ms/token per round, mean, change against the baseline's mean, and its
    largest logit difference from the baseline's first step (absolute, and relative to ``scale``)."""
    baseline = results[0].mean_ms
    spread = (max(results[0].ms) - min(results[0].ms)) / baseline if len(results[0].ms) > 1 else 0.0
    lines = [
        f"Variants, interleaved with the baseline (its rounds spread {spread:.2%} of its mean):",
        "",
        "| variant | ms/token per round | mean | vs baseline | max abs logit diff (rel.) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        if r.error is not None:
            lines.append(f"| {r.variant.label} | error: {r.error} | - | - | - |")
            continue
        change = "" if r.variant.name is None else f"{r.mean_ms / baseline - 1:+.2%}"
        diff = r.max_abs_diff or 0.0
        lines.append(
            f"| {r.variant.label} | {' / '.join(f'{ms:.3f}' for ms in r.ms)} | {r.mean_ms:.3f} | {change} "
            f"| {diff:.3g} ({diff / max(scale, 1e-30):.2g}) |"
        )
    return "\n".join(lines)
