"""rlt_compile: compiler-centric inference for looped (recurrent-depth) language models."""

from rlt_compile.kernels import AttentionMetadata, build_metadata
from rlt_compile.models import CheckpointError, LoopedLM, load_model

__all__ = ["AttentionMetadata", "CheckpointError", "LoopedLM", "build_metadata", "load_model"]
from rlt_compile.engine import LLM, SamplingParams  # noqa: E402

__all__ += ["LLM", "SamplingParams"]
