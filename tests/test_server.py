"""The OpenAI-compatible server on a tiny Ouro checkpoint (CPU): the official ``openai`` client,
SSE streaming, 64 concurrent requests against offline ``LLM.generate``, OpenAI-style errors,
abort on client disconnect, /metrics and /health, and the async engine's graceful shutdown.

Each server runs in uvicorn on 127.0.0.1 with a free port, in a background thread of the test."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from rlt_compile import LLM, SamplingParams, load_model
from rlt_compile.engine import LLMEngine
from rlt_compile.server import AsyncEngine, EngineStoppedError, build_app
from rlt_compile.tiny import WORDS

MODEL = "tiny-ouro"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "the capital of france is a city on the river"
MESSAGES = [{"role": "user", "content": "hello what is the capital of france"}]


class Server:
    """uvicorn serving ``app`` in a daemon thread on a free local port."""

    def __init__(self, app):
        self.app = app
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine(self) -> LLMEngine:
        return self.app.state.engine


@pytest.fixture(scope="module")
def tiny_dir(tiny_dirs):
    return tiny_dirs["ouro"]


@pytest.fixture(scope="module")
def server(tiny_dir):
    llm = LLM(str(tiny_dir), device="cpu", num_blocks=160, max_num_seqs=64)
    with Server(build_app(llm, served_model_name=MODEL, api_key=KEY)) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_dir):
    return LLM(str(tiny_dir), device="cpu", num_blocks=160, max_num_seqs=64)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def offline_text(llm: LLM, prompt, **params) -> str:
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0].text


def assert_serving(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: ") :])
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


# -- the openai client --------------------------------------------------------------------------
def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "rlt_compile"


def test_completion_matches_offline(client, offline):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == offline_text(offline, PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    prompt_tokens = len(offline.tokenizer.encode(PROMPT))
    assert r.usage.prompt_tokens == prompt_tokens
    assert r.usage.total_tokens == prompt_tokens + r.usage.completion_tokens


def test_completion_token_ids_prompt_batch_and_n(client, offline):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    r = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        want = offline_text(offline, [prompt], max_tokens=5, temperature=0, ignore_eos=True)
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == want
    assert r.usage.completion_tokens == 20


def test_depth_options_pass_through_to_the_engine(client, offline, http):
    """Looped-model extensions: an Ouro exit policy per request, same as offline; bad ones are 400s."""
    depth = {"exit_policy": "fixed", "exit_step": 0, "ignore_eos": True}
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body=depth)
    want = offline_text(offline, PROMPT, max_tokens=6, temperature=0, **depth)
    assert r.choices[0].text == want
    assert want != offline_text(offline, PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
    bad = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "exit_policy": "fixed"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "exit_step"


def test_openai_penalties_and_logit_bias_pass_through(client, offline):
    """presence / frequency penalties and a logit bias (string token ids, as the openai client sends
    them) give what the offline API gives with the same SamplingParams, and change the text."""
    adjust = {"presence_penalty": 1.5, "frequency_penalty": 0.5}
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={"40": 2.0}, **adjust
    )
    want = offline_text(offline, PROMPT, max_tokens=8, temperature=0, logit_bias={40: 2.0}, **adjust)
    assert r.choices[0].text == want
    assert want != offline_text(offline, PROMPT, max_tokens=8, temperature=0)


def test_echo_with_logprobs_scores_the_prompt(client, offline):
    """What evaluation harnesses send to score a text (echo + logprobs): the prompt's tokens come back
    first, each with the logprob the offline ``prompt_logprobs`` gives (None for the first), then the
    completion's; streamed deltas add up to the same."""
    sampling = dict(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1)
    r = client.completions.create(echo=True, **sampling)
    want = offline.generate(
        PROMPT, SamplingParams(max_tokens=2, temperature=0, logprobs=1, prompt_logprobs=1), use_tqdm=False
    )[0]
    c, lp = r.choices[0], r.choices[0].logprobs
    ids = want.prompt_token_ids
    assert c.text == PROMPT + want.outputs[0].text
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    prompt_lps = [want.prompt_logprobs[i][t] for i, t in enumerate(ids) if i > 0]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(prompt_lps, abs=1e-5)
    assert lp.token_logprobs[len(ids) :] == pytest.approx(
        [d[t] for d, t in zip(want.outputs[0].logprobs, want.outputs[0].token_ids)], abs=1e-5
    )
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])

    chunks = list(client.completions.create(echo=True, stream=True, **sampling))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    streamed = [x for ch in chunks for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)

    plain = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2, temperature=0, echo=True)
    assert [ch.text for ch in sorted(plain.choices, key=lambda ch: ch.index)] == [
        offline.tokenizer.decode(p) + offline_text(offline, p, max_tokens=2, temperature=0) for p in (ids, ids[:3])
    ]
    assert plain.choices[0].logprobs is None


