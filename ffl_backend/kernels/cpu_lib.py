"""The `fastflow_cpu` C++ library: every `cpu_*.cpp` beside this file, built on first use and loaded.

This module only builds and loads. Each op lives in its own Python module beside its `.cpp` (its
reference, its fake -- registered here through `fake`, when the library loads -- and the function
that decides when to call it):

    gemv, gemv_q16                  kernels/cpu_gemv.py       (cpu_gemv.cpp, cpu_gemv_bf16.cpp, cpu_gemv_q16.cpp)
    int4_gemv, int4_widen           kernels/int4_layout.py    (cpu_gemv.cpp, cpu_widen.cpp)
    gemm, int4_gemm                 kernels/cpu_gemm.py       (cpu_gemm.cpp)
    argmax                          kernels/cpu_argmax.py     (cpu_argmax.cpp)
    attention_decode                attention/decode.py       (cpu_attention.cpp)
    prefill_attention               attention/prefill.py      (cpu_prefill_attention.cpp)
    quantize_kv                     attention/kv_quant.py     (cpu_kv_quant.cpp)
    quantize_int8, quantize_int4    kernels/cpu_quantize.py   (cpu_quantize.cpp, cpu_quantize.h)

The sources are compiled here, once per machine and source version, with the compiler and flags
Inductor itself uses (g++ or $CXX, -O3 -march=native -fopenmp -std=c++20; FFL_CPU_MARCH replaces
`native`) into $FFL_CACHE_DIR/cpu_kernels/ (a few seconds, once). Where the library cannot be built
(no compiler, no torch headers, not x86-64 Linux) `load()` returns False once, with a logged
warning, and every caller keeps its pure-torch path: correct, only slower. Loading times nothing:
the GEMVs' prefetch distances are tuned on their first use (cpu_gemv.ready, autotune.tune_prefetch).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

from .. import paths
from .cpu_isa import cpu_flags, target_arch, target_has  # noqa: F401  (the library's build target)

logger = logging.getLogger(__name__)

# A new op's .cpp joins the build by its name alone; the headers are what the sources share.
SOURCES = tuple(sorted(Path(__file__).parent.glob("cpu_*.cpp")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("cpu_*.h")))
OP_NAMESPACE = "fastflow_cpu"

_lock = threading.Lock()
_state: dict = {}  # "loaded": bool, "error": str
_fakes: dict = {}  # op name -> its fake (shape function), from the op's module


def fake(name: str):
    """Decorator: `fn` is the fake of `fastflow_cpu::<name>` (output shapes and dtypes for tracing).
    The op's module declares it beside its reference; it is registered when the library loads (at
    once if it already has). Every module that calls the op imports the op's module."""
    def declare(fn):
        with _lock:
            _fakes[name] = fn
            if _state.get("loaded"):
                _register_fake(name, fn)
        return fn

    return declare


def _register_fake(name: str, fn) -> None:
    torch.library.register_fake(f"{OP_NAMESPACE}::{name}")(fn)


def faked_ops() -> tuple:
    """The ops whose fakes the op modules declared (tests compare them with the sources' ops)."""
    return tuple(sorted(_fakes))


def _cache_dir() -> Path:
    return paths.cache_dir() / "cpu_kernels"


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _compile_flags() -> list:
    # torch's own headers (what torch.utils.cpp_extension would find, without importing it)
    root = Path(torch.__file__).parent
    includes = (root / "include", root / "include" / "torch" / "csrc" / "api" / "include")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-O3", f"-march={target_arch()}", "-fopenmp", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *[f"-I{p}" for p in includes]]


def _link_flags() -> list:
    lib = Path(torch.__file__).parent / "lib"
    return ["-shared", "-fopenmp", f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


def library_path() -> Path:
    """Where the built library for this source, torch, compile command and CPU lives."""
    key = hashlib.sha256()
    flags = " ".join([_compiler(), *_compile_flags(), *_link_flags()])
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS), torch.__version__.encode(), flags.encode(),
                 cpu_flags().encode(), sys.version.encode()):
        key.update(part)
    return _cache_dir() / f"cpu_gemv_{key.hexdigest()[:16]}.so"


def _run(command: list) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"compiler failed ({result.returncode}): {result.stderr[-2000:]}")


def _build(target: Path) -> None:
    """Each source compiled to an object file in its own process, as many at once as there are cores
    (the build is what a fresh machine, and every -march test build, waits for), then linked."""
    from concurrent.futures import ThreadPoolExecutor

    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("fastflow: compiling the CPU kernel library (once per machine) into %s", target)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        objects = [Path(work) / f"{src.stem}.o" for src in SOURCES]
        commands = [[_compiler(), *_compile_flags(), "-c", str(src), "-o", str(obj)]
                    for src, obj in zip(SOURCES, objects)]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(_run, commands))
        # Link under a temporary name and rename: a concurrent process never loads a half-written file.
        tmp = Path(work) / "library.so"
        _run([_compiler(), *map(str, objects), "-o", str(tmp), *_link_flags()])
        os.replace(tmp, target)


def build() -> Path:
    """Build the library for this source and target (FFL_CPU_MARCH) if it is not built yet, without
    loading it (scripts/setup.sh builds the -march levels the tests load in their own processes)."""
    target = library_path()
    if not target.exists():
        _build(target)
    return target


def load() -> bool:
    """Build (if needed) and load the library; True when the `torch.ops.fastflow_cpu.*` ops are usable."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _try_load()
        return _state["loaded"]


def _try_load() -> bool:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        _state["error"] = f"not built on {sys.platform}/{platform.machine()} (x86-64 Linux only)"
        logger.info("fastflow: CPU kernel library %s; pure-torch paths instead", _state["error"])
        return False
    try:
        torch.ops.load_library(str(build()))
        for name, fn in _fakes.items():
            _register_fake(name, fn)
        return True
    except Exception as exc:  # no compiler, no headers, a link error: keep the pure-torch paths
        _state["error"] = str(exc)
        logger.warning("fastflow: CPU kernel library unavailable (%s); pure-torch paths instead", exc)
        return False


def load_error() -> Optional[str]:
    """Why `load()` returned False (None if it did not, or was not called)."""
    return _state.get("error")


@contextlib.contextmanager
def null_kernels():
    """Within this block the library's kernels return zeros without computing (a benchmark of what
    a decode step costs outside them: benchmarks/decode_overhead.py). Needs `load()`."""
    previous = torch.ops.fastflow_cpu.set_null_kernels(True)
    try:
        yield
    finally:
        torch.ops.fastflow_cpu.set_null_kernels(previous)
