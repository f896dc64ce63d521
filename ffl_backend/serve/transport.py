"""HTTP/1.1 hardening over uvicorn's h11 protocol, and bounded body reads.

uvicorn closes idle keep-alive connections but gives a client as long as it likes to finish its
request headers (a slow client holds a connection and its file descriptor forever), and answers
malformed requests with a plain-text 400 for every cause; at its connection cap it answers 503 even
while idle keep-alive clients hold every slot. `guarded_protocol` closes idle connections first at the
cap, adds a header deadline (a 408 JSON reply, then close) and answers protocol errors in JSON with
h11's own status hint (431 for headers past the size cap). `read_body` reads a request body chunk by
chunk under a size cap and an idle deadline, discarding (a bounded amount of) an oversized body before the 413 so the
client reads the reply rather than a reset.
"""
from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 413: b"Payload Too Large",
            431: b"Request Header Fields Too Large"}


class HTTPFailure(Exception):
    """Answer the request with `status` and an OpenAI-style JSON error."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def _json_reply(status: int, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": None}}).encode()
    head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
            % (status, _REASONS.get(status, b""), len(body)))
    return head + body


class GuardedH11Protocol(H11Protocol):
    header_timeout = 10.0
    max_header_bytes = 16 << 10

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._header_timer = None
        self._error_status = 400
        next_event = self.conn.next_event

        def next_event_keeping_the_hint():
            try:
                return next_event()
            except h11.RemoteProtocolError as exc:
                self._error_status = exc.error_status_hint
                raise

        self.conn.next_event = next_event_keeping_the_hint

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._last_active = self.loop.time()
        self._arm_header_timer()
        self._evict_idle_connections()

    def _idle(self) -> bool:
        """Between requests (or before the first): nothing received of a next request, no reply owed."""
        return (self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE
                and not self.conn.trailing_data[0] and (self.cycle is None or self.cycle.response_complete)
                and not self.transport.is_closing())

    def _evict_idle_connections(self) -> None:
        """At the connection cap, close idle connections (longest idle first) so that this one is served:
        uvicorn would answer its request 503 while idle clients hold every slot. Only idle ones: a
        connection with a request in progress is never cut."""
        limit = self.limit_concurrency
        if limit is None or len(self.connections) < limit:
            return
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol) and c._idle()]
        idle.sort(key=lambda c: c._last_active)
        for victim in idle[:len(self.connections) - limit + 1]:
            victim._disarm_header_timer()
            victim.connections.discard(victim)  # now, not at connection_lost: this one's request may come first
            victim.transport.close()

    def data_received(self, data: bytes) -> None:
        self._last_active = self.loop.time()
        if self.conn.their_state is h11.IDLE:
            if self._header_timer is None:
                self._arm_header_timer()  # the next request on a kept-alive connection
            if self._head_too_large(data):
                self._disarm_header_timer()
                self.transport.write(_json_reply(431, "request headers too large"))
                self.transport.close()
                return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()

    def _head_too_large(self, data: bytes) -> bool:
        """h11 caps only an incomplete head; a complete one arriving in one read passes at any size."""
        buffered = self.conn.trailing_data[0] + data
        end = buffered.find(b"\r\n\r\n")
        if end < 0:
            end = buffered.find(b"\n\n")
        return (end if end >= 0 else len(buffered)) > self.max_header_bytes

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            pending = bool(self.conn.trailing_data[0])
            if pending:  # a request was started and not finished in time
                self.transport.write(_json_reply(408, "request headers not received in time"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        status = self._error_status if self._error_status in _REASONS else 400
        message = "request headers too large" if status == 431 else f"malformed HTTP request: {msg}"
        self.transport.write(_json_reply(status, message))
        self.transport.close()


def guarded_protocol(header_timeout: float, max_header_bytes: int) -> type:
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes})


async def read_body(receive, declared: int | None, limit: int, idle_timeout: float) -> bytes:
    """The whole body (chunked or not); HTTPFailure 413 past `limit` bytes, 408 when no bytes
    arrive for `idle_timeout` seconds."""
    if declared is not None and declared > 4 * limit:
        raise HTTPFailure(413, f"request body over {limit} bytes")  # too big to drain: reply and close
    chunks, size, more = [], 0, True
    while more:
        try:
            message = await asyncio.wait_for(receive(), idle_timeout)
        except asyncio.TimeoutError:
            raise HTTPFailure(408, "request body not received in time") from None
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected while sending the body")
        data, more = message.get("body", b""), message.get("more_body", False)
        size += len(data)
        if size > 4 * limit:
            raise HTTPFailure(413, f"request body over {limit} bytes")
        if size <= limit:
            chunks.append(data)
    if size > limit:
        raise HTTPFailure(413, f"request body over {limit} bytes")
    return b"".join(chunks)
