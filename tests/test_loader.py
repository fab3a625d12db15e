"""Checkpoint loading: family detection, sharded files, dtype/device, and every error named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import FAMILIES
from safetensors.torch import load_file, save_file

from rlt_compile import CheckpointError, load_model
from rlt_compile.models import HuginnForCausalLM, NanbeigeForCausalLM, OuroForCausalLM, UnknownModelError
from rlt_compile.models.config import UnsupportedConfigError
from rlt_compile.models.runner import forward_sequences
from rlt_compile.tiny import write_tiny_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    return write_tiny_checkpoint("ouro", tmp_path / "ouro", seed=2, with_tokenizer=False)


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_weights(path, fn):
    state = load_file(str(path / "model.safetensors"))
    fn(state)
    save_file(state, str(path / "model.safetensors"))


@pytest.mark.parametrize(
    ("family", "cls"), [("ouro", OuroForCausalLM), ("nanbeige", NanbeigeForCausalLM), ("huginn", HuginnForCausalLM)]
)
def test_family_detection_and_weights_loaded(tiny_dirs, family, cls):
    model = load_model(tiny_dirs[family])
    assert isinstance(model, cls)
    state = load_file(str(tiny_dirs[family] / "model.safetensors"))
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, state[name], rtol=0, atol=0)
    assert model.tokenizer is not None and model.tokenizer.eos_token == "<|im_end|>"
    assert model.inv_freq.abs().min() > 0  # rebuilt after meta-device construction


def test_tokenizer_load_warns_nothing_about_the_model_config(tiny_dirs, recwarn):
    """AutoTokenizer parses config.json to pick a tokenizer class; deprecations it finds there (e.g.
    transformers 5 on ``rope_scaling``) are not the user's concern when we load our own models."""
    load_model(tiny_dirs["ouro"])
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)], [str(w.message) for w in recwarn]


def test_family_from_architectures_only(ckpt):
    edit_config(ckpt, model_type="something_else")
    assert isinstance(load_model(ckpt), OuroForCausalLM)


def test_dtype_and_tied_embeddings(tiny_dirs):
    model = load_model(tiny_dirs["huginn"], dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight


def test_sharded_checkpoint_matches_single_file(ckpt, tmp_path):
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(ckpt / "config.json", sharded / "config.json")
    state = load_file(str(ckpt / "model.safetensors"))
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(sharded / fname))
        weight_map.update(dict.fromkeys(keys, fname))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a, b = load_model(ckpt), load_model(sharded)
    prompt = [[4, 8, 15, 16, 23, 42]]
    torch.testing.assert_close(forward_sequences(a, prompt)[0][0], forward_sequences(b, prompt)[0][0], rtol=0, atol=0)


def test_unknown_model_type(ckpt):
    edit_config(ckpt, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(UnknownModelError, match="unknown model_type 'llama'"):
        load_model(ckpt)


def test_missing_tensor_is_named(ckpt):
    edit_weights(ckpt, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    edit_weights(ckpt, lambda s: s.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model\.layers\.0\.extra\.weight"):
        load_model(ckpt)


def test_shape_mismatch_names_expected_and_found(ckpt):
    edit_weights(ckpt, lambda s: s.update({"lm_head.weight": torch.zeros(100, 64)}))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight has shape \[100, 64\], expected \[256, 64\]"):
        load_model(ckpt)


def test_unreadable_weights_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00garbage not a safetensors file")
    with pytest.raises(CheckpointError, match="unreadable safetensors file"):
        load_model(ckpt)


def test_unreadable_or_missing_config(ckpt, tmp_path):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable config.json"):
        load_model(ckpt)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tmp_path / "nope")


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(ckpt)


def test_missing_required_config_key(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="required key 'hidden_size'"):
        load_model(ckpt)


@pytest.mark.parametrize(
    ("family", "key", "value"),
    [
        ("ouro", "use_sliding_window", True),
        ("ouro", "rope_scaling", {"type": "yarn", "factor": 4.0}),
        ("nanbeige", "qk_layernorm", True),
        ("nanbeige", "loop_share_kv", True),
        ("huginn", "injection_type", "add"),
        ("huginn", "test_time_noise", 1),
    ],
)
def test_unsupported_config_options_are_rejected(tmp_path, family, key, value):
    path = write_tiny_checkpoint(family, tmp_path / family, with_tokenizer=False)
    edit_config(path, **{key: value})
    with pytest.raises(UnsupportedConfigError, match=key):
        load_model(path)


@pytest.mark.parametrize("family", FAMILIES)
def test_huginn_style_derived_buffers_are_accepted(tmp_path, family):
    """A persistent RoPE table in the checkpoint (Huginn's freqs_cis) is recomputed, not an error."""
    path = write_tiny_checkpoint(family, tmp_path / family, with_tokenizer=False)
    edit_weights(path, lambda s: s.update({"freqs_cis": torch.zeros(1, 4, 1, 8, 2)}))
    load_model(path)
