"""Progress on long work: a tqdm bar on stderr while it runs, one log line of seconds per phase after.

Whether bars are shown is one setting for every long operation (quantize, optimize, export_onnx, the
first generate's compile, and the CLIs over them), the environment variable FFL_PROGRESS: "0" never,
"1" always, unset (or "auto") only when stderr is a terminal -- so log files, pipes, CI and captured
notebook streams get no carriage-return redraws. An environment variable rather than a keyword on
each function because the work is nested (optimize quantizes, export_onnx quantizes) and CLIs and
library calls then answer to the same switch.

The summary line is logged whatever that setting (logger "ffl_backend", INFO), e.g. SmolLM2's
    fastflow: optimize 12.6 s: quantize 12.6 s (211 linears), setup 0.0 s, kernels 0.0 s, autotune 0.0 s
An operation timed inside another (quantize inside optimize) logs its own line at DEBUG only and hands
its `detail` to the enclosing phase, so one call logs one line.

A low-level utility: no ffl_backend imports, nothing done at import, tqdm imported only for a bar.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import time

logger = logging.getLogger("ffl_backend")

ENV = "FFL_PROGRESS"
_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")


def enabled(stream=None) -> bool:
    """Whether bars are shown on `stream` (default: sys.stderr, looked up now: tests and notebooks
    replace it): FFL_PROGRESS decides when set to on/off, else whether the stream is a terminal."""
    setting = os.environ.get(ENV, "auto").strip().lower()
    if setting in _OFF:
        return False
    if setting in _ON:
        return True
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # None (pythonw), no isatty, or a closed stream
        return False


class _NoBar:
    """What `bar` yields when nothing is shown: the calls callers make, doing nothing."""

    total = 0

    def update(self, n: int = 1) -> None:
        pass

    def set_description_str(self, desc: str, refresh: bool = True) -> None:
        pass

    def refresh(self) -> None:
        pass


class _AboveBars:
    """A console log handler's stream while a bar is shown: each record goes through tqdm.write, which
    clears the bars, prints the record and redraws them, instead of landing in the middle of a bar."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        from tqdm import tqdm

        tqdm.write(text, file=self.stream, end="")

    def flush(self) -> None:
        self.stream.flush()


@contextlib.contextmanager
def _logs_above_bars():
    """Route the console log handlers (of the root and "ffl_backend" loggers: logging.basicConfig's,
    the CLIs') through `_AboveBars` meanwhile. Handlers writing elsewhere (files, pytest's capture)
    are left alone and none is added, so no record goes anywhere it would not have gone."""
    swapped = []
    for log in (logging.root, logger):
        for handler in log.handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.stdout):
                swapped.append((handler, handler.setStream(_AboveBars(handler.stream))))
    try:
        yield
    finally:
        for handler, stream in swapped:
            handler.setStream(stream)


@contextlib.contextmanager
def bar(total: int, desc: str, unit: str = "it", delay: float = 0.0):
    """A tqdm bar on stderr counting `total` `unit`s, with rate and ETA, for the `with` block; a
    stand-in showing nothing when bars are off or there is nothing to count.
    delay: seconds before it first appears -- for work that is often instant (a search already
    cached), which then prints nothing at all."""
    if total <= 0 or not enabled():
        yield _NoBar()
        return
    from tqdm import tqdm

    with _logs_above_bars(), tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, delay=delay,
                                  dynamic_ncols=True, mininterval=0.5, smoothing=0.1) as shown:
        yield shown


@contextlib.contextmanager
def status(desc: str):
    """A phase with nothing to count (Inductor compiling a graph, calibration forward passes): its
    description on stderr while it runs, then its seconds on the same line. No bar and no spinner:
    either would pretend to a measure of progress that this work does not report."""
    if not enabled():
        yield
        return
    from tqdm import tqdm

    start = time.perf_counter()
    with _logs_above_bars():
        line = tqdm(total=None, desc=f"{desc} ...", bar_format="{desc}", file=sys.stderr)
        try:
            yield
        finally:
            line.set_description_str(f"{desc}: {time.perf_counter() - start:.1f} s", refresh=False)
            line.close()  # redraws the line with the final description and leaves it


def count(n: int, what: str) -> str:
    """The detail the summary lines give: "1 linear", "210 linears"."""
    return f"{n} {what}{'' if n == 1 else 's'}"


class Phases:
    """Seconds per named phase of one operation; `with phases("name"):` times one phase (a name used
    twice adds up). Made by `timed`, which logs `line()` when the operation ends."""

    def __init__(self, what: str):
        self.what = what
        self.seconds: dict[str, float] = {}
        self.details: dict[str, str] = {}
        self.detail: str | None = None  # what the whole operation did, for an enclosing line ("211 linears")
        self.running: str | None = None
        self._bar = None
        self._bars = contextlib.ExitStack()
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str, detail: str | None = None):
        previous, self.running = self.running, name
        if self._bar is not None:
            self._bar.set_description_str(f"{self.what}: {name}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.running = previous
            if self._bar is not None:
                self._bar.update(1)  # a phase that failed is over too (export_onnx carries on after one)
        if detail is not None:
            self.details[name] = detail

    def count_phases(self, n: int) -> None:
        """Show the next `n` phases on a bar, for work whose phases are its only measure of progress
        (ONNX export: export, fuse, write, check); called again, it adds `n` more to count."""
        if self._bar is None:
            self._bar = self._bars.enter_context(bar(n, self.what, unit="phase"))
        else:
            self._bar.total += n
            self._bar.refresh()

    def line(self) -> str:
        parts = [f"{name} {s:.1f} s" + (f" ({self.details[name]})" if name in self.details else "")
                 for name, s in self.seconds.items()]
        return f"fastflow: {self.what} {time.perf_counter() - self._start:.1f} s: " + ", ".join(parts)

    def close(self) -> None:
        self._bars.close()


_timing: contextvars.ContextVar[Phases | None] = contextvars.ContextVar("ffl_backend_phases", default=None)


@contextlib.contextmanager
def timed(what: str):
    """Time the phases of `what` (yields its Phases) and log their summary line when it ends without
    an error: INFO for an outermost operation; inside another timed one, DEBUG, with `detail` noted
    on the enclosing phase that is running."""
    outer = _timing.get()
    phases = Phases(what)
    token = _timing.set(phases)
    try:
        yield phases
    finally:
        _timing.reset(token)
        phases.close()
    if outer is None:
        logger.info("%s", phases.line())
        return
    if phases.detail is not None and outer.running is not None:
        outer.details.setdefault(outer.running, phases.detail)
    logger.debug("%s", phases.line())
