"""Which model class serves a checkpoint, from its config.json ``model_type`` / ``architectures``."""

from __future__ import annotations

from rlt_compile.models.base import LoopedLM
from rlt_compile.models.huginn import HuginnConfig, HuginnForCausalLM
from rlt_compile.models.nanbeige import NanbeigeConfig, NanbeigeForCausalLM
from rlt_compile.models.ouro import OuroConfig, OuroForCausalLM

# family -> (model class, config class, model_type values, architectures values)
FAMILIES = {
    "ouro": (OuroForCausalLM, OuroConfig, {"ouro"}, {"OuroForCausalLM"}),
    "nanbeige": (NanbeigeForCausalLM, NanbeigeConfig, {"nanbeige"}, {"NanbeigeForCausalLM"}),
    "huginn": (HuginnForCausalLM, HuginnConfig, {"huginn_raven", "raven"}, {"RavenForCausalLM"}),
}


class UnknownModelError(ValueError):
    pass


def family_of(raw_config: dict) -> str:
    model_type = raw_config.get("model_type")
    architectures = set(raw_config.get("architectures") or [])
    for family, (_, _, types, archs) in FAMILIES.items():
        if model_type in types or architectures & archs:
            return family
    known = sorted(t for _, _, types, _ in FAMILIES.values() for t in types)
    raise UnknownModelError(
        f"unknown model_type {model_type!r} (architectures {sorted(architectures)}); supported model_type values: {known}"
    )


def build_model(raw_config: dict) -> LoopedLM:
    model_cls, config_cls, _, _ = FAMILIES[family_of(raw_config)]
    return model_cls(config_cls.from_dict(raw_config))
