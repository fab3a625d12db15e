"""What the engine hands back: RequestOutput with one CompletionOutput per requested completion.

``LLMEngine.step`` streams *deltas*: each CompletionOutput carries only the tokens, text and
logprobs produced since the request's previous output. ``RequestOutput.merge`` folds deltas into
the full result (what ``LLM.generate`` returns).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.cumulative_logprob is not None:
            self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first completion)
    # SamplingParams.prompt_logprobs: per prompt token {token id: logprob} (None for the first), in
    # the first output after the whole prompt was computed
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def merge(self, delta: RequestOutput) -> None:
        by_index = {c.index: c for c in self.outputs}
        for c in delta.outputs:
            if c.index in by_index:
                by_index[c.index].merge(c)
            else:
                fresh = CompletionOutput(c.index)
                fresh.merge(c)
                self.outputs.append(fresh)
                by_index[c.index] = fresh
        self.outputs.sort(key=lambda c: c.index)
        self.finished = delta.finished
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
