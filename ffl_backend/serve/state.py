"""What every route of `ffl-serve` shares: its settings, the engine (None while it loads), the
count of choices in flight, shutdown, and the tokenizer helpers that run off the event loop."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from ..engine.sampling import RequestError
from .transport import HTTPFailure, read_body

_PARSE_OFF_LOOP = 64 << 10  # bodies larger than this are parsed on a worker thread


@dataclasses.dataclass
class ServeConfig:
    served_model_names: tuple[str, ...] = ("ffl",)
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = 8 << 20
    body_timeout_s: float = 30.0
    max_queued: int = 64
    request_timeout_s: float | None = 600.0
    shutdown_timeout_s: float = 10.0
    log_prompts: bool = False
    chat_template: str | None = None


class ServerState:
    def __init__(self, config: ServeConfig, engine=None):
        from .metrics import ServerMetrics

        self.config, self.engine = config, engine
        self.load_error: str | None = None
        self.in_flight = 0  # engine requests (choices) submitted and not yet answered
        self.stopping: asyncio.Event | None = None
        self.started = int(time.time())
        self.metrics = ServerMetrics(lambda: self.engine)

    # -- lifecycle ----------------------------------------------------------------------------
    def stop_event(self) -> asyncio.Event:
        if self.stopping is None:
            self.stopping = asyncio.Event()
        return self.stopping

    def begin_shutdown(self) -> None:
        """Stop taking requests; streams in flight get `shutdown_timeout_s` to finish."""
        self.stop_event().set()

    def health(self) -> tuple[int, dict]:
        if self.load_error is not None:
            return 503, {"status": "failed", "error": self.load_error}
        if self.engine is None:
            return 503, {"status": "loading"}
        if not self.engine.alive:
            return 503, {"status": "dead"}
        if self.stopping is not None and self.stopping.is_set():
            return 503, {"status": "stopping"}
        return 200, {"status": "ok"}

    def ready_engine(self):
        status, body = self.health()
        if status != 200:
            raise HTTPFailure(503, f"the server is not ready: {body['status']}", "service_unavailable")
        return self.engine

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.config.served_model_names:
            raise HTTPFailure(404, f"the model '{name[:100]}' does not exist; this server serves "
                                   f"{', '.join(self.config.served_model_names)}", "NotFoundError")

    def admit(self, choices: int) -> None:
        engine = self.engine
        capacity = engine.max_batch_size + self.config.max_queued
        if self.in_flight + choices > capacity:
            raise HTTPFailure(429, f"server busy: {self.in_flight} requests in flight (limit {capacity}); retry later",
                              "rate_limit_exceeded")

    # -- request bodies and text --------------------------------------------------------------
    async def json_body(self, request) -> object:
        if not is_json_media_type(request.headers.get("content-type")):
            # text/plain, form encodings: what a web page may POST cross-origin with no CORS preflight
            raise HTTPFailure(415, "the request body must be JSON: send Content-Type: application/json")
        declared = request.headers.get("content-length")
        raw = await read_body(request.receive, int(declared) if declared and declared.isdigit() else None,
                              self.config.max_body_bytes, self.config.body_timeout_s)
        if len(raw) > _PARSE_OFF_LOOP:
            return await asyncio.to_thread(_parse_json, raw)
        return _parse_json(raw)

    async def encode_prompt(self, prompt, add_special_tokens: bool = True) -> list[int]:
        engine = self.engine
        if isinstance(prompt, list):
            return engine.encode(prompt)  # validates ids against the vocabulary
        if engine.tokenizer is None:
            raise RequestError("this model has no tokenizer: send token ids")
        return await asyncio.to_thread(
            lambda: engine.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    async def encode_chat(self, messages: list[dict]) -> list[int]:
        tok = self.engine.tokenizer
        template = self.config.chat_template
        if tok is None or (template is None and not getattr(tok, "chat_template", None)):
            raise RequestError("this model has no chat template: use /v1/completions or start the server with "
                               "--chat-template FILE")

        def render():
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                               chat_template=template)
            except Exception as exc:  # noqa: BLE001 - a template's own refusal (e.g. role order)
                raise RequestError(f"the chat template rejected the messages: {exc}") from None
            return tok(text, add_special_tokens=False)["input_ids"]

        return await asyncio.to_thread(render)

    def token_text(self, token: int) -> str:
        tok = self.engine.tokenizer
        return tok.decode([token]) if tok is not None else ""


def _parse_json(raw: bytes):
    try:
        return json.loads(raw or b"null")
    except RecursionError:
        raise HTTPFailure(400, "invalid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise HTTPFailure(400, f"invalid JSON: {str(exc)[:200]}") from None


def is_json_media_type(value: str | None) -> bool:
    """Whether a Content-Type header names JSON: application/json or application/<x>+json, parameters
    (charset) allowed."""
    media = (value or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
