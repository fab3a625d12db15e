"""The serving engine: paged KV blocks, continuous-batching scheduler, sampler, LLM API."""

from rlt_compile.engine.config import EngineConfig
from rlt_compile.engine.llm import LLM
from rlt_compile.engine.llm_engine import LLMEngine, QueueFullError
from rlt_compile.engine.outputs import CompletionOutput, RequestOutput
from rlt_compile.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
]
