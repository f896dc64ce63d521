"""The `ffl-serve` ASGI application (Starlette): routes, JSON errors, API key, CORS, access log.

    app = build_app(ServerState(ServeConfig(...), engine))   # engine may be set later (loading)

Routes: POST /v1/completions, /v1/chat/completions (completions.py), /tokenize, /detokenize;
GET /v1/models, /health (open without a key; 503 while loading, when the engine thread is dead or
the server is stopping), /metrics (Prometheus). Every error is OpenAI's JSON
{"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import hmac
import itertools
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.sampling import RequestError
from . import openai_api as api
from .completions import chat_completions, completions
from .transport import HTTPFailure

access_logger = logging.getLogger("ffl_backend.serve.access")
logger = logging.getLogger("ffl_backend.serve")
_OPEN_PATHS = {"/health"}


def build_app(state) -> Starlette:
    middleware = [Middleware(_AccessLog, state=state)]
    if state.config.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(state.config.allowed_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["authorization", "content-type"]))
    if state.config.api_key:
        middleware.append(Middleware(_ApiKey, key=state.config.api_key))
    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics),
              Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]
    handlers = {HTTPFailure: _failure, HTTPException: _http_exception, Exception: _internal_error}
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)
    app.state.ffl = state
    return app


def error(status: int, message: str, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
    return JSONResponse(api.error_body(message, kind), status_code=status, headers=headers)


async def _failure(request, exc: HTTPFailure):
    request.app.state.ffl.metrics.errors.labels(exc.kind).inc()
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    if exc.status in (408, 413, 415) or exc.status >= 500:
        headers = {**(headers or {}), "Connection": "close"}  # the body may be unread
    return error(exc.status, str(exc), exc.kind, headers)


async def _http_exception(request, exc: HTTPException):
    return error(exc.status_code, exc.detail or "error", "invalid_request_error" if exc.status_code < 500
                 else "server_error", getattr(exc, "headers", None))


async def _internal_error(request, exc: Exception):
    logger.error("request failed", exc_info=exc)
    request.app.state.ffl.metrics.errors.labels("internal").inc()
    return error(500, "internal server error", "server_error")


# -- routes ----------------------------------------------------------------------------------------
async def health(request):
    status, body = request.app.state.ffl.health()
    return JSONResponse(body, status_code=status)


async def metrics(request):
    from .metrics import CONTENT_TYPE

    return Response(request.app.state.ffl.metrics.render(), media_type=CONTENT_TYPE)


async def models(request):
    state = request.app.state.ffl
    engine = state.engine
    data = [{"id": name, "object": "model", "created": state.started, "owned_by": "fastflow",
             "max_model_len": engine.max_seq_len if engine is not None else None}
            for name in state.config.served_model_names]
    return JSONResponse({"object": "list", "data": data})


async def tokenize(request):
    """vLLM's /tokenize: {"prompt": str} or {"messages": [...]} -> {"tokens", "count", "max_model_len"}."""
    state = request.app.state.ffl
    engine = state.ready_engine()
    body = await state.json_body(request)
    if not isinstance(body, dict):
        raise HTTPFailure(400, "the request body must be a JSON object")
    state.check_model(body.get("model") if isinstance(body.get("model"), str) else None)
    try:
        if body.get("messages") is not None:
            ids = await state.encode_chat(api.parse_request({"messages": body["messages"]}, chat=True).messages)
        elif isinstance(body.get("prompt"), str):
            special = body.get("add_special_tokens")
            ids = await state.encode_prompt(body["prompt"], True if special is None else bool(special))
        else:
            raise RequestError("give prompt (a string) or messages")
    except RequestError as exc:
        raise HTTPFailure(400, str(exc)) from None
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.max_seq_len})


async def detokenize(request):
    state = request.app.state.ffl
    engine = state.ready_engine()
    body = await state.json_body(request)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    try:
        if not isinstance(tokens, list):
            raise RequestError("tokens must be a list of token ids")
        ids = engine.encode(tokens)
        if engine.tokenizer is None:
            raise RequestError("this model has no tokenizer")
    except RequestError as exc:
        raise HTTPFailure(400, str(exc)) from None
    return JSONResponse({"prompt": engine.decode(ids)})


# -- middleware (pure ASGI: streaming responses pass through untouched) ------------------------------
class _ApiKey:
    """`Authorization: Bearer KEY` on every path but /health (CORS preflights pass: browsers send
    them without credentials)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        response = error(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error",
                         {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class _AccessLog:
    """One line per request: id, client, method, path, status, milliseconds (never the body)."""

    _ids = itertools.count(1)

    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid, start, status = next(self._ids), time.monotonic(), [0]
        scope.setdefault("state", {})["request_id"] = rid

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope["path"] if scope["path"] in _KNOWN else "other"
            self.state.metrics.requests.labels(route, str(status[0])).inc()
            client = scope.get("client") or ("-", 0)
            access_logger.info("#%d %s %s %s %d %.1fms", rid, client[0], scope["method"], scope["path"][:200],
                               status[0], 1e3 * (time.monotonic() - start))


_KNOWN = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize", "/detokenize"}
