"""``python -m rlt_compile.serve``: argument mapping, and a real process that serves a tiny checkpoint
and shuts down gracefully on SIGINT (an in-flight stream past the drain timeout ends with
``finish_reason: abort`` and ``data: [DONE]``; the process exits 0)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from rlt_compile.serve import build_parser, engine_options

ROOT = Path(__file__).resolve().parents[1]


def test_cli_options_map_to_engine_config():
    args = build_parser().parse_args(
        [
            "--model",
            "m",
            "--max-num-seqs",
            "8",
            "--max-queue-size",
            "4",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--no-prefix-caching",
            "--model-option",
            "exit_at_step=2",
            "--speculative-num-draft",
            "3",
            "--speculative-draft-steps",
            "1",
        ]
    )
    options = engine_options(args)
    assert options["max_num_seqs"] == 8 and options["max_queue_size"] == 4
    assert options["device"] == "cpu" and options["dtype"] == "float32"
    assert options["enable_prefix_caching"] is False
    assert options["model_options"] == {"exit_at_step": 2}
    assert options["speculative_num_draft"] == 3 and options["speculative_draft_steps"] == 1
    assert "num_blocks" not in options  # only what was given
    from rlt_compile.engine import EngineConfig

    config, rest = EngineConfig.split_options({k: v for k, v in options.items() if k not in ("device", "dtype")})
    assert not rest and config.speculative_num_draft == 3
    assert engine_options(build_parser().parse_args(["--model", "m", "--async-scheduling"]))["async_scheduling"]
    assert engine_options(build_parser().parse_args(["--model", "m", "--depth-batching"]))["depth_batching"]
    args = build_parser().parse_args(["--model", "m", "--wavefront-prefill-chunk", "64"])
    assert engine_options(args)["wavefront_prefill_chunk"] == 64
    args = build_parser().parse_args(["--model", "m", "--generation-config", "vllm"])
    assert engine_options(args)["generation_config"] == "vllm"
    args = build_parser().parse_args(["--model", "m", "--cuda-graphs", "--cuda-graph-prefill-tokens", "64,16"])
    assert engine_options(args)["cuda_graph_prefill_tokens"] == [64, 16]
    assert "cuda_graph_prefill_tokens" not in engine_options(build_parser().parse_args(["--model", "m"]))
    args = build_parser().parse_args(["--model", "m", "--cuda-graphs", "--cuda-graph-prefill-tokens", "off"])
    assert engine_options(args)["cuda_graph_prefill_tokens"] == []


def test_serve_process_streams_and_shuts_down_gracefully(tiny_dirs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "rlt_compile.serve",
        "--model",
        str(tiny_dirs["ouro"]),
        "--port",
        str(port),
        "--device",
        "cpu",
        "--num-blocks",
        "64",
        "--served-model-name",
        "tiny",
        "--drain-timeout",
        "0.5",
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        reader.join(10)
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])["choices"][0]
        assert last["finish_reason"] == "abort"
        assert len(events) < 500
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
