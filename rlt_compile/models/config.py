"""Reading a family's config.json into a typed config, rejecting options we do not implement."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

C = TypeVar("C")


class UnsupportedConfigError(ValueError):
    """A config.json asks for a feature this implementation does not have."""


def config_from_dict(cls: type[C], raw: dict[str, Any], rejected: dict[str, Any] | None = None) -> C:
    """Fill dataclass ``cls`` from ``raw`` (unknown keys ignored, missing required keys named).

    ``rejected`` maps a config key to the only value we accept for it (a callable returning True
    for accepted values also works); any other value raises ``UnsupportedConfigError``.
    """
    for key, accepted in (rejected or {}).items():
        if key not in raw:
            continue
        ok = accepted(raw[key]) if callable(accepted) else raw[key] == accepted
        if not ok:
            raise UnsupportedConfigError(
                f"{cls.__name__}: config option {key}={raw[key]!r} is not supported "
                f"(supported: {getattr(accepted, '__doc__', None) or repr(accepted)})"
            )
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name in raw and raw[field.name] is not None:
            kwargs[field.name] = raw[field.name]
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}: config.json lacks the required key {field.name!r}")
    return cls(**kwargs)


def is_null(value: Any) -> bool:
    """null / absent"""
    return value is None


class LlamaKeys:
    """Derived values of configs that use Llama's key names (Ouro, Nanbeige); the last four are the
    names ``LoopedLM`` reads (see models/base.py)."""

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    context_length = property(lambda self: self.max_position_embeddings)
    tied = property(lambda self: self.tie_word_embeddings)
    rope = property(lambda self: (self.dim_per_head, self.rope_theta))
