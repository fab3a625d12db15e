"""rlt_compile: compiler-centric inference for looped (recurrent-depth) language models.

Public API (see README.md and docs/):

* ``load_model(path, dtype=None, device="cpu")``: an HF-format checkpoint folder -> model
* ``compile_model(model, platform="auto", **options)``: torch.compile + our passes + Inductor
* ``LLM(model_or_dir, **engine_options).generate(prompts, SamplingParams(...))``: the engine
* ``tensor_parallel(model)``, ``send_kv`` / ``recv_kv``: several processes on torch.distributed
"""

from rlt_compile.compiler import CompiledModel, compile_model
from rlt_compile.distributed import recv_kv, send_kv, tensor_parallel
from rlt_compile.engine import LLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams
from rlt_compile.kernels import AttentionMetadata, build_metadata
from rlt_compile.models import CheckpointError, LoopedLM, load_model
from rlt_compile.platform import Platform, current_platform, get_platform

__all__ = [
    "LLM",
    "AttentionMetadata",
    "CheckpointError",
    "CompiledModel",
    "EngineConfig",
    "LLMEngine",
    "LoopedLM",
    "Platform",
    "RequestOutput",
    "SamplingParams",
    "build_metadata",
    "compile_model",
    "current_platform",
    "get_platform",
    "load_model",
    "recv_kv",
    "send_kv",
    "tensor_parallel",
]
