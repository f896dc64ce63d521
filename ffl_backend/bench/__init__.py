"""Benchmarks of decode speed: the `ffl-bench` command and the pieces benchmarks/ scripts reuse.

    cli.py        ffl-bench: arguments, checks before any run, one-line errors
    grid.py       the cartesian grid, one fresh process per configuration, agreement and speedups
    worker.py     one configuration measured in its own process (run once, or served to interleave.py)
    session.py    what a worker measures: load, compile, TTFT, decode, memory
    llamacpp.py   the llama.cpp rows (gguf_export.py writes their files)
    interleave.py worker processes; the default schedule: every one alive, timed round robin
    bandwidth.py  the machine's measured read ceiling, for effective GB/s as % of possible
    outputs.py    table, JSON, CSV, PNG and markdown

Names load their modules on first use, so `python -m ffl_backend.bench.worker` runs its module fresh.
"""
from .._lazy import lazy_getattr

__all__ = ["run_grid", "run_isolated", "agreement", "environment", "table", "prompt_ids", "time_generate",
           "run_one", "main"]

_LAZY = {
    "run_grid": "grid",
    "run_isolated": "grid",
    "agreement": "grid",
    "environment": "grid",
    "table": "outputs",
    "prompt_ids": "session",
    "time_generate": "session",
    "run_one": "worker",
    "main": "cli",
}

__getattr__ = lazy_getattr(__name__, _LAZY)
