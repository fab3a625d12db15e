"""Tiny random checkpoints of each family, with a tiny word-level tokenizer, for tests and examples.

``python -m rlt_compile.tiny --family ouro --out DIR`` writes an HF-format folder (config.json,
model.safetensors, tokenizer files with a chat template) that ``load_model`` reads like a real one.
No download is involved: the tokenizer is built locally with the ``tokenizers`` library.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlt_compile.models.registry import build_model

SPECIAL_TOKENS = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
WORDS = (
    "the a an of to and in is was it that for on with as by at from this be are or his her their "
    "capital france paris city river sea sun moon star light dark day night time year people world "
    "small large new old good bad first last long short high low red blue green white black cat dog "
    "bird fish tree water fire earth air stone gold iron book word name story song music art math "
    "one two three four five six seven eight nine ten hello yes no what who where when why how "
    "model loop step token layer cache graph kernel compile fast slow run think answer question"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)

TINY_CONFIGS = {
    "ouro": {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "vocab_size": 256,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "rope_scaling": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    },
    "nanbeige": {
        "architectures": ["NanbeigeForCausalLM"],
        "model_type": "nanbeige",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_loops": 2,
        "loop_loss_weights": [],
        "skip_loop_final_norm": False,
        "vocab_size": 256,
        "rope_theta": 70000000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "rope_scaling": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    },
    "huginn": {
        "architectures": ["RavenForCausalLM"],
        "model_type": "huginn_raven",
        "n_embd": 64,
        "n_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 256,
        "padded_vocab_size": 256,
        "n_layers_in_prelude": 1,
        "n_layers_in_recurrent_block": 2,
        "n_layers_in_coda": 1,
        "mean_recurrence": 4,
        "qk_bias": True,
        "tie_embeddings": True,
        "norm_eps": 1e-6,
        "rope_base": 50000,
        "block_size": 512,
        "injection_type": "linear",
        "bias": False,
        "test_time_noise": 0,
        "init_values": {"embed_scale": 8.0, "std": 0.0790569415},
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    },
}


def tiny_config(family: str, **overrides) -> dict:
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(TINY_CONFIGS)}")
    return {**TINY_CONFIGS[family], **overrides}


def random_state_dict(raw_config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights: norms near 1, everything else small normal, drawn in a fixed order."""
    with torch.device("meta"):
        model = build_model(raw_config)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith("ln_f.weight"):
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            value = 0.08 * torch.randn(p.shape, generator=gen)
        state[name] = value.contiguous()
    return state


def build_tokenizer(vocab_size: int):
    """A whitespace word-level tokenizer: special tokens, words, then filler entries up to vocab_size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = SPECIAL_TOKENS + WORDS
    names += [f"w{i}" for i in range(vocab_size - len(names))]
    vocab = {tok: i for i, tok in enumerate(names[:vocab_size])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def write_tiny_checkpoint(
    family: str, out: str | Path, seed: int = 0, with_tokenizer: bool = True, **overrides
) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_config(family, **overrides)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(random_state_dict(raw, seed), str(out / "model.safetensors"))
    if with_tokenizer:
        build_tokenizer(raw["vocab_size"]).save_pretrained(str(out))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="ouro", choices=sorted(TINY_CONFIGS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_tiny_checkpoint(args.family, args.out, args.seed))


if __name__ == "__main__":
    main()