def test_tokenize_and_detokenize_match_what_generation_uses(http, offline):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT})
    ids = offline.generate(PROMPT, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    assert r.status_code == 200 and r.json()["tokens"] == ids and r.json()["count"] == len(ids)
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert chat == offline.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == offline.tokenizer.decode(ids)
    for path, body, param in [
        ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {}, "prompt"),
    ]:
        bad = http.post(path, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert http.post("/tokenize", json={"model": "nope", "prompt": "a"}).status_code == 404


def test_generation_config_defaults_apply_where_a_request_sets_nothing(tiny_dir, tmp_path):
    import shutil

    folder = tmp_path / "ouro"
    shutil.copytree(tiny_dir, folder)
    (folder / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 3}')
    llm = LLM(str(folder), device="cpu", num_blocks=96)
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0].text
    with Server(build_app(llm, served_model_name=MODEL)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT}).json()
        assert r["choices"][0]["text"] == want and r["usage"]["completion_tokens"] == 3
        chat = c.post("/v1/chat/completions", json={"messages": MESSAGES}).json()
        assert chat["usage"]["completion_tokens"] <= 3
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0}).json()
        assert r["usage"]["completion_tokens"] == 5


def test_chat_matches_offline(client, offline):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    want = offline.chat(MESSAGES, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streamed_text_equals_non_streamed_for_same_seed(client):
    sampling = {"max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 1234}
    full = client.completions.create(model=MODEL, prompt=PROMPT, **sampling).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **sampling))
    assert len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, **sampling).choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **sampling
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
    assert "".join(pieces) == chat
    assert usage is not None and usage.completion_tokens >= 1


def test_raw_sse_format_ends_with_done(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True, "logprobs": 2}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    logprobs = [c["choices"][0]["logprobs"] for c in chunks]
    assert sum(len(lp["tokens"]) for lp in logprobs) == 4
    assert all(len(top) == 2 for lp in logprobs for top in lp["top_logprobs"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_64_concurrent_requests_match_offline(server, offline):
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 24))) for _ in range(64)]
    params = SamplingParams(max_tokens=8, temperature=0)
    want = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
        limit = asyncio.Semaphore(64)

        async def one(prompt: str) -> str:
            async with limit:
                r = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
                return r.choices[0].text

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=90)
        finally:
            await aclient.close()

    steps_before = metric(httpx.get(f"{server.url}/metrics").text, "rlt_engine_steps_total")
    start = time.monotonic()
    got = asyncio.run(run())
    assert got == want
    assert time.monotonic() - start < 60
    steps = metric(wait_idle(server), "rlt_engine_steps_total") - steps_before
    assert steps < 64 * 8 / 2, f"{steps} engine steps for 64 x 8 tokens: requests were not batched together"


