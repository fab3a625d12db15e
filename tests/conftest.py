"""Shared fixtures: tiny checkpoints of each family (built locally, no download) and the golden folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlt_compile.models.registry import build_model
from rlt_compile.tiny import random_state_dict, tiny_config, write_tiny_checkpoint

FAMILIES = ["ouro", "nanbeige", "huginn"]
GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU (run with -m gpu on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: write_tiny_checkpoint(f, root / f, seed=1) for f in FAMILIES}


def family_options(family: str) -> dict:
    """Deterministic forward options: Huginn's initial state is random unless init_scale=0."""
    return {"init_scale": 0.0} if family == "huginn" else {}


def tiny_model(family: str, seed: int = 0, **overrides):
    """A tiny model of ``family`` with random weights (``seed``), in eval mode without gradients."""
    raw = tiny_config(family, **overrides)
    model = build_model(raw)
    model.load_state_dict(random_state_dict(raw, seed=seed), strict=False)
    model.tie_weights()
    return model.eval().requires_grad_(False)
