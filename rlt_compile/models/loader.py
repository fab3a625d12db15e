"""Load an HF-format checkpoint folder (config.json + safetensors) into one of our models.

Tensors are read one at a time from the memory-mapped safetensors file(s) straight to the target
device and dtype, into a model built on the meta device, so host RAM never holds a second copy
of the weights. Every problem is reported by name: unknown model_type, missing or unexpected
tensor, shape mismatch (expected vs found), unreadable file.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from rlt_compile.models.base import LoopedLM
from rlt_compile.models.registry import build_model

log = logging.getLogger(__name__)

# Checkpoint entries that are recomputed, not loaded (e.g. Huginn's persistent RoPE table).
_DERIVED = {"freqs_cis", "model.rotary_emb.inv_freq"}


class CheckpointError(ValueError):
    """The checkpoint folder cannot be loaded; the message names the file or tensor."""


def read_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        return json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: unreadable config.json ({e})") from e


def _weight_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e})") from e
        return {name: path / fname for name, fname in weight_map.items()}
    if single.is_file():
        return {name: single for name in _keys(single)}
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises several types for a corrupt header
        raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from e


def _default_dtype(raw: dict) -> torch.dtype:
    name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    return getattr(torch, str(name).replace("torch.", ""), torch.float32)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    setattr(module, attr, nn.Parameter(value, requires_grad=False))


def load_state(model: LoopedLM, path: Path, dtype: torch.dtype, device: torch.device) -> None:
    files = _weight_files(path)
    expected = dict(model.named_parameters())  # tied weights appear once
    tied = getattr(model, "tied_names", lambda: {})()
    unexpected = sorted(n for n in files if n not in expected and n not in _DERIVED and n not in tied)
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensor(s) in checkpoint: {', '.join(unexpected[:10])}")
    missing = sorted(n for n in expected if n not in files)
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) in checkpoint: {', '.join(missing[:10])}")
    handles: dict[Path, object] = {}
    try:
        for name, param in expected.items():
            file = files[name]
            if file not in handles:
                try:
                    handles[file] = safe_open(str(file), framework="pt", device="cpu")
                except Exception as e:
                    raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from e
            handle = handles[file]
            shape = tuple(handle.get_slice(name).get_shape())
            if shape != tuple(param.shape):
                raise CheckpointError(f"{path}: tensor {name} has shape {list(shape)}, expected {list(param.shape)}")
            _set_tensor(model, name, handle.get_tensor(name).to(device=device, dtype=dtype))
    finally:
        handles.clear()
    model.tie_weights()


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    load_tokenizer: bool = True,
) -> LoopedLM:
    """Load the checkpoint folder ``path``; ``dtype`` defaults to the config's ``torch_dtype``."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    raw = read_config(path)
    with torch.device("meta"):
        model = build_model(raw)
    dtype = dtype or _default_dtype(raw)
    device = torch.device(device)
    load_state(model, path, dtype, device)
    model.materialize_buffers(device)
    model.eval().requires_grad_(False)
    model.checkpoint_path = str(path)
    model.generation_config = _read_json(path / "generation_config.json")
    model.tokenizer = load_tokenizer_from(path) if load_tokenizer else None
    return model


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable JSON ({e})") from e


def load_tokenizer_from(path: Path):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # AutoTokenizer complains that our config.json is not a transformers model
    try:
        with warnings.catch_warnings():  # nor do its deprecations of config keys (rope_scaling) concern us here
            warnings.simplefilter("ignore", FutureWarning)
            return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: tokenizer files present but unreadable ({e})") from e
    finally:
        hf_logging.set_verbosity(previous)
