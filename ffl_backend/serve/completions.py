"""POST /v1/completions and /v1/chat/completions: parse, tokenize off the loop, submit one engine
request per choice, then answer in one JSON object or as server-sent events.

A non-streaming client that hangs up is noticed by a task waiting on the connection's next ASGI
message (`http.disconnect`); a streaming one by sse-starlette. Either way every engine request of
the HTTP request is cancelled at the engine's next step and its KV blocks freed.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid

from sse_starlette.sse import EventSourceResponse
from starlette.responses import JSONResponse

from ..engine.sampling import RequestError
from . import openai_api as api
from .generation import ChoiceEvent, Cutoff, Generation
from .transport import HTTPFailure

logger = logging.getLogger("ffl_backend.serve")


async def completions(request):
    return await _generate(request, chat=False)


async def chat_completions(request):
    return await _generate(request, chat=True)


async def _generate(request, chat: bool):
    state = request.app.state.ffl
    engine = state.ready_engine()
    body = await state.json_body(request)
    try:
        req = api.parse_request(body, chat)
    except RequestError as exc:
        raise HTTPFailure(400, str(exc)) from None
    state.check_model(req.model)
    choices = req.n * (1 if chat else len(req.prompts))
    state.admit(choices)
    state.in_flight += choices
    released = [False]

    def release():
        if not released[0]:
            released[0] = True
            state.in_flight -= choices

    try:
        generation, prompt_tokens = await _submit(state, engine, req)
    except BaseException:
        release()
        raise
    if state.config.log_prompts:
        text = json.dumps(body.get("messages" if chat else "prompt"))[:2000]
        logger.info("request #%s: %s", request.state.request_id, text)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    reply = _Reply(state, req, rid, prompt_tokens)
    if req.stream:
        return _EventStream(reply.sse(generation), lambda: (generation.cancel(), release()),
                            grace_s=state.config.shutdown_timeout_s)
    try:
        return await reply.json(generation, request)
    finally:
        generation.cancel()
        release()


async def _submit(state, engine, req) -> tuple[Generation, int]:
    """Tokenize (on a worker thread) and submit every choice; nothing stays queued on failure."""
    try:
        if req.chat:
            prompts = [await state.encode_chat(req.messages)]
        else:
            prompts = [await state.encode_prompt(p) for p in req.prompts]
    except RequestError as exc:
        raise HTTPFailure(400, str(exc)) from None
    streams = []
    try:
        for ids in prompts:
            room = engine.max_seq_len - len(ids)
            if room < 1:
                raise RequestError(f"the prompt has {len(ids)} tokens; this server's context is {engine.max_seq_len}")
            for j in range(req.n):
                seed = None if req.params.seed is None else (req.params.seed + j) % 2**64  # choices differ
                params = dataclasses.replace(req.params, seed=seed,
                                             max_new_tokens=room if req.max_tokens is None else req.max_tokens)
                streams.append(await engine.submit(ids, params))
    except RequestError as exc:
        for s in streams:
            s.cancel()
        raise HTTPFailure(400, str(exc)) from None
    config = state.config
    deadline = None if config.request_timeout_s is None else time.monotonic() + config.request_timeout_s
    generation = Generation(streams, req.stop, deadline, state.stop_event(),
                            grace_s=max(0.0, config.shutdown_timeout_s - 0.5), metrics=state.metrics)
    return generation, sum(len(ids) for ids in prompts)


class _Reply:
    def __init__(self, state, req, rid: str, prompt_tokens: int):
        self.state, self.req, self.rid, self.prompt_tokens = state, req, rid, prompt_tokens
        self.created = int(time.time())
        self.model = req.model or state.config.served_model_names[0]
        self.completion_tokens = 0
        self.offsets: dict[int, int] = {}

    def _logprobs(self, ev):
        if self.req.params.logprobs is None:
            return None
        if self.req.chat:
            return api.chat_logprobs(ev.logprobs, self.state.token_text)
        out = api.completion_logprobs(ev.logprobs, self.state.token_text, self.offsets.get(ev.index, 0))
        self.offsets[ev.index] = self.offsets.get(ev.index, 0) + sum(len(t) for t in out["tokens"])
        return out

    def _envelope(self, choices, chunk: bool) -> dict:
        return api.envelope(self.req.chat, self.rid, self.created, self.model, choices, chunk)

    async def json(self, generation: Generation, request) -> JSONResponse:
        n = len(generation.streams)
        texts, finish, entries, ids = [[] for _ in range(n)], [None] * n, [[] for _ in range(n)], [[] for _ in range(n)]
        watcher = asyncio.create_task(_cancel_when_disconnected(request, generation))
        try:
            async with contextlib.aclosing(generation.events()) as events:
                async for ev in events:
                    self._count(ev)
                    texts[ev.index].append(ev.text)
                    entries[ev.index] += ev.logprobs
                    ids[ev.index] += ev.token_ids
                    finish[ev.index] = ev.finish_reason or finish[ev.index]
        except Cutoff as cut:
            raise HTTPFailure(cut.status, str(cut), cut.kind) from None
        finally:
            watcher.cancel()
        choices = [self._with_ids(api.choice(self.req.chat, i, "".join(texts[i]), finish[i],
                                             self._logprobs(ChoiceEvent(i, logprobs=entries[i]))), ids[i])
                   for i in range(n)]
        out = self._envelope(choices, chunk=False)
        out["usage"] = api.usage(self.prompt_tokens, self.completion_tokens)
        return JSONResponse(out)

    def _with_ids(self, choice: dict, token_ids: list) -> dict:
        if self.req.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def _count(self, ev: ChoiceEvent) -> None:
        """Count the tokens; a choice that failed in the engine fails the request (500)."""
        self.completion_tokens += len(ev.token_ids)
        if ev.finish_reason == "error":
            raise HTTPFailure(500, f"generation failed: {ev.error}", "server_error")

    async def sse(self, generation: Generation):
        """Data strings for sse-starlette: chunks, a usage chunk if asked, then [DONE]; a failure
        or a cut-off is an error event before the [DONE]."""
        chat = self.req.chat
        if chat:
            for i in range(len(generation.streams)):
                yield json.dumps(self._envelope([api.choice(True, i, "", None, delta=True, first=True)], True))
        try:
            async with contextlib.aclosing(generation.events()) as events:
                async for ev in events:
                    self._count(ev)
                    if ev.text or ev.logprobs or ev.finish_reason or (ev.token_ids and self.req.return_token_ids):
                        c = self._with_ids(api.choice(chat, ev.index, ev.text, ev.finish_reason, self._logprobs(ev),
                                                      delta=True), ev.token_ids)
                        yield json.dumps(self._envelope([c], True))
            if self.req.include_usage:
                out = self._envelope([], True)
                out["usage"] = api.usage(self.prompt_tokens, self.completion_tokens)
                yield json.dumps(out)
        except (Cutoff, HTTPFailure) as exc:
            self.state.metrics.errors.labels(exc.kind).inc()
            yield json.dumps(api.error_body(str(exc), exc.kind))
        yield "[DONE]"


async def _cancel_when_disconnected(request, generation) -> None:
    """After the body was read, the connection's next ASGI message is `http.disconnect`."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    generation.cancel()


class _EventStream(EventSourceResponse):
    """sse-starlette's response; `on_close` runs however the stream ends (also when the client had
    gone before it began)."""

    def __init__(self, content, on_close, grace_s: float):
        super().__init__(content, sep="\n", ping=15, shutdown_grace_period=grace_s)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
