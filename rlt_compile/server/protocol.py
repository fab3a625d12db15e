"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Only the request side is validated by pydantic (types, required fields); value ranges
(``max_tokens >= 1``, ``temperature >= 0`` ...) are checked by ``SamplingParams`` so the server and
the offline API reject the same things with the same messages. Responses are plain dicts built by
the helpers below, shaped like OpenAI's (``text_completion`` / ``chat.completion`` objects and
their ``*.chunk`` streaming forms).

Extensions beyond the OpenAI fields (vLLM-style): ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``priority`` (lower runs first under the priority policy), and the
looped-model depth options ``exit_policy``, ``exit_step``, ``exit_threshold`` (Ouro) and
``num_steps`` (Huginn recurrences) of docs/depth.md.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlt_compile.engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # JSON object keys are strings: token ids as text
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None
    exit_policy: str | None = None
    exit_step: int | None = None
    exit_threshold: float | None = None
    num_steps: int | None = None

    def _params(self, max_tokens: int, logprobs: int | None, defaults: dict) -> SamplingParams:
        """SamplingParams for this request, ``defaults`` (the engine's generation-config defaults)
        where it sets nothing; raises ValueError naming the bad field."""
        values: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": logprobs,
            "exit_policy": self.exit_policy,
            "exit_step": self.exit_step,
            "exit_threshold": self.exit_threshold,
            "num_steps": self.num_steps,
            "logit_bias": self._logit_bias(),
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                values[name] = value
        return SamplingParams(**values)

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise ValueError(f"logit_bias: keys must be token ids, got {list(self.logit_bias)[:5]}") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # default: the generation config's max_new_tokens, else 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    return_token_ids: bool = False  # extension: add each choice's generated token ids

    def sampling_params(self, defaults: dict) -> SamplingParams:
        """With ``echo`` and ``logprobs`` the prompt tokens get logprobs too (``prompt_logprobs``)."""
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        max_tokens = self.max_tokens if self.max_tokens is not None else defaults.get("max_tokens", 16)
        params = self._params(max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = self.logprobs
            params.verify()
        return params

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt: empty list")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The message for ``apply_chat_template``: content parts joined into one string."""
        data = self.model_dump(exclude_none=True)
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("messages: only text content parts are supported")
                texts.append(part["text"])
            data["content"] = "\n".join(texts)
        elif content is None:
            data["content"] = ""
        return data


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Declared only to be refused: ignoring them would answer a different question than was asked.
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def sampling_params(self, default_max_tokens: int, defaults: dict) -> SamplingParams:
        """Without max_tokens or max_completion_tokens: ``default_max_tokens`` (the room left in the
        context), at most the generation config's max_new_tokens."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            max_tokens = min(default_max_tokens, defaults.get("max_tokens", default_max_tokens))
        if self.tools:
            raise ValueError("tools: tool / function calling is not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format: only {'type': 'text'} is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._params(max_tokens, logprobs, defaults)
        except ValueError as e:
            msg = str(e)
            if msg.startswith("logprobs:"):
                raise ValueError("top_logprobs:" + msg[len("logprobs:") :]) from None
            if msg.startswith("max_tokens:") and self.max_completion_tokens is not None:
                raise ValueError("max_completion_tokens:" + msg[len("max_tokens:") :]) from None
            raise


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a text ``prompt``, or chat ``messages`` through the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


# -- responses ------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


FinishReason = Literal["stop", "length", "abort"] | None


def model_card(name: str, max_model_len: int, created: int) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "rlt_compile",
        "root": name,
        "parent": None,
        "max_model_len": max_model_len,
    }
