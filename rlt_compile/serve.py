"""OpenAI-compatible HTTP server for a checkpoint folder.

    python -m rlt_compile.serve --model DIR [--host 127.0.0.1 --port 8000 --api-key KEY --max-num-seqs 64]

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus text). See docs/serving.md. On SIGINT/SIGTERM the server stops accepting
connections, gives in-flight requests ``--drain-timeout`` seconds to finish, then aborts the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

import uvicorn

from rlt_compile.generate import parse_buckets, parse_model_option


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlt_compile.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint folder (HF format)")
    p.add_argument("--served-model-name", action="append", default=None, help="name(s) clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per batch (engine default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-queue-size", type=int, default=None, help="waiting sequences before 503 (default: unbounded)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (default: from memory)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--compile", action="store_true", help="run the compiled step (rlt_compile.compiler)")
    p.add_argument("--cuda-graphs", action="store_true", help="replay decode steps as CUDA graphs")
    p.add_argument("--cuda-graph-prefill-tokens", type=parse_buckets, default=None, metavar="N,N,...|off",
                   help="with --cuda-graphs: token buckets of the prefill / mixed-step graphs (default on the "
                        "GPU: 128,256,512,1024,2048; off: none)")  # fmt: skip
    p.add_argument("--model-option", type=parse_model_option, action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--seed", type=int, default=None, help="engine seed for unseeded requests")
    p.add_argument(
        "--generation-config",
        choices=("auto", "vllm"),
        default=None,
        help="sampling defaults: the checkpoint's generation_config.json (auto, default) or none (vllm)",
    )
    p.add_argument("--async-scheduling", action="store_true", help="prepare step n+1 while step n runs")
    p.add_argument("--depth-batching", action="store_true", help="decode tokens advance one loop step per step")
    p.add_argument("--wavefront-prefill-chunk", type=int, default=None, help="wavefront chunked prefill chunk size")
    p.add_argument("--speculative-num-draft", type=int, default=None, help="self-speculation: drafts per step")
    p.add_argument("--speculative-draft-steps", type=int, default=None, help="self-speculation: draft loop steps")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get at shutdown")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p


def engine_options(args: argparse.Namespace) -> dict:
    """LLM keyword options from the parsed arguments (only the ones given)."""
    options: dict = {
        "device": args.device,
        "dtype": args.dtype,
        "compile": args.compile,
        "use_cuda_graphs": args.cuda_graphs,
        "model_options": dict(args.model_option),
    }
    for name in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "max_queue_size",
        "num_blocks",
        "block_size",
        "gpu_memory_utilization",
        "scheduling_policy",
        "seed",
        "generation_config",
        "speculative_num_draft",
        "speculative_draft_steps",
        "wavefront_prefill_chunk",
        "cuda_graph_prefill_tokens",
    ):
        value = getattr(args, name)
        if value is not None:
            options[name] = value
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    if args.async_scheduling:
        options["async_scheduling"] = True
    if args.depth_batching:
        options["depth_batching"] = True
    return options


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains the engine while uvicorn waits for connections to close: in-flight
    requests get ``drain_timeout`` seconds, then are aborted, so their streams end properly
    (``finish_reason: abort``, ``data: [DONE]``) instead of being cut when uvicorn gives up."""

    def __init__(self, config: uvicorn.Config, async_engine, drain_timeout: float):
        super().__init__(config)
        self.async_engine, self.drain_timeout = async_engine, drain_timeout

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.create_task(self.async_engine.shutdown(self.drain_timeout))
        await super().shutdown(sockets)
        await drain


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rlt_compile.server.app import build_app

    try:
        app = build_app(
            model=args.model,
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            drain_timeout=args.drain_timeout,
            **engine_options(args),
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(args.drain_timeout) + 5,  # a backstop: the engine drains first
    )
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the signal after its graceful shutdown
        DrainingServer(config, app.state.async_engine, args.drain_timeout).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
