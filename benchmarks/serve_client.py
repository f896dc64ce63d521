"""A lean asyncio HTTP/1.1 client for the ffl-serve benchmarks: one request per connection, JSON or
server-sent events, with client-side TTFT and inter-token gaps. Raw sockets keep the client's own
CPU cost small on a 2-core machine that also runs the server."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time


@dataclasses.dataclass
class Result:
    status: int = 0
    ok: bool = False  # a complete answer: 200 and a parsed body, or [DONE] with no error event
    error: str | None = None
    completion_tokens: int = 0
    ttft: float | None = None  # seconds to the first chunk with text (streams)
    gaps: list = dataclasses.field(default_factory=list)  # seconds between text chunks (streams)
    elapsed: float = 0.0


def _text_of(chunk: dict) -> bool:
    for choice in chunk.get("choices") or []:
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def request(port: int, path: str, body: dict, host: str = "127.0.0.1", timeout: float = 600.0,
                  lean: bool = False) -> Result:
    """lean: parse only the usage and error events of a stream (no TTFT or gaps): the least client
    CPU, for measuring the server's."""
    out, start = Result(), time.perf_counter()
    try:
        await asyncio.wait_for(_request(out, host, port, path, body, start, lean), timeout)
    except Exception as exc:  # noqa: BLE001 - every failure is a counted result
        out.error = out.error or f"{type(exc).__name__}: {exc}"
    out.elapsed = time.perf_counter() - start
    return out


async def _request(out: Result, host, port, path, body, start, lean) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        data = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        out.status = int(head.split(b" ", 2)[1])
        if not body.get("stream"):
            payload = json.loads(await reader.read())
            if out.status != 200:
                out.error = f"HTTP {out.status}: {payload.get('error', {}).get('message')}"
                return
            out.completion_tokens = payload["usage"]["completion_tokens"]
            out.ok = True
            return
        last = None
        async for line in reader:
            if not line.startswith(b"data: "):
                continue
            event = line[6:].strip()
            if event == b"[DONE]":
                out.ok = out.error is None and out.status == 200
                return
            if lean and b'"usage"' not in event and b'"error"' not in event:
                continue
            chunk = json.loads(event)
            if "error" in chunk:
                out.error = chunk["error"].get("message")
            if chunk.get("usage"):
                out.completion_tokens = chunk["usage"]["completion_tokens"]
            if _text_of(chunk):
                now = time.perf_counter()
                if last is None:
                    out.ttft = now - start
                else:
                    out.gaps.append(now - last)
                last = now
        out.error = out.error or "the stream ended without [DONE]"
    finally:
        writer.close()


def percentile(values, q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]
