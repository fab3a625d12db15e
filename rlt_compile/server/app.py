"""The OpenAI-compatible FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

    app = build_app(model="path/to/ckpt", device="cuda", max_num_seqs=64, api_key="secret")
    app = build_app(LLM(...))            # or an LLMEngine, or an AsyncEngine
    uvicorn.run(app, host="127.0.0.1", port=8000)

The engine runs in its own thread (``AsyncEngine``), started and stopped with the app's lifespan;
handlers only send it commands and read the deltas it pushes back. Every error is OpenAI-shaped:
``{"error": {"message", "type", "param", "code"}}`` with 400 for invalid fields and malformed JSON
(instead of FastAPI's 422), 401 for a missing or wrong bearer key, 404 for an unknown model name,
503 when the engine queue is full or the server is shutting down, 500 when an engine step fails.
A client that disconnects (streaming or not) gets its requests aborted, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlt_compile.engine.llm import chat_prompt_ids
from rlt_compile.engine.llm_engine import LLMEngine, QueueFullError
from rlt_compile.engine.outputs import CompletionOutput, RequestOutput
from rlt_compile.engine.sampling_params import SamplingParams
from rlt_compile.server.async_engine import (
    AsyncEngine,
    EngineStepError,
    EngineStoppedError,
    RequestStream,
    iterate_streams,
)
from rlt_compile.server.metrics import ServerMetrics
from rlt_compile.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    model_card,
    new_id,
    now,
    usage,
)

log = logging.getLogger(__name__)

_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid_request(error: ValueError, aliases: dict[str, str] | None = None) -> APIError:
    """400 from a ValueError whose message starts with ``field:`` (the engine's convention)."""
    message = str(error)
    match = _FIELD.match(message)
    param = match.group(1) if match else None
    if param is not None and aliases:
        param = aliases.get(param, param)
    return APIError(400, message, "invalid_request_error", param, None)


def _engine_error(error: Exception, aliases: dict[str, str] | None = None) -> APIError:
    if isinstance(error, QueueFullError):
        return APIError(503, f"server overloaded: {error}", "server_error", None, "queue_full")
    if isinstance(error, EngineStoppedError):
        return APIError(503, str(error), "server_error", None, "engine_unavailable")
    if isinstance(error, ValueError):
        return invalid_request(error, aliases)
    return APIError(500, f"internal error: {error!r}", "server_error", None, None)


class ServerState:
    """What the handlers share: the engine, its async driver, metrics and the served names."""

    def __init__(self, async_engine: AsyncEngine, model_names: list[str], api_key: str | None, drain_timeout: float):
        self.async_engine = async_engine
        self.engine: LLMEngine = async_engine.engine
        self.metrics = async_engine.metrics
        self.model_names = model_names
        self.api_key = api_key
        self.drain_timeout = drain_timeout
        self.created = now()
        self.tokenizer = self.engine.tokenizer
        self._token_text: dict[int, str] = {}

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(
                404, f"The model `{name}` does not exist.", "invalid_request_error", "model", "model_not_found"
            )

    def chat_prompt_ids(
        self, messages: list[ChatMessage], add_generation_prompt: bool, chat_template_kwargs: dict | None
    ) -> list[int]:
        """The prompt token ids of chat ``messages`` (``engine.llm.chat_prompt_ids``); APIError 400
        (param ``messages``) when the model has no template or the template fails."""
        try:
            return chat_prompt_ids(
                self.tokenizer, [m.as_template_dict() for m in messages], add_generation_prompt, chat_template_kwargs
            )
        except ValueError as e:
            raise invalid_request(e) from e

    def token_text(self, token_id: int) -> str:
        """How one token reads (for logprobs); ``token_id:N`` without a tokenizer."""
        text = self._token_text.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text


# -- helpers --------------------------------------------------------------------------------------
def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _finish_reason(c: CompletionOutput) -> str | None:
    return c.finish_reason


def _top(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely alternatives of one position."""
    return sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:k]


def _start_disconnect_watch(request: Request, async_engine: AsyncEngine, streams: list[RequestStream]) -> asyncio.Task:
    """Abort every unfinished stream when the client disconnects (runs until then or cancelled)."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                break
        for s in streams:
            if not s.finished:
                async_engine.abort(s.request_id)

    return asyncio.create_task(watch())


def _abort_unfinished(async_engine: AsyncEngine, streams: list[RequestStream]) -> None:
    for s in streams:
        if not s.finished:
            async_engine.abort(s.request_id)


async def _add_all(
    state: ServerState,
    base_id: str,
    prompts: list[str | list[int]],
    params: SamplingParams,
    priority: int,
    aliases: dict[str, str] | None = None,
) -> list[RequestStream]:
    """Queue one engine request per prompt (all or none); engine errors become APIErrors."""
    out_queue: asyncio.Queue = asyncio.Queue()
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(
                await state.async_engine.add_request(request_id, prompt, params, priority, out_queue=out_queue, index=i)
            )
    except BaseException as e:
        _abort_unfinished(state.async_engine, streams)
        if isinstance(e, Exception):
            raise _engine_error(e, aliases) from e
        raise
    return streams


class _Collected:
    """Merged outputs of several streams (non-streaming responses)."""

    def __init__(self, streams: list[RequestStream]):
        self.outputs: dict[int, RequestOutput] = {}
        self.streams = streams

    async def run(self) -> list[RequestOutput]:
        async for index, delta in iterate_streams(self.streams):
            if index in self.outputs:
                self.outputs[index].merge(delta)
            else:
                self.outputs[index] = delta
        return [self.outputs[s.index] for s in self.streams]


# -- logprob formats --------------------------------------------------------------------------
class _CompletionChoice:
    """The text and OpenAI completions logprobs (tokens, token_logprobs, top_logprobs, text_offset) of
    one choice, delta by delta.

    ``text_offset`` counts characters of the choice's text: each delta starts where the text so far
    ends, and tokens within a delta advance by the length of their own text. With ``echo`` (the
    prompt's text) the first delta starts with the prompt, and its logprobs with the prompt tokens'
    (the first one's None, as nothing predicts it).
    """

    def __init__(self, state: ServerState, top: int, echo: str | None = None):
        self.state, self.top, self.text_length, self.echo = state, top, 0, echo

    def build(
        self, c: CompletionOutput, prompt_ids: list[int], prompt_logprobs: list | None
    ) -> tuple[str, dict | None]:
        text, entries = c.text, []
        if self.echo is not None:
            text = self.echo + text
            entries += zip(prompt_ids, prompt_logprobs or [None] * len(prompt_ids))
            self.echo = None
        start, self.text_length = self.text_length, self.text_length + len(text)
        if c.logprobs is None:
            return text, None
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = start
        for token, lps in [*entries, *zip(c.token_ids, c.logprobs)]:
            token_text = self.state.token_text(token)
            tokens.append(token_text)
            token_lps.append(None if lps is None else lps.get(token))
            top = self.top and lps is not None
            tops.append({self.state.token_text(t): lp for t, lp in _top(lps, self.top)} if top else None)
            offsets.append(offset)
            offset += len(token_text)
        return text, {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(state: ServerState, c: CompletionOutput, top: int) -> dict | None:
    if c.logprobs is None:
        return None
    content = []
    for token, lps in zip(c.token_ids, c.logprobs):
        text = state.token_text(token)
        alternatives = []
        for t, lp in _top(lps, top):
            alt = state.token_text(t)
            alternatives.append({"token": alt, "logprob": lp, "bytes": list(alt.encode())})
        content.append(
            {"token": text, "logprob": lps.get(token), "bytes": list(text.encode()), "top_logprobs": alternatives}
        )
    return {"content": content}


class _BearerAuth:
    """ASGI middleware: with an api key set, ``/v1/*`` needs ``Authorization: Bearer <key>``.

    Checked before the body is read, so a request without the key gets 401 whatever its body. Pure ASGI
    (no BaseHTTPMiddleware), so the receive channel (and disconnect detection) passes through untouched.
    """

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        key = self.state.api_key
        if key is not None and scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                self.state.metrics.request_rejected(401)
                error = APIError(401, "Incorrect or missing API key.", "invalid_request_error", None, "invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- the app --------------------------------------------------------------------------------------
def build_app(
    engine: LLMEngine | AsyncEngine | Any | None = None,
    *,
    model: str | Path | None = None,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    drain_timeout: float = 30.0,
    **llm_options,
) -> FastAPI:
    """The FastAPI app serving ``engine`` (an ``LLMEngine``, ``LLM`` or ``AsyncEngine``), or a new
    ``LLM(model, **llm_options)`` when ``engine`` is None.

    ``served_model_name``: the name(s) clients pass as ``model`` (default: ``model`` as given, or
    "rlt_compile"); ``api_key``: require ``Authorization: Bearer <api_key>`` on /v1 routes;
    ``drain_timeout``: seconds in-flight requests get to finish at shutdown before being aborted.
    """
    if engine is None:
        if model is None:
            raise ValueError("build_app: pass an engine or a model folder")
        from rlt_compile.engine.llm import LLM

        engine = LLM(model, **llm_options)
    elif llm_options:
        raise TypeError(f"build_app: engine options {sorted(llm_options)} given with a ready engine")
    if isinstance(engine, AsyncEngine):
        async_engine = engine
    else:
        core = engine if isinstance(engine, LLMEngine) else getattr(engine, "engine", None)
        if not isinstance(core, LLMEngine):
            raise TypeError(f"build_app: expected an LLMEngine, LLM or AsyncEngine, got {type(engine).__name__}")
        async_engine = AsyncEngine(core, ServerMetrics())
    if served_model_name is None:
        names = [str(model)] if model is not None else ["rlt_compile"]
    elif isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name)
    async_engine.metrics.model_name = names[0]
    state = ServerState(async_engine, names, api_key, drain_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown(state.drain_timeout)

    app = FastAPI(title="rlt_compile OpenAI-compatible server", lifespan=lifespan)
    app.state.server = state
    app.state.async_engine = async_engine
    app.state.engine = async_engine.engine
    app.state.metrics = async_engine.metrics

    # -- errors ----------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        state.metrics.request_rejected(exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('msg', 'invalid JSON')}"
            param = None
        elif not loc and first.get("type") in ("model_attributes_type", "dict_type"):
            message = "the request body must be a JSON object"
            param = None
        else:
            param = loc[0] if loc else None  # the top-level field; the message has the full location
            where = ".".join(loc)
            message = f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg", exc))
            if len(errors) > 1:
                message += f" (and {len(errors) - 1} more error(s))"
        state.metrics.request_rejected(400)
        return JSONResponse(error_body(message, "invalid_request_error", param, None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        state.metrics.request_rejected(exc.status_code)
        return JSONResponse(
            error_body(str(exc.detail), kind, None, None), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        state.metrics.request_rejected(500)
        return JSONResponse(error_body(f"internal error: {exc!r}", "server_error", None, None), status_code=500)

    app.add_middleware(_BearerAuth, state=state)

    # -- plain routes ----------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        ae = state.async_engine
        if not ae.is_running:
            reason = f"engine stopped: {ae.error!r}" if ae.error else "engine not running"
            return JSONResponse(error_body(reason, "server_error", None, "engine_unavailable"), status_code=503)
        m = state.metrics
        return JSONResponse(
            {
                "status": "ok",
                "model": state.model_name,
                "accepting": ae.accepting,
                "requests_in_flight": ae.num_in_flight,
                "requests_waiting": m.num_waiting,
                "kv_cache_usage": m.kv_usage,
            }
        )

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [model_card(n, state.engine.max_model_len, state.created) for n in state.model_names]
        return {"object": "list", "data": cards}

    # -- tokenizer -------------------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give either prompt or messages", "invalid_request_error", "prompt")
        if body.messages is not None:
            tokens = state.chat_prompt_ids(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        else:
            try:
                tokens = state.engine.tokenize(body.prompt)
            except ValueError as e:
                raise invalid_request(e) from e
        return {"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.check_model(body.model)
        if state.tokenizer is None:
            raise APIError(400, "tokens: this model has no tokenizer", "invalid_request_error", "tokens")
        vocab = state.engine.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"tokens: {bad[:5]} outside the vocabulary [0, {vocab})", "invalid_request_error", "tokens"
            )
        return {"prompt": state.tokenizer.decode(body.tokens)}

    # -- completions -----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        state.check_model(body.model)
        try:
            params = body.sampling_params(state.engine.sampling_defaults)
            prompts = body.prompts()
        except ValueError as e:
            raise invalid_request(e) from e
        aliases = {"prompt_token_ids": "prompt"}
        request_id = new_id("cmpl")
        streams = await _add_all(state, request_id, prompts, params, body.priority, aliases)
        watcher = _start_disconnect_watch(request, state.async_engine, streams)
        model_name = body.model or state.model_name
        created = now()
        n = params.n
        want_ids = body.return_token_ids

        def echo(index: int) -> str | None:
            if not body.echo:
                return None
            prompt = prompts[index]
            if isinstance(prompt, str):
                return prompt
            return state.tokenizer.decode(prompt, skip_special_tokens=False) if state.tokenizer is not None else ""

        def choice(index: int, c: CompletionOutput, lp: _CompletionChoice, out: RequestOutput, prompt_lps) -> dict:
            text, logprobs = lp.build(c, out.prompt_token_ids, prompt_lps)
            item = {
                "index": index * n + c.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": _finish_reason(c),
                "stop_reason": c.stop_reason,
            }
            if want_ids:
                item["token_ids"] = list(c.token_ids)
            return item

        top = body.logprobs or 0
        if not body.stream:
            try:
                results = await _Collected(streams).run()
            except (EngineStepError, EngineStoppedError) as e:
                raise _engine_error(e) from e
            finally:
                watcher.cancel()
                _abort_unfinished(state.async_engine, streams)
            choices = [
                choice(i, c, _CompletionChoice(state, top, echo(i)), out, out.prompt_logprobs)
                for i, out in enumerate(results)
                for c in out.outputs
            ]
            choices.sort(key=lambda ch: ch["index"])
            prompt_tokens = sum(len(out.prompt_token_ids) for out in results)
            completion_tokens = sum(len(c.token_ids) for out in results for c in out.outputs)
            return {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens),
            }

        async def sse() -> AsyncIterator[str]:
            lps: dict[tuple[int, int], _CompletionChoice] = {}
            prompt_lps: dict[int, list] = {}  # with the first delta of a prompt's first completion
            prompt_tokens = {s.index: s.prompt_tokens for s in streams}
            completion_tokens = 0
            try:
                async for index, delta in iterate_streams(streams):
                    if delta.prompt_logprobs is not None:
                        prompt_lps[index] = delta.prompt_logprobs
                    for c in delta.outputs:
                        completion_tokens += len(c.token_ids)
                        lp = lps.get((index, c.index))
                        if lp is None:
                            lp = lps[index, c.index] = _CompletionChoice(state, top, echo(index))
                        chunk = {
                            "id": request_id,
                            "object": "text_completion",
                            "created": created,
                            "model": model_name,
                            "choices": [choice(index, c, lp, delta, prompt_lps.get(index))],
                        }
                        yield _sse(chunk)
                if body.include_usage:
                    chunk = {
                        "id": request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": model_name,
                        "choices": [],
                        "usage": usage(sum(prompt_tokens.values()), completion_tokens),
                    }
                    yield _sse(chunk)
            except (EngineStepError, EngineStoppedError) as e:
                yield _sse(_engine_error(e).body())
            finally:
                watcher.cancel()
                _abort_unfinished(state.async_engine, streams)
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # -- chat ------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state.check_model(body.model)
        prompt_ids = state.chat_prompt_ids(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        room = state.engine.max_model_len - len(prompt_ids)
        try:
            params = body.sampling_params(max(room, 1), state.engine.sampling_defaults)
        except ValueError as e:
            raise invalid_request(e) from e
        aliases = {"prompt": "messages", "prompt_token_ids": "messages", "logprobs": "top_logprobs"}
        request_id = new_id("chatcmpl")
        streams = await _add_all(state, request_id, [prompt_ids], params, body.priority, aliases)
        watcher = _start_disconnect_watch(request, state.async_engine, streams)
        model_name = body.model or state.model_name
        created = now()
        top = body.top_logprobs or 0

        if not body.stream:
            try:
                (result,) = await _Collected(streams).run()
            except (EngineStepError, EngineStoppedError) as e:
                raise _engine_error(e) from e
            finally:
                watcher.cancel()
                _abort_unfinished(state.async_engine, streams)
            choices = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": _chat_logprobs(state, c, top),
                    "finish_reason": _finish_reason(c),
                    "stop_reason": c.stop_reason,
                }
                for c in result.outputs
            ]
            completion_tokens = sum(len(c.token_ids) for c in result.outputs)
            return {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": choices,
                "usage": usage(len(result.prompt_token_ids), completion_tokens),
            }

        def chunk(choices: list[dict], **extra) -> str:
            body_ = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                "choices": choices,
            }
            body_.update(extra)
            return _sse(body_)

        async def sse() -> AsyncIterator[str]:
            completion_tokens = 0
            try:
                for i in range(params.n):
                    yield chunk(
                        [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                async for _, delta in iterate_streams(streams):
                    for c in delta.outputs:
                        completion_tokens += len(c.token_ids)
                        yield chunk(
                            [
                                {
                                    "index": c.index,
                                    "delta": {"content": c.text} if c.text or not c.finished else {},
                                    "logprobs": _chat_logprobs(state, c, top),
                                    "finish_reason": _finish_reason(c),
                                }
                            ]
                        )
                if body.include_usage:
                    yield chunk([], usage=usage(streams[0].prompt_tokens, completion_tokens))
            except (EngineStepError, EngineStoppedError) as e:
                yield _sse(_engine_error(e).body())
            finally:
                watcher.cancel()
                _abort_unfinished(state.async_engine, streams)
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app
