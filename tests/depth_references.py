"""Reference decoders for the depth tests: one sequence, token by token, through the model's own
forward, so batched / engine paths can be compared with what the model does alone."""

from __future__ import annotations

import torch

from rlt_compile.kernels.metadata import build_metadata


def decode_alone(model, prompt, n, prefill_options: dict, decode_options: dict, max_steps=None) -> list[int]:
    """Prefill ``prompt`` with ``prefill_options``, then decode ``n - 1`` tokens one at a time."""
    blocks = -(-(len(prompt) + n) // 16)
    planes = model.allocate_kv_cache(blocks, 16, max_steps=max_steps)
    table = [list(range(blocks))]
    meta = build_metadata([len(prompt)], [0], table, 16)
    last = torch.tensor([len(prompt) - 1])
    logits = model(torch.tensor(prompt), torch.arange(len(prompt)), planes, meta, last, **prefill_options)
    tokens = [int(logits[0].argmax())]
    for i in range(n - 1):
        pos = len(prompt) + i
        meta = build_metadata([1], [pos], table, 16)
        logits = model(torch.tensor(tokens[-1:]), torch.tensor([pos]), planes, meta, **decode_options)
        tokens.append(int(logits[0].argmax()))
    return tokens


def ouro_last_exited(model, prompt, n, **policy) -> list[int]:
    """Full-depth prefill (its token read at the policy's exit step), then decode with the policy
    and the "last-exited" KV layout."""
    return decode_alone(model, prompt, n, policy, {"kv_layout": "last-exited", **policy})


def huginn_alone(model, prompt, n, num_steps=4, exit_threshold=None, min_steps=1) -> list[int]:
    """Zero initial state; decode tokens optionally stop early by the latent-diff criterion."""
    base = {"num_steps": num_steps, "init_scale": 0.0}
    adaptive = {"exit_criterion": "latent-diff", "exit_threshold": exit_threshold, "min_steps": min_steps}
    return decode_alone(model, prompt, n, base, {**base, **(adaptive if exit_threshold else {})}, max_steps=4)
