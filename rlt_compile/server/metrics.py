"""Server metrics in the Prometheus text exposition format (written by hand, no client library).

Counters and histograms are updated by the engine thread (steps, tokens, finished requests) and by
HTTP handlers (rejected requests); gauges (queue depth, running sequences, KV usage) are snapshots
the engine thread takes after each loop iteration, so ``/metrics`` never touches engine state.
Every name starts with ``rlt_``; see docs/serving.md for the list.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import defaultdict

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: dict[str, str]) -> list[str]:
        out, running = [], 0
        for bound, c in zip((*self.bounds, math.inf), self.counts):
            running += c
            out.append(f"{name}_bucket{_labels({**labels, 'le': _fmt(bound)})} {running}")
        out.append(f"{name}_sum{_labels(labels)} {_fmt(self.sum)}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


class ServerMetrics:
    def __init__(self, model_name: str = ""):
        self.model_name = model_name
        self._lock = threading.Lock()
        self.requests_received = 0
        self.requests_finished: dict[str, int] = defaultdict(int)  # finish reason -> count
        self.requests_rejected: dict[str, int] = defaultdict(int)  # HTTP status -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.preemptions = 0
        self.spec_drafted = 0  # self-speculation (engine speculative_num_draft > 0)
        self.spec_accepted = 0
        # gauges (snapshots from the engine thread)
        self.num_requests = 0
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.kv_blocks = 0
        self.prefix_cache_hit_rate = 0.0
        self.step_seconds = Histogram(STEP_BUCKETS)
        self.ttft_seconds = Histogram(LATENCY_BUCKETS)
        self.e2e_seconds = Histogram(LATENCY_BUCKETS)

    # -- updates -------------------------------------------------------------------------------
    def request_received(self, prompt_tokens: int) -> None:
        with self._lock:
            self.requests_received += 1
            self.prompt_tokens += prompt_tokens

    def request_rejected(self, status: int) -> None:
        with self._lock:
            self.requests_rejected[str(status)] += 1

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_seconds.observe(seconds)

    def request_finished(self, reason: str, seconds: float) -> None:
        with self._lock:
            self.requests_finished[reason] += 1
            self.e2e_seconds.observe(seconds)

    def step(self, seconds: float, generated: int) -> None:
        with self._lock:
            self.steps += 1
            self.generation_tokens += generated
            self.step_seconds.observe(seconds)

    def snapshot(self, engine) -> None:
        """Copy the engine's gauges (call from the engine thread)."""
        sched, bm = engine.scheduler, engine.block_manager
        with self._lock:
            self.num_requests = engine.num_unfinished()
            self.num_running = len(sched.running)
            self.num_waiting = sched.num_waiting
            self.kv_usage = bm.usage
            self.kv_blocks = bm.num_blocks
            self.prefix_cache_hit_rate = bm.stats.hit_rate
            self.preemptions = engine.stats.preemptions
            self.spec_drafted = engine.stats.spec_drafted
            self.spec_accepted = engine.stats.spec_accepted

    # -- exposition ----------------------------------------------------------------------------
    def render(self) -> str:
        base = {"model_name": self.model_name} if self.model_name else {}
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{_labels({**base, **labels})} {_fmt(value)}")

        def histogram(name: str, help_: str, h: Histogram) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} histogram")
            lines.extend(h.lines(name, base))

        with self._lock:
            metric(
                "rlt_requests_received_total",
                "counter",
                "Requests accepted by the engine.",
                [({}, self.requests_received)],
            )
            finished = sorted(self.requests_finished.items()) or [("stop", 0)]
            metric(
                "rlt_requests_finished_total",
                "counter",
                "Requests finished, by finish reason (stop, length, abort).",
                [({"finish_reason": r}, c) for r, c in finished],
            )
            rejected = sorted(self.requests_rejected.items()) or [("400", 0)]
            metric(
                "rlt_requests_rejected_total",
                "counter",
                "Requests answered with an error, by HTTP status.",
                [({"status": s}, c) for s, c in rejected],
            )
            metric(
                "rlt_requests_in_flight",
                "gauge",
                "Requests in the engine (waiting or running).",
                [({}, self.num_requests)],
            )
            metric(
                "rlt_requests_running", "gauge", "Sequences scheduled in the running batch.", [({}, self.num_running)]
            )
            metric(
                "rlt_requests_waiting",
                "gauge",
                "Sequences waiting for admission (queue depth).",
                [({}, self.num_waiting)],
            )
            metric(
                "rlt_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", [({}, self.prompt_tokens)]
            )
            metric("rlt_generation_tokens_total", "counter", "Tokens generated.", [({}, self.generation_tokens)])
            metric(
                "rlt_kv_cache_usage_ratio",
                "gauge",
                "Fraction of KV cache blocks in use (0 to 1).",
                [({}, self.kv_usage)],
            )
            metric("rlt_kv_cache_blocks", "gauge", "KV cache blocks in the pool.", [({}, self.kv_blocks)])
            metric(
                "rlt_prefix_cache_hit_rate",
                "gauge",
                "Prefix cache hit rate over all admissions (blocks).",
                [({}, self.prefix_cache_hit_rate)],
            )
            metric("rlt_engine_steps_total", "counter", "Engine steps run.", [({}, self.steps)])
            metric("rlt_preemptions_total", "counter", "Sequences preempted (recompute).", [({}, self.preemptions)])
            metric(
                "rlt_spec_draft_tokens_total",
                "counter",
                "Self-speculation: draft tokens proposed.",
                [({}, self.spec_drafted)],
            )
            metric(
                "rlt_spec_accepted_tokens_total",
                "counter",
                "Self-speculation: draft tokens accepted by the verify pass.",
                [({}, self.spec_accepted)],
            )
            metric(
                "rlt_spec_acceptance_rate",
                "gauge",
                "Self-speculation: accepted / drafted tokens (0 when nothing was drafted).",
                [({}, self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0)],
            )
            histogram("rlt_step_seconds", "Wall time of one engine step.", self.step_seconds)
            histogram(
                "rlt_time_to_first_token_seconds", "Time from arrival to the first output token.", self.ttft_seconds
            )
            histogram("rlt_request_seconds", "Time from arrival to the end of a request.", self.e2e_seconds)
        return "\n".join(lines) + "\n"
