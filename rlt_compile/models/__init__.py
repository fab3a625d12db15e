"""Model families in plain PyTorch, the checkpoint loader and the family registry."""

from rlt_compile.models.base import KVLayout, LoopedLM
from rlt_compile.models.huginn import HuginnConfig, HuginnForCausalLM
from rlt_compile.models.loader import CheckpointError, load_model
from rlt_compile.models.nanbeige import NanbeigeConfig, NanbeigeForCausalLM
from rlt_compile.models.ouro import OuroConfig, OuroForCausalLM
from rlt_compile.models.registry import FAMILIES, UnknownModelError, build_model, family_of

__all__ = [
    "FAMILIES",
    "CheckpointError",
    "HuginnConfig",
    "HuginnForCausalLM",
    "KVLayout",
    "LoopedLM",
    "NanbeigeConfig",
    "NanbeigeForCausalLM",
    "OuroConfig",
    "OuroForCausalLM",
    "UnknownModelError",
    "build_model",
    "family_of",
    "load_model",
]
