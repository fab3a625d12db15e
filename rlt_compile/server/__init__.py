"""OpenAI-compatible HTTP serving: ``build_app`` (FastAPI), ``AsyncEngine`` (engine thread), metrics."""

from rlt_compile.server.app import build_app
from rlt_compile.server.async_engine import AsyncEngine, EngineStoppedError
from rlt_compile.server.metrics import ServerMetrics

__all__ = ["AsyncEngine", "EngineStoppedError", "ServerMetrics", "build_app"]
