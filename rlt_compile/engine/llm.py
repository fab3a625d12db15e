"""LLM: the offline batch API over LLMEngine.

    llm = LLM("path/to/Ouro-1.4B", dtype=torch.bfloat16, device="cuda", max_num_seqs=128)
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text
    llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=16))

``model_or_dir`` is a checkpoint folder (loaded with ``load_model``) or an already built model.
Keyword options are ``EngineConfig`` fields (``max_num_seqs``, ``num_blocks``, ``compile``,
``use_cuda_graphs``, ``model_options`` ...) plus ``dtype``, ``device`` and ``tokenizer``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC
from pathlib import Path

import torch

from rlt_compile.engine.config import EngineConfig
from rlt_compile.engine.llm_engine import LLMEngine
from rlt_compile.engine.outputs import RequestOutput
from rlt_compile.engine.sampling_params import SamplingParams
from rlt_compile.models.base import LoopedLM


def _dtype(value) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).replace("torch.", "")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    dtype = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: unknown dtype {value!r}")
    return dtype


class LLM:
    def __init__(self, model_or_dir: str | Path | LoopedLM, **options):
        dtype = _dtype(options.pop("dtype", None))
        device = options.pop("device", None)
        tokenizer = options.pop("tokenizer", None)
        tensor_parallel_size = int(options.pop("tensor_parallel_size", 1))
        config, unknown = EngineConfig.split_options(options)
        if unknown:
            raise TypeError(f"LLM: unknown option(s) {sorted(unknown)}")
        if isinstance(model_or_dir, str | Path):
            from rlt_compile.models.loader import load_model

            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            model = load_model(model_or_dir, dtype=dtype, device=device)
        else:
            model = model_or_dir
            if dtype is not None or device is not None:
                model = model.to(device=device, dtype=dtype)
        if tensor_parallel_size > 1:
            model = _shard(model, tensor_parallel_size)
        self.model = model
        self.engine = LLMEngine(model, config, tokenizer=tokenizer)
        self.tokenizer = self.engine.tokenizer
        self.last_run_seconds = 0.0
        self.last_first_token_seconds: float | None = None  # from the last run's start to its first output token

    def generate(
        self,
        prompts: str | dict | list[str] | list[list[int]] | list[dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        An invalid prompt raises ValueError before anything runs (requests already queued by
        this call are withdrawn).
        """
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts), self.engine.default_sampling_params(), "sampling_params")
        priorities = _per_prompt(priority, len(prompts), 0, "priority")
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priorities):
                ids.append(self.engine.add_request(None, prompt, p, priority=prio))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            chat_prompt_ids(self.tokenizer, conv, add_generation_prompt, chat_template_kwargs) for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        start = time.perf_counter()
        self.last_first_token_seconds = None
        generated = 0
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id not in wanted:
                    continue
                new_tokens = sum(len(c.token_ids) for c in out.outputs)
                if new_tokens and self.last_first_token_seconds is None:
                    self.last_first_token_seconds = time.perf_counter() - start
                generated += new_tokens
                if out.request_id in results:
                    results[out.request_id].merge(out)
                else:
                    results[out.request_id] = out
                if out.finished and bar is not None:
                    bar.update(1)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"output {generated / max(elapsed, 1e-9):.1f} tok/s")
        if bar is not None:
            bar.close()
        self.last_run_seconds = time.perf_counter() - start
        return [results[i] for i in ids]


def _shard(model: LoopedLM, size: int) -> LoopedLM:
    """Tensor parallelism: every rank (started by torchrun) holds 1/size of the heads and runs the
    same schedule, so all ranks sample the same tokens."""
    from rlt_compile.distributed import init_distributed, tensor_parallel

    _, world = init_distributed()
    if world != size:
        raise ValueError(f"tensor_parallel_size: {size} but the process group has {world} ranks (use torchrun)")
    return tensor_parallel(model)


def chat_prompt_ids(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None
) -> list[int]:
    """The prompt token ids of a conversation: the tokenizer's chat template as text, then encoded
    without special tokens (the template writes them). ValueError (``messages: ...``) when there is
    no template or it fails on these messages. ``LLM.chat`` and the server's chat and /tokenize use it."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model has no chat template")
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    except Exception as e:
        raise ValueError(f"messages: cannot apply the chat template: {e}") from e


def _as_prompt_list(prompts) -> list:
    """Prompts as strings or token-id lists; vLLM's dict forms ``{"prompt": text}`` and
    ``{"prompt_token_ids": ids}`` are accepted too."""
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    elif isinstance(prompts, SequenceABC) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    return [_unwrap_prompt(p) for p in prompts]


def _unwrap_prompt(prompt):
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt"}:
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"}:
        return list(prompt["prompt_token_ids"])
    raise ValueError(f"prompt: a dict prompt has either 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")


def _per_prompt(value, count: int, default, name: str) -> list:
    if value is None:
        return [default] * count
    if isinstance(value, list | tuple):
        if len(value) != count:
            raise ValueError(f"{name}: {len(value)} values for {count} prompts")
        return list(value)
    return [value] * count
