"""SamplingParams: how one request is decoded (length, randomness, stops, logprobs, n).

Every field is validated when the object is built (and again at ``add_request``); a bad value raises
``ValueError`` whose message starts with the field's name. Defaults follow vLLM: ``temperature=1.0``
(random sampling), ``max_tokens=16``; ``temperature=0`` means greedy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXIT_POLICIES = (None, "full", "threshold", "fixed")
# generation_config.json keys that set a checkpoint's sampling defaults -> SamplingParams fields (vLLM's)
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(generation_config: dict | None) -> dict:
    """The SamplingParams defaults a checkpoint's generation_config.json sets (vLLM's
    ``--generation-config auto``): the keys of ``GENERATION_CONFIG_KEYS`` that it has."""
    config = generation_config or {}
    return {name: config[key] for key, name in GENERATION_CONFIG_KEYS.items() if config.get(key) is not None}


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF rule, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI rule, over output tokens: minus this once per token seen
    frequency_penalty: float = 0.0  # OpenAI rule, over output tokens: minus this per occurrence
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token (0: only the sampled one)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (vLLM's option)
    skip_special_tokens: bool = True
    # Depth (looped models): Ouro exit policy, per-request loop count (Huginn recurrences).
    exit_policy: str | None = None  # "full" | "threshold" | "fixed"; None: the engine's default
    exit_step: int | None = None  # the step "fixed" exits at (0-based)
    exit_threshold: float | None = None  # "threshold": cumulative exit probability (default: config's)
    num_steps: int | None = None  # loop steps / recurrences for this request (None: the engine's)
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.verify()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def verify(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
        )
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            f"must be >= 0, got {self.temperature!r}",
        )
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(
            isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
            "top_k",
            f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}",
        )
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        bias = self.logit_bias or {}
        _check(
            isinstance(bias, dict)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in bias)
            and all(_is_number(b) and -100 <= b <= 100 for b in bias.values()),
            "logit_bias",
            f"must map token ids (integers >= 0) to biases in [-100, 100], got {self.logit_bias!r}",
        )
        _check(
            self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer or None, got {self.seed!r}"
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0),
                name,
                f"must be None or an integer >= 0, got {value!r}",
            )
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        _check(all(isinstance(s, str) and s for s in stops), "stop", f"must be non-empty strings, got {self.stop!r}")
        self.stop_strings = stops
        ids = self.stop_token_ids or []
        _check(
            all(isinstance(t, int) and t >= 0 for t in ids),
            "stop_token_ids",
            f"must be non-negative integers, got {self.stop_token_ids!r}",
        )

        _check(
            self.exit_policy in EXIT_POLICIES,
            "exit_policy",
            f"must be one of {EXIT_POLICIES}, got {self.exit_policy!r}",
        )
        _check(
            self.exit_step is None or (isinstance(self.exit_step, int) and self.exit_step >= 0),
            "exit_step",
            f"must be an integer >= 0, got {self.exit_step!r}",
        )
        _check(
            self.exit_policy != "fixed" or self.exit_step is not None,
            "exit_step",
            "exit_policy='fixed' needs exit_step",
        )
        _check(
            self.exit_threshold is None or (_is_number(self.exit_threshold) and 0 < self.exit_threshold <= 1),
            "exit_threshold",
            f"must be in (0, 1], got {self.exit_threshold!r}",
        )
        _check(
            self.num_steps is None or (isinstance(self.num_steps, int) and self.num_steps >= 1),
            "num_steps",
            f"must be an integer >= 1, got {self.num_steps!r}",
        )

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's earlier tokens (the penalties)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before the distribution (penalties,
        logit bias): self-speculation's acceptance test does not model that."""
        return self.needs_history or bool(self.logit_bias)

    @property
    def has_depth_options(self) -> bool:
        return self.exit_policy is not None or self.num_steps is not None

    def clone(self, **changes) -> SamplingParams:
        values = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "stop_strings"}
        values.update(changes)
        return SamplingParams(**values)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
