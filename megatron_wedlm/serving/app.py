"""The HTTP side of the server: OpenAI's completions and chat endpoints over a :class:`ServingEngine`.

Every prompt of a request is one engine request. A streamed reply sends one server-sent event per
forward that committed tokens for it (the ``wedlm`` field of each chunk says which forward and
how many tokens it committed: the page at ``/`` draws them), then ``data: [DONE]``. A client that
goes away, streamed or not, cancels its rows. The engine thread hands its events to the request's
event loop (``call_soon_threadsafe``), so no HTTP handler ever blocks on the model, and none waits
on it without looking, twice a second, whether the engine still runs.

Once the engine has failed, ``/health`` and every new request answer 503 naming the cause. With
an API key, ``/v1/*`` needs ``Authorization: Bearer KEY`` (401 otherwise), as vLLM's ``--api-key``;
a request for another model than the one served is answered 404.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from prometheus_client import generate_latest

from megatron_wedlm.decoding.inputs import encode_chat, encode_prompt
from megatron_wedlm.decoding.result import GenerationResult

from .engine import EngineFailed, Progress, QueueFull, Request as EngineRequest, ServingEngine, ShuttingDown
from .metrics import metrics_registry
from .openai_api import BadRequest, ChatRequest, CompletionRequest, error_body, finish_reason
from .scoring import CompletionScoring
from .text_stream import TextStream


@dataclass(frozen=True)
class ServedModel:
    """What the endpoints need besides the engine: the name clients use, the tokenizer, the decoding
    defaults (the model's ``generation_config.json``, then built-in), its stop tokens, and
    ``max_tokens`` when a request gives none (capped by the context left)."""

    name: str
    tokenizer: Any
    defaults: dict[str, Any]
    stop_token_ids: list[int]
    default_max_tokens: int = 256
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class _Choice:
    """One prompt of a request while it is decoded."""

    prompt_tokens: int
    text: TextStream
    request: EngineRequest | None = None
    result: GenerationResult | None = None
    forwards: int = 0


#: how often a waiting handler looks whether its client left or the engine failed (seconds)
LIVENESS_INTERVAL = 0.5


def build_app(engine: ServingEngine, served: ServedModel, api_key: str | None = None) -> FastAPI:
    """The FastAPI application; it starts ``engine`` and, on shutdown, lets it finish what it holds.
    ``api_key``: the Bearer token ``/v1/*`` requires (None: open)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="megatron-wedlm", lifespan=lifespan)
    _add_error_handlers(app)
    if api_key:
        _require_api_key(app, api_key)
    _add_routes(app, engine, served)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal as an OpenAI error object, with the status OpenAI and vLLM answer."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            where = errors[0].get("loc", ("body", "?"))[-1]
            detail = (errors[0].get("ctx") or {}).get("error", "")
            return JSONResponse(error_body(f"the body is not valid JSON (at character {where}): {detail}"),
                                status_code=400)
        problems, params = [], []
        for error in errors:
            loc = [str(part) for part in error.get("loc", ()) if part != "body"]
            params.append(loc[0] if loc else None)
            problems.append(f"{'.'.join(loc) or 'body'}: {error.get('msg')}")
        return JSONResponse(error_body("; ".join(problems), param=params[0] if params else None), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI's own refusals (a body it cannot parse, e.g. nested too deep; an unknown path or
        # method) as OpenAI error objects too, which clients know how to read
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400:
            detail += ": send a JSON object (nested at most a few hundred levels)"
        return JSONResponse(error_body(detail, kind="invalid_request_error" if exc.status_code < 500 else "server_error"),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(BadRequest)
    async def bad(request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(str(exc), param=exc.param), status_code=400)

    @app.exception_handler(EngineFailed)
    async def failed(request: Request, exc: EngineFailed) -> JSONResponse:
        return JSONResponse(error_body(str(exc), kind="server_error", code="engine_failed"), status_code=503)

    @app.exception_handler(UnknownModel)
    async def unknown(request: Request, exc: UnknownModel) -> JSONResponse:
        return JSONResponse(error_body(str(exc), param="model", code="model_not_found"), status_code=404)


def _require_api_key(app: FastAPI, api_key: str) -> None:
    """``/v1/*`` answers 401 unless the request carries ``Authorization: Bearer <api_key>``."""
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return JSONResponse(error_body("a valid API key is required: Authorization: Bearer KEY",
                                               code="invalid_api_key"), status_code=401)
        return await call_next(request)


def _add_routes(app: FastAPI, engine: ServingEngine, served: ServedModel) -> None:
    """The page, ``/health``, ``/metrics`` and the OpenAI endpoints."""
    page = resources.files("megatron_wedlm.serving").joinpath("page.html").read_text(encoding="utf-8")
    registry = metrics_registry(engine)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return page

    @app.get("/health")
    async def health() -> Response:
        failure = engine.failure
        if failure is not None:
            return JSONResponse({"status": "failed", "error": str(failure)}, status_code=503)
        running, waiting = engine.load()
        return JSONResponse({"status": "ok", "running": running, "waiting": waiting})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                            "owned_by": "megatron-wedlm", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_request(body, served)
        texts = body.prompts()
        prompts = [_encode(served.tokenizer, p) for p in texts]
        # echo and logprobs (scoring.py): scored on the engine thread once a choice is decoded
        scoring = CompletionScoring.of(body, engine, served.tokenizer, texts, prompts, poll=LIVENESS_INTERVAL)
        return await _serve(engine, served, body, prompts, request, chat=False, scoring=scoring)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        _check_request(body, served)
        messages = [m.as_template_input() for m in body.messages]
        return await _serve(engine, served, body, [_chat_ids(served.tokenizer, messages)], request, chat=True)


class UnknownModel(LookupError):
    """The request names a model this server does not serve (404, as OpenAI and vLLM answer)."""


def _check_request(body, served: ServedModel) -> None:
    """What a request must pass before its prompts are tokenized: the model it names, text that is
    valid Unicode (a lone surrogate, legal in JSON, breaks the tokenizer), fields this server honours."""
    if body.model is not None and body.model != served.name:
        raise UnknownModel(f"the model `{body.model}` does not exist; this server serves `{served.name}`")
    _check_text(body.model_dump(), "")
    body.check_supported()


def _check_text(value: Any, where: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise BadRequest(f"{where or 'a field'} is not valid Unicode (a lone surrogate at character "
                             f"{error.start})", where.split(".")[0] or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, f"{where}[{i}]")


def _encode(tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        ids = encode_prompt(tokenizer, prompt)
    else:
        ids = [int(t) for t in prompt]
        if any(not 0 <= t < len(tokenizer) for t in ids):
            raise BadRequest(f"prompt token ids must lie in [0, {len(tokenizer)})", "prompt")
    if not ids:
        raise BadRequest("the prompt is empty", "prompt")
    return ids


def _chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    try:
        return encode_chat(tokenizer, messages)
    except ValueError as error:  # no chat template: the message names the fix
        raise BadRequest(str(error), "messages") from None


async def _serve(engine: ServingEngine, served: ServedModel, body, prompts: list[list[int]], request: Request,
                 chat: bool, scoring: CompletionScoring | None = None) -> Response:
    limit, room = body.token_limit, engine.max_model_len
    choices = []
    for ids in prompts:
        if len(ids) >= room:
            raise BadRequest(f"the prompt has {len(ids)} tokens, and the server's context is max_model_len={room}: "
                             "shorten the prompt", "messages" if chat else "prompt")
        if limit is not None and len(ids) + limit > room:
            raise BadRequest(f"the prompt's {len(ids)} tokens + max_tokens={limit} exceed the server's context "
                             f"max_model_len={room}: lower max_tokens", "max_tokens")
        if limit == 0:  # echo alone: nothing to decode (check_supported)
            choices.append((_Choice(len(ids), TextStream(served.tokenizer, [])), None, ids))
            continue
        settings = body.settings(served.defaults, served.stop_token_ids,
                                 limit or min(served.default_max_tokens, room - len(ids)))
        choices.append((_Choice(len(ids), TextStream(served.tokenizer, settings.stop_strings)), settings, ids))

    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def sink(index: int):
        return lambda event: loop.call_soon_threadsafe(events.put_nowait, (index, event))

    submitted: list[_Choice] = []
    try:
        for index, (choice, settings, ids) in enumerate(choices):
            if settings is None:  # echo alone: its choice ends before any forward
                events.put_nowait((index, Progress([], 0, GenerationResult([], 0, 0, 0.0, "echo", text=""))))
                continue
            choice.request = engine.submit(EngineRequest(ids, settings, sink(index), seed=body.seed))
            submitted.append(choice)
    except QueueFull as full:
        _cancel(engine, submitted)
        return JSONResponse(error_body(str(full), kind="rate_limit_error", code="queue_full"), status_code=429,
                            headers={"Retry-After": str(full.retry_after)})
    except ShuttingDown as stopping:
        _cancel(engine, submitted)
        return JSONResponse(error_body(str(stopping), kind="server_error", code="shutting_down"), status_code=503)
    except EngineFailed:
        _cancel(engine, submitted)
        raise
    except ValueError as unfit:  # beyond the server's limits (engine.check)
        _cancel(engine, submitted)
        raise BadRequest(str(unfit)) from None

    reply = _Reply(served, [c for c, _, _ in choices], chat, body.include_usage(), scoring)
    if body.stream:
        return StreamingResponse(reply.stream(engine, events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await reply.whole(engine, events, request)


async def _next_event(engine: ServingEngine, events: asyncio.Queue,
                      request: Request | None = None) -> tuple[int, Progress | BaseException] | None:
    """The next ``(choice index, event)`` of a request. Every :data:`LIVENESS_INTERVAL` it looks
    whether the engine still runs (one that died without a word ends the wait with its failure)
    and, given ``request``, whether the client left (None)."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=LIVENESS_INTERVAL)
        except TimeoutError:
            if request is not None and await request.is_disconnected():
                return None
            failure = engine.failure
            if failure is not None:
                return -1, failure


def _failure_response(what: str, error: BaseException) -> JSONResponse:
    """A whole reply that failed: 503 when the engine is gone, else 500."""
    status = 503 if isinstance(error, EngineFailed) else 500
    return JSONResponse(error_body(f"{what} failed: {error}", kind="server_error"), status_code=status)


def _failure_event(what: str, error: BaseException) -> str:
    """The server-sent event that ends a failed stream."""
    return "data: " + json.dumps(error_body(f"{what} failed: {error}", kind="server_error")) + "\n\n"


def _cancel(engine: ServingEngine, choices: list[_Choice]) -> None:
    for choice in choices:
        if choice.result is None and choice.request is not None:
            engine.cancel(choice.request)


class _Reply:
    """The response to one request, built from its choices' engine events."""

    def __init__(self, served: ServedModel, choices: list[_Choice], chat: bool, include_usage: bool,
                 scoring: CompletionScoring | None = None):
        self.served, self.choices, self.chat, self.include_usage = served, choices, chat, include_usage
        self.scoring, self._echoed = scoring, set()
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _apply(self, index: int, event: Progress) -> str:
        """Record ``event`` for choice ``index``; returns the text it adds."""
        choice = self.choices[index]
        choice.forwards = event.forwards
        if event.result is not None:
            choice.result = event.result
        return choice.text.delta(event.tokens, None if event.result is None else event.result.text)

    def usage(self) -> dict[str, Any]:
        prompt = sum(c.prompt_tokens for c in self.choices)
        completion = sum(len(c.result.token_ids) for c in self.choices if c.result)
        forwards = sum(c.forwards for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "forwards": forwards, "tokens_per_forward": completion / forwards if forwards else 0.0}

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool = False, **extra) -> dict[str, Any]:
        kind = "text_completion" if not self.chat else "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.served.name,
                "choices": choices, **extra}

    async def whole(self, engine: ServingEngine, events: asyncio.Queue, request: Request) -> Response:
        pending = len(self.choices)
        try:
            while pending:
                received = await _next_event(engine, events, request)
                if received is None:
                    return Response(status_code=499)
                index, event = received
                if isinstance(event, BaseException):
                    return _failure_response("generation", event)
                self._apply(index, event)
                pending -= event.result is not None
        finally:
            _cancel(engine, self.choices)
        choices = []
        for index, choice in enumerate(self.choices):
            text, reason = choice.result.text, finish_reason(choice.result.stop_reason)
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "finish_reason": reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": reason})
        if self.scoring:
            try:
                choices = await self._scored(choices, [c.result for c in self.choices])
            except Exception as error:  # noqa: BLE001 - EngineFailed: 503, a failed scoring forward: 500
                return _failure_response("scoring", error)
        return JSONResponse(self._envelope(choices, usage=self.usage()))

    async def stream(self, engine: ServingEngine, events: asyncio.Queue):
        pending = len(self.choices)
        try:
            if self.chat:
                for index in range(len(self.choices)):
                    yield self._sse([{"index": index, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}])
            while pending:
                index, event = await _next_event(engine, events)  # type: ignore[misc]  (no request: never None)
                if isinstance(event, BaseException):
                    yield _failure_event("generation", event)
                    return
                text = self._apply(index, event)
                reason = finish_reason(event.result.stop_reason) if event.result is not None else None
                pending -= event.result is not None
                if self.chat:
                    item = {"index": index, "delta": {"content": text}, "finish_reason": reason}
                else:
                    item = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
                    if self.scoring:
                        try:
                            item = (await self._scored([item], [event.result]))[0]
                        except Exception as error:  # noqa: BLE001 - the stream ends with the error
                            yield _failure_event("scoring", error)
                            return
                yield self._sse([item], wedlm={"forward": event.forwards, "tokens": len(event.tokens)})
            if self.include_usage:
                yield self._sse([], usage=self.usage())
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: its rows are freed at the next step
            _cancel(engine, self.choices)

    async def _scored(self, items: list[dict[str, Any]], results: list[GenerationResult | None]) -> list[dict]:
        """Completion ``items`` with echo (the prompt's text starts a choice's first item) and logprobs
        (in its last, once its reply is done: ``results``); scoring.py."""
        for item in items:
            if item["index"] not in self._echoed:
                self._echoed.add(item["index"])
                item["text"] = self.scoring.prefix(item["index"]) + item["text"]
        done = [(item, result) for item, result in zip(items, results) if result is not None]
        logprobs = await self.scoring.logprobs([(item["index"], result.token_ids) for item, result in done])
        for (item, _), value in zip(done, logprobs):
            item["logprobs"] = value
        return items

    def _sse(self, choices: list[dict[str, Any]], **extra) -> str:
        return "data: " + json.dumps(self._envelope(choices, chunk=True, **extra)) + "\n\n"
