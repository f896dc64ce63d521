"""Progress on long work (ffl_backend/progress.py): bars on stderr only on a terminal or when asked
(FFL_PROGRESS), quantize's bar counts every linear, and quantize, optimize and the first generate's
compile each log one line of seconds per phase. The ONNX export's phases: tests/onnx_export/test_export.py."""
import io
import logging
import re
import sys

import pytest
import torch

import ffl_backend
from ffl_backend import progress
from tests.tiny_models import tiny_model


class FakeTTY(io.StringIO):
    """A stderr that says it is a terminal, keeping what is written to it."""

    def isatty(self):
        return True


def _stderr(monkeypatch, tty: bool, setting: str | None) -> io.StringIO:
    stream = FakeTTY() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    if setting is None:
        monkeypatch.delenv(progress.ENV, raising=False)
    else:
        monkeypatch.setenv(progress.ENV, setting)
    return stream


def _bar_totals(text: str) -> dict:
    """{bar description: its final "n/total"} from tqdm's output (each redraw starts with a carriage return)."""
    finals = {}
    for line in re.split(r"[\r\n]+", text):
        match = re.match(r"(.+?): +\d+%\|.*?\| (\d+)/(\d+)", line)
        if match:
            finals[match.group(1)] = (int(match.group(2)), int(match.group(3)))
    return finals


@pytest.mark.parametrize("tty,setting,shown", [
    (True, None, True), (False, None, False), (True, "0", False), (False, "1", True), (True, "auto", True),
])
def test_bar_only_on_a_terminal_or_when_asked(monkeypatch, tty, setting, shown):
    stream = _stderr(monkeypatch, tty, setting)
    assert progress.enabled() is shown
    ffl_backend.quantize(tiny_model("llama"), "int8")
    assert ("quantize int8" in stream.getvalue()) is shown
    if not shown:
        assert stream.getvalue() == ""


def test_a_stderr_without_isatty_gets_no_bar(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    monkeypatch.setattr(sys, "stderr", None)  # pythonw
    assert not progress.enabled()
    with progress.bar(3, "nothing") as bar, progress.status("nothing either"):
        bar.update(3)


def test_quantize_bar_counts_every_linear_with_the_scheme(monkeypatch):
    """int4-all: the decoder's linears in int4 groups of 32, then lm_head in int8 -- every nn.Linear once."""
    stream = _stderr(monkeypatch, True, None)
    model = tiny_model("llama")
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    ffl_backend.quantize(model, "int4-all")
    totals = _bar_totals(stream.getvalue())
    assert totals == {"quantize int4 g32": (linears - 1, linears - 1), "quantize int8": (1, 1)}
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", stream.getvalue())  # [elapsed<ETA, as tqdm writes them


def test_quantize_logs_one_line_of_phases(caplog):
    caplog.set_level(logging.INFO, logger="ffl_backend")
    model = tiny_model("llama")
    ffl_backend.quantize(model, "int4-all")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fastflow: quantize")]
    assert len(lines) == 1
    assert re.fullmatch(r"fastflow: quantize [\d.]+ s: int4 g32 [\d.]+ s \(14 linears\), "
                        r"int8 [\d.]+ s \(1 linear\), finish [\d.]+ s", lines[0]), lines[0]


def test_optimize_logs_one_line_with_quantize_inside(caplog):
    """quantize inside optimize logs its own line at DEBUG only; optimize's names its linears."""
    caplog.set_level(logging.INFO, logger="ffl_backend")
    model = ffl_backend.optimize(tiny_model("llama"), quant="int8", max_seq_len=64)
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not any(m.startswith("fastflow: quantize") for m in messages)
    line = next(m for m in messages if m.startswith("fastflow: optimize"))
    assert re.fullmatch(r"fastflow: optimize [\d.]+ s: quantize [\d.]+ s \(14 linears\), setup [\d.]+ s, "
                        r"kernels [\d.]+ s, autotune [\d.]+ s", line), line
    ffl_backend.restore(model)


def test_phases_add_up_and_a_failed_operation_logs_nothing(caplog):
    caplog.set_level(logging.DEBUG, logger="ffl_backend")
    with progress.timed("outer") as outer:
        with outer("inner work"):
            with progress.timed("inner") as inner:
                with inner("a"):
                    pass
                inner.detail = progress.count(3, "thing")
        for _ in range(2):
            with outer("twice"):
                pass
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert messages[0][0] == logging.DEBUG and messages[0][1].startswith("fastflow: inner ")
    assert messages[1][0] == logging.INFO
    assert re.fullmatch(r"fastflow: outer [\d.]+ s: inner work [\d.]+ s \(3 things\), twice [\d.]+ s", messages[1][1])
    caplog.clear()
    with pytest.raises(RuntimeError), progress.timed("failing") as phase, phase("x"):
        raise RuntimeError("boom")
    assert caplog.records == []


def test_status_line_and_phase_bar_on_a_terminal(monkeypatch):
    stream = _stderr(monkeypatch, True, None)
    with progress.status("fastflow: compiling something"):
        pass
    assert re.search(r"fastflow: compiling something \.\.\.\rfastflow: compiling something: [\d.]+ s\n",
                     stream.getvalue())
    with progress.timed("job") as phase:
        phase.count_phases(2)
        with phase("one"):
            pass
        phase.count_phases(1)  # a retry adds a phase to count
        for name in ("two", "three"):
            with phase(name):
                pass
    assert _bar_totals(stream.getvalue())["job: three"] == (3, 3)


def test_first_generate_logs_its_compile(monkeypatch, caplog):
    """The decode loop's first call of a compiled step shows a status line and logs its seconds once
    (Dynamo's eager backend here: the line, not Inductor's compile time, is under test)."""
    from ffl_backend.decode_loop import DecodeLoop
    from ffl_backend.generation import configure_generate

    stream = _stderr(monkeypatch, True, None)
    caplog.set_level(logging.INFO, logger="ffl_backend")
    model = configure_generate(tiny_model("llama"), backend="eager", max_cache_len=32)
    loop = DecodeLoop(model, model.generate, 32)
    ids = torch.randint(3, 128, (1, 5))
    for _ in range(2):
        loop(ids, max_new_tokens=4, do_sample=False)
    compiled = [r.getMessage() for r in caplog.records if "compiled decode" in r.getMessage()]
    assert len(compiled) == 1 and re.fullmatch(r"fastflow: first generate compiled decode in [\d.]+ s", compiled[0])
    assert stream.getvalue().count("compiling the decode step (Dynamo + Inductor):") == 1


def test_log_records_during_a_bar_print_on_lines_of_their_own(monkeypatch):
    """A console handler's records go through tqdm.write while a bar is shown (not into the bar's
    line), and the handler gets its own stream back after."""
    stream = _stderr(monkeypatch, True, None)
    handler = logging.StreamHandler(stream)
    log = logging.getLogger("ffl_backend")
    log.addHandler(handler)
    try:
        with progress.bar(2, "work") as shown:
            shown.update(1)
            log.warning("a record")
            shown.update(1)
    finally:
        log.removeHandler(handler)
    assert handler.stream is stream
    assert "a record" in re.split(r"[\r\n]+", stream.getvalue())
