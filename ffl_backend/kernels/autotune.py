"""Kernel parameters chosen per machine and per shape by a short timed search, cached on disk.

`choose(name, shape, candidates, measure)` returns the candidate `measure` times fastest, searched
once per machine (CPU model, instruction sets, torch version; or a GPU, for its kernels) and shape,
then read from $FFL_CACHE_DIR/autotune.json (`cached` reads without searching). FFL_AUTOTUNE=0 turns
the search off: the first candidate (the built-in default) serves. A file that cannot be read is set
aside with a warning and the search runs again. Nothing is timed while torch.compile traces: a
choice not yet cached is the default there.

The searches themselves live here too, each run when asked or on the first use of its choice:
`row_threshold` (from how many rows a prompt's linear takes another path: quant_linear's widening,
cpu_gemm's GEMM) and `tune_prefetch` (the C++ GEMVs' prefetch distances).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from typing import Callable, Sequence

import torch

from .. import paths

logger = logging.getLogger("ffl_backend")

_lock = threading.Lock()
_memory: dict = {}  # the file's contents once read: {machine key: {entry key: choice}}


def enabled() -> bool:
    return os.environ.get("FFL_AUTOTUNE", "1") != "0"


def cache_file():
    return paths.cache_dir() / "autotune.json"


@functools.cache
def machine_key() -> str:
    """What a choice depends on besides the shape: the CPU model, its matrix and vector instruction
    sets, the instruction sets this process uses (fastflow's build target FFL_CPU_MARCH, ATen's
    ATEN_CPU_CAPABILITY), torch (whose kernels are among the candidates) and fastflow's own kernels."""
    from .cpu_isa import target_arch

    model = "?"
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "?")
    except OSError:
        pass
    cpu = torch.cpu
    isa = [name for name, has in (("avx2", cpu._is_avx2_supported()), ("avx512", cpu._is_avx512_supported()),
                                  ("avx512_bf16", cpu._is_avx512_bf16_supported()),
                                  ("amx", cpu._is_amx_tile_supported())) if has]
    used = f"march {target_arch()}, aten {torch.backends.cpu.get_cpu_capability()}"
    return f"{model} | {'+'.join(isa) or 'baseline'} | {used} | torch {torch.__version__} | {_kernels_build()}"


def _kernels_build() -> str:
    """The kernel library's build (a hash of its sources and flags): a choice timed on other kernels is stale."""
    from . import cpu_lib

    return cpu_lib.library_path().stem


