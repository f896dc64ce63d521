"""One HTTP request's engine requests (its choices), merged into one stream of events.

Each choice's tokens pass a stop-string matcher (text that might begin a stop string is held back
until it cannot); a match retires that engine request with finish reason "stop". The merged stream
ends early, cancelling every choice, when the request's deadline passes, when the server shuts down
and its grace period ends, or when the caller cancels (a client that hung up). A failure inside
the engine ends that choice with finish reason "error"; the other choices go on.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time


class StopMatcher:
    """Streamed text in, text safe to emit out, up to the first stop string to complete (excluded)."""

    def __init__(self, stops):
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self.stops:
            return delta, False
        self.pending += delta
        # the match that completes first, as a character-by-character stream would meet it
        hits = [(i + len(s), i) for s, i in ((s, self.pending.find(s)) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)[1]], ""
            return out, True
        cut = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclasses.dataclass
class ChoiceEvent:
    index: int
    text: str = ""
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)  # [(token_id, logprob, [(id, logprob)])]
    finish_reason: str | None = None
    error: str | None = None


_CANCELLED = object()


class Cutoff(Exception):
    """The request's time is up: `status` 408 (its own timeout) or 503 (the server is stopping)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status
        self.kind = "timeout" if status == 408 else "service_unavailable"


async def _choice_events(index: int, stream, stops, on_token) -> "asyncio.AsyncIterator[ChoiceEvent]":
    matcher = StopMatcher(stops)
    try:
        async for chunk in stream:
            on_token(index)
            text, stopped = matcher.feed(chunk.text)
            lp = [(chunk.token_id, chunk.logprob, chunk.top_logprobs or [])] if chunk.logprob is not None else []
            if stopped:
                stream.cancel("stop")
                yield ChoiceEvent(index, text, [chunk.token_id], lp, "stop")
                return
            yield ChoiceEvent(index, text, [chunk.token_id], lp)
    except RuntimeError as exc:  # this engine request failed; the others go on
        yield ChoiceEvent(index, matcher.flush(), finish_reason="error", error=str(exc))
        return
    done = await stream.result()
    yield ChoiceEvent(index, matcher.flush(), finish_reason=done.finish_reason, error=done.error)


class Generation:
    """`async for event in generation.events()`; `cancel()` from anywhere on the loop."""

    def __init__(self, streams, stops, deadline: float | None, stopping: asyncio.Event | None,
                 grace_s: float = 0.0, metrics=None):
        self.streams, self.stops, self.deadline = streams, stops, deadline
        self.stopping, self.grace_s, self.metrics = stopping, grace_s, metrics
        self.start = time.monotonic()
        self._last = [None] * len(streams)
        self._queue: asyncio.Queue = asyncio.Queue()  # events, None per finished choice, or an ending

    def cancel(self) -> None:
        self._queue.put_nowait(_CANCELLED)
        for s in self.streams:
            s.cancel()

    def _on_token(self, index: int) -> None:
        now, last = time.monotonic(), self._last[index]
        if self.metrics is not None:
            self.metrics.token(now - (self.start if last is None else last), first=last is None)
        self._last[index] = now

    async def _cut_after(self) -> Cutoff:
        """Waits for the deadline, or for shutdown plus its grace; returns what cut the request."""
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        if self.stopping is None:
            await asyncio.sleep(timeout if timeout is not None else 1e9)
            return Cutoff("request timed out", 408)
        try:
            await asyncio.wait_for(self.stopping.wait(), timeout)
        except asyncio.TimeoutError:
            return Cutoff("request timed out", 408)
        await asyncio.sleep(self.grace_s)
        return Cutoff("the server is shutting down", 503)

    async def events(self):
        """ChoiceEvents of every choice as they come; raises Cutoff when cut, CancelledError when
        cancelled. Every engine request is retired when this ends, however it ends. The cut-off
        and cancel() post into the same queue as the tokens: one await per event."""
        queue = self._queue

        async def pump(i, stream):
            try:
                async for ev in _choice_events(i, stream, self.stops, self._on_token):
                    queue.put_nowait(ev)
            except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer error: this choice fails
                queue.put_nowait(ChoiceEvent(i, finish_reason="error", error=f"{type(exc).__name__}: {exc}"))
            finally:
                queue.put_nowait(None)

        async def cut():
            queue.put_nowait(await self._cut_after())

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        tasks.append(asyncio.create_task(cut()))
        try:
            remaining = len(self.streams)
            while remaining:
                ev = await queue.get()
                if ev is None:
                    remaining -= 1
                elif ev is _CANCELLED:
                    raise asyncio.CancelledError()
                elif isinstance(ev, Cutoff):
                    raise ev
                else:
                    yield ev
        finally:
            for task in tasks:
                task.cancel()
            for s in self.streams:
                s.cancel()  # a no-op for finished requests