# -- errors -------------------------------------------------------------------------------------
BAD_REQUESTS = [
    ("missing_prompt", "/v1/completions", {"model": MODEL, "max_tokens": 4}, 400, "prompt"),
    ("max_tokens_0", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("temperature_-1", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    (
        "chat_temperature_-1",
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "temperature": -1},
        400,
        "temperature",
    ),
    ("unknown_model", "/v1/completions", {"model": "nope", "prompt": PROMPT}, 404, "model"),
    ("chat_unknown_model", "/v1/chat/completions", {"model": "nope", "messages": MESSAGES}, 404, "model"),
    ("prompt_over_context", "/v1/completions", {"model": MODEL, "prompt": "the " * 600}, 400, "prompt"),
    (
        "chat_over_context",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "a " * 600}]},
        400,
        "messages",
    ),
    ("token_out_of_vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 9999]}, 400, "prompt"),
    ("missing_messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("empty_messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("bad_message", "/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages"),
    ("mixed_prompt_list", "/v1/completions", {"model": MODEL, "prompt": ["a", 1]}, 400, "prompt"),
    ("n_0", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 0}, 400, "n"),
    ("top_p_2", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "top_p": 2}, 400, "top_p"),
    ("max_tokens_str", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": "many"}, 400, "max_tokens"),
    (
        "presence_penalty_3",
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "presence_penalty": 3},
        400,
        "presence_penalty",
    ),
    (
        "chat_tools",
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
    ),
    (
        "chat_json_mode",
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    (
        "logit_bias_key",
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "logit_bias": {"x": 1}},
        400,
        "logit_bias",
    ),
    (
        "logit_bias_out_of_vocab",
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "logit_bias": {"99999": 1}},
        400,
        "logit_bias",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_request_gets_openai_error_and_server_keeps_serving(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"
    else:
        assert error["type"] == "invalid_request_error"
    assert_serving(http)


@pytest.mark.parametrize(
    "content", [b'{"model": "tiny-ouro", "prompt": ', b"not json at all", b"[1, 2]"], ids=["truncated", "text", "array"]
)
def test_malformed_json_is_400(http, content):
    r = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert_serving(http)


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}], ids=["none", "wrong", "no-bearer"]
)
def test_api_key_required(server, http, headers):
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as anon:
        r = anon.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert anon.get("/v1/models").status_code == 401
        assert anon.post("/v1/completions", content=b"{bad json").status_code == 401  # auth comes first
        assert anon.get("/health").status_code == 200  # health and metrics stay open
    assert_serving(http)