def _load() -> dict:
    path = cache_file()
    key = str(path)
    if key not in _memory:
        try:
            _memory[key] = json.loads(path.read_text()) if path.exists() else {}
            if not isinstance(_memory[key], dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            logger.warning("fastflow autotune: %s unreadable (%s); searching again", path, exc)
            path.replace(path.with_suffix(".corrupt"))
            _memory[key] = {}
    return _memory[key]


def _save(table: dict) -> None:
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    os.replace(tmp, path)  # a concurrent reader sees the old file or the new one, never half of one


def _match(cached, candidates: Sequence):
    """The candidate a cached value stands for, compared as JSON (a tuple comes back from the file as a
    list), or None."""
    wanted = json.loads(json.dumps(cached))
    for candidate in candidates:
        if json.loads(json.dumps(candidate)) == wanted:
            return candidate
    return None


def cached(name: str, shape: tuple, candidates: Sequence, machine: str | None = None):
    """The cached choice for `name` at `shape` (None when not searched yet, or turned off); never times."""
    if not enabled():
        return None
    with _lock:
        found = _load().get(machine or machine_key(), {}).get(f"{name}{list(shape)}")
    return _match(found, candidates) if found is not None else None


def choose(name: str, shape: tuple, candidates: Sequence, measure: Callable[[object], float],
           machine: str | None = None):
    """The fastest of `candidates` for `name` at `shape` on this machine (seconds from `measure`);
    `machine` keys the choice instead of this CPU (a GPU's name, for its kernels)."""
    if not enabled():
        return candidates[0]
    entry = f"{name}{list(shape)}"
    with _lock:
        table = _load()
        per_machine = table.setdefault(machine or machine_key(), {})
        if entry in per_machine and (hit := _match(per_machine[entry], candidates)) is not None:
            return hit
        if torch.compiler.is_compiling():
            return candidates[0]
        times = {candidate: measure(candidate) for candidate in candidates}
        best = min(candidates, key=times.__getitem__)
        per_machine[entry] = best
        _save(table)
    logger.info("fastflow autotune: %s -> %s (%s; cached in %s)", entry, best,
                ", ".join(f"{c}: {t * 1e3:.3f} ms" for c, t in times.items()), cache_file())
    return best


def seconds(fn, x, repeats: int = 3) -> float:
    """The fastest of a few calls (after one warm-up): a search wants the kernels' cost, not noise."""
    fn(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best


_thresholds: dict = {}  # (name, shape, cache folder) -> rows: this process's choices


def row_threshold(name: str, shape: tuple, choices: Sequence[int], tuning_rows: Sequence[int],
                  make_paths: Callable[[], dict]) -> int:
    """The row count from which a linear takes path True instead of path False: among `choices`, the
    one whose paths cost least over a prompt of each of `tuning_rows` (bf16 rows of width shape[-1]).
    `make_paths()` gives {False: fn(x), True: fn(x)} on a random weight of `shape`, made only when
    the search runs. Kept in memory per process: a prompt asks once per linear, and the file lookup
    is too slow for that."""
    key = (name, tuple(shape), os.environ.get("FFL_CACHE_DIR"))
    if key in _thresholds:
        return _thresholds[key]
    times, paths = {}, {}

    def cost(threshold: int) -> float:
        if not paths:
            paths.update(make_paths())
        for rows in tuning_rows:
            for taken in (False, True):
                if (rows, taken) not in times:
                    times[rows, taken] = seconds(paths[taken], torch.randn(rows, shape[-1], dtype=torch.bfloat16))
        return sum(times[rows, rows >= threshold] for rows in tuning_rows)

    rows = choose(name, tuple(shape), choices, cost)
    if not torch.compiler.is_compiling() and enabled():  # (else a default, not a choice)
        _thresholds[key] = rows
    return rows


# The GEMVs' prefetch distances "near/far" in weight elements (cpu_kernels.h), the built-in default first.
PREFETCH_CHOICES = ("2304/18432", "1152/9216", "2304/9216", "4608/18432", "2304/36864", "4608/36864")
PREFETCH_DEFAULT_MARGIN = 0.97


def tune_prefetch(megabytes: int = 128, rounds: int = 5) -> tuple[int, int]:
    """Set the GEMVs' prefetch distances for this machine and return them: autotune.py's cached choice,
    else (outside torch.compile, FFL_AUTOTUNE not 0) a timed search -- every candidate streams
    `megabytes` of int8 rows of width 576 (more than a last-level cache holds, as a decode step's
    weights are) through fastflow_cpu::gemv, round robin over `rounds` rounds, best time each (one
    candidate after another drifted: whichever ran last looked fastest) -- else the default.
    Called on the GEMVs' first use (cpu_gemv.ready), never by loading the library."""
    times: dict = {}

    def measure_all() -> None:
        rows = max(1, megabytes * 2**20 // 576 // 8)
        x, weights = torch.randn(1, 576), [torch.ones(rows, 576, dtype=torch.int8) for _ in range(8)]
        for _ in range(3):  # the first passes run slower (page mappings, clocks)
            torch.ops.fastflow_cpu.gemv(x, weights, [], [])
        for _ in range(rounds):
            for choice in PREFETCH_CHOICES:
                torch.ops.fastflow_cpu.set_prefetch(*map(int, choice.split("/")))
                start = time.perf_counter()
                torch.ops.fastflow_cpu.gemv(x, weights, [], [])
                times[choice] = min(times.get(choice, float("inf")), time.perf_counter() - start)

    def cost(choice: str) -> float:
        if not times:
            measure_all()
        # the default keeps its place unless another is more than 3% faster: closer is noise here
        return times[choice] * (PREFETCH_DEFAULT_MARGIN if choice == PREFETCH_CHOICES[0] else 1.0)

    choice = choose("cpu_gemv_prefetch", (megabytes,), PREFETCH_CHOICES, cost)
    near, far = map(int, choice.split("/"))
    torch.ops.fastflow_cpu.set_prefetch(near, far)
    return near, far
