"""Kernel parameters chosen per machine and per shape by a short timed search, cached on disk.

`choose(name, shape, candidates, measure)` returns the candidate `measure` times fastest, searched
once per machine (CPU model, instruction sets, torch version; or a GPU, for its kernels) and shape,
then read from $FFL_CACHE_DIR/autotune.json (`cached` reads without searching). FFL_AUTOTUNE=0 turns
the search off: the first candidate (the built-in default) serves. A file that cannot be read is set
aside with a warning and the search runs again. Nothing is timed while torch.compile traces: a
choice not yet cached is the default there.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import threading
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
    ATEN_CPU_CAPABILITY), and torch (whose kernels are among the candidates)."""
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
    return f"{model} | {'+'.join(isa) or 'baseline'} | {used} | torch {torch.__version__}"


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