def test_openai_client_raises_typed_errors(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert info.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    bad_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


def test_queue_full_is_503_and_server_recovers(tiny_dir):
    llm = LLM(str(tiny_dir), device="cpu", num_blocks=64, max_queue_size=2)
    with Server(build_app(llm, served_model_name=MODEL)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 3, "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "queue_full"
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 2, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        assert 'rlt_requests_rejected_total{model_name="tiny-ouro",status="503"} 1' in c.get("/metrics").text


# -- disconnects, metrics, health ------------------------------------------------------------
def wait_idle(server: Server, timeout: float = 10.0) -> str:
    """Wait until the engine holds no request and no KV block, and /metrics says so; the metrics text."""
    deadline = time.monotonic() + timeout
    engine = server.engine
    while True:
        busy = engine.block_manager.usage > 0 or server.app.state.async_engine.num_in_flight or engine.has_unfinished()
        if not busy:
            text = httpx.get(f"{server.url}/metrics").text
            if metric(text, "rlt_kv_cache_usage_ratio") == 0 and metric(text, "rlt_requests_in_flight") == 0:
                return text
        assert time.monotonic() < deadline, f"not idle: KV usage {engine.block_manager.usage}"
        time.sleep(0.02)


def wait_metric(server: Server, name: str, value: float, timeout: float = 10.0, **labels) -> str:
    """Poll /metrics until ``name{labels}`` equals ``value``; the metrics text."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{server.url}/metrics").text
        if metric(text, name, default=None, **labels) == value:
            return text
        assert time.monotonic() < deadline, f"{name}{labels} != {value}: {metric(text, name, default=None, **labels)}"
        time.sleep(0.02)


_MISSING = object()


def metric(text: str, name: str, default=_MISSING, **labels) -> float:
    want = {"model_name": MODEL, **labels}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, value = line.rsplit(" ", 1)
        metric_name, _, label_text = head.partition("{")
        pairs = dict(p.split("=", 1) for p in label_text.rstrip("}").split(",") if p)
        if metric_name == name and {k: v.strip('"') for k, v in pairs.items()} == want:
            return float(value)
    if default is not _MISSING:
        return default
    raise AssertionError(f"{name}{labels} not in /metrics")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server, endpoint):
    before = wait_idle(server)
    aborted_before = metric(before, "rlt_requests_finished_total", default=0.0, finish_reason="abort")
    if endpoint == "completions":
        path, body = "/v1/completions", {"prompt": PROMPT}
    else:
        path, body = "/v1/chat/completions", {"messages": MESSAGES}
    body.update(model=MODEL, max_tokens=400, temperature=0, stream=True, ignore_eos=True)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen == 3:
                break
        assert server.engine.block_manager.usage > 0  # the request holds KV blocks while it runs
    # the connection is closed mid-stream: the request is aborted and its blocks freed
    wait_idle(server, timeout=10)
    assert server.engine.block_manager.usage == 0.0
    text = wait_metric(server, "rlt_requests_finished_total", aborted_before + 1, finish_reason="abort")
    assert metric(text, "rlt_kv_cache_usage_ratio") == 0.0


def test_client_disconnect_without_streaming_aborts_and_frees_blocks(server):
    before = wait_idle(server)
    aborted_before = metric(before, "rlt_requests_finished_total", default=0.0, finish_reason="abort")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=body)  # gives up (and closes the connection) long before 400 tokens
    wait_idle(server, timeout=10)
    text = wait_metric(server, "rlt_requests_finished_total", aborted_before + 1, finish_reason="abort")
    assert metric(text, "rlt_kv_cache_usage_ratio") == 0.0


def test_metrics_content(server, http):
    assert_serving(http)
    wait_idle(server)
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name, kind in [
        ("rlt_requests_received_total", "counter"),
        ("rlt_requests_finished_total", "counter"),
        ("rlt_requests_running", "gauge"),
        ("rlt_requests_waiting", "gauge"),
        ("rlt_prompt_tokens_total", "counter"),
        ("rlt_generation_tokens_total", "counter"),
        ("rlt_kv_cache_usage_ratio", "gauge"),
        ("rlt_step_seconds", "histogram"),
        ("rlt_time_to_first_token_seconds", "histogram"),
    ]:
        assert f"# TYPE {name} {kind}" in text
    assert metric(text, "rlt_requests_received_total") >= 1
    assert metric(text, "rlt_prompt_tokens_total") >= 1
    assert metric(text, "rlt_generation_tokens_total") >= 2
    assert metric(text, "rlt_requests_running") == 0
    assert metric(text, "rlt_requests_waiting") == 0
    assert metric(text, "rlt_kv_cache_usage_ratio") == 0.0
    steps = metric(text, "rlt_step_seconds_count")
    assert steps >= 1 and metric(text, "rlt_step_seconds_bucket", le="+Inf") == steps
    assert metric(text, "rlt_step_seconds_sum") > 0


def test_health(server):
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["model"] == MODEL and body["accepting"] is True


def test_unknown_route_is_openai_404(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- the async engine on its own -------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir)


def test_shutdown_finishes_in_flight_work_within_drain_timeout(model):
    async def run():
        ae = AsyncEngine(LLMEngine(model, num_blocks=64))
        ae.start()
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        outs = []

        async def consume():
            async for out in ae.generate("r", [5, 6, 7], params):
                outs.append(out)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)
        await ae.shutdown(drain_timeout=30)
        await asyncio.wait_for(task, 10)
        assert outs[-1].finished and outs[-1].outputs[-1].finish_reason == "length"
        assert sum(len(c.token_ids) for o in outs for c in o.outputs) == 5
        return ae

    ae = asyncio.run(run())
    assert not ae.is_running and ae.engine.block_manager.usage == 0.0


def test_shutdown_aborts_what_does_not_finish_in_time(model):
    async def run():
        ae = AsyncEngine(LLMEngine(model, num_blocks=64))
        ae.start()
        stream = await ae.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        index, first = await asyncio.wait_for(stream.queue.get(), 10)
        assert not first.finished
        await ae.shutdown(drain_timeout=0.05)
        last = first
        while not last.finished:
            _, last = await asyncio.wait_for(stream.queue.get(), 10)
        assert last.outputs[-1].finish_reason == "abort"
        with pytest.raises(EngineStoppedError):
            await ae.add_request("late", [5, 6], SamplingParams(max_tokens=2))
        return ae

    ae = asyncio.run(run())
    assert not ae.is_running
    assert ae.engine.block_manager.usage == 0.0 and not ae.engine.has_unfinished()
