"""The `fastflow_cpu` C++ library: its CPU kernels, built on first use and loaded as torch ops.

    gemv, int4_gemv     decode GEMVs (cpu_gemv.cpp, with cpu_gemv_bf16.cpp for bf16 x and weights on
                        AVX512-BF16; the ops' references: cpu_gemv.py, int4_layout.py)
    gemv_q16            the int8 decode GEMV over int16-quantized activations (cpu_gemv_q16.cpp; cpu_gemv.py)
    int4_widen          an int4_gemv weight widened to bf16, for prompt GEMMs (cpu_widen.cpp; int4_layout.py)
    gemm, int4_gemm     prompt GEMMs in fp32 over bf16 / fp16 / int8 / int4 weights widened block by block, for
                        CPUs without bf16 matrix instructions (cpu_gemm.cpp; cpu_gemm.py)
    decode_attention    a few query rows over a static cache (cpu_attention.cpp; attention/reference.py)
    prefill_attention   a prompt's causal attention in fp32 register tiles (cpu_prefill_attention.cpp;
                        attention/prefill.py)
    quantize_kv         K/V rows to the packed int8 / fp8 cache format (cpu_kv_quant.cpp; attention/kv_quant.py)
    argmax              the greedy token (cpu_argmax.cpp)

The C++ sources ship with the package and are compiled here, once per machine and source version,
with the compiler and flags Inductor itself uses (g++ or $CXX, -O3 -march=native -fopenmp -std=c++20;
FFL_CPU_MARCH replaces `native`) into $FFL_CACHE_DIR/cpu_kernels/ (a few seconds, once). Where the
library cannot be built (no compiler, no torch headers, not x86-64 Linux) `load()` returns False
once, with a logged warning, and every caller keeps its pure-torch path: correct, only slower.
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
import time
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from .. import paths
from . import autotune
from .cpu_isa import cpu_flags, target_arch, target_has  # noqa: F401  (the library's build target)
from .int4_layout import INT4_ROWS

logger = logging.getLogger(__name__)

# cpu_kernels.h is what the sources share.
SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_gemv.cpp", "cpu_gemv_bf16.cpp", "cpu_gemv_q16.cpp",
                                                          "cpu_attention.cpp", "cpu_argmax.cpp", "cpu_widen.cpp",
                                                          "cpu_kv_quant.cpp", "cpu_gemm.cpp",
                                                          "cpu_prefill_attention.cpp"))
HEADERS = (Path(__file__).with_name("cpu_kernels.h"), Path(__file__).with_name("cpu_tile.h"))
OP_NAMESPACE = "fastflow_cpu"

_lock = threading.Lock()
_state: dict = {}  # "loaded": bool, "error": str


def _cache_dir() -> Path:
    return paths.cache_dir() / "cpu_kernels"


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _compile_command(out: Path) -> list:
    # torch's own headers and libraries (what torch.utils.cpp_extension would find, without importing it)
    root = Path(torch.__file__).parent
    includes = (root / "include", root / "include" / "torch" / "csrc" / "api" / "include")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [_compiler(), "-O3", f"-march={target_arch()}", "-fopenmp", "-shared", "-fPIC", "-std=c++20",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{p}" for p in includes], *map(str, SOURCES), "-o", str(out),
            f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}"]


def library_path() -> Path:
    """Where the built library for this source, torch, compile command and CPU lives."""
    key = hashlib.sha256()
    flags = " ".join(_compile_command(Path("out.so")))
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS), torch.__version__.encode(), flags.encode(),
                 cpu_flags().encode(), sys.version.encode()):
        key.update(part)
    return _cache_dir() / f"cpu_gemv_{key.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: a concurrent process never loads a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        logger.info("fastflow: compiling the CPU kernel library (once per machine) into %s", target)
        result = subprocess.run(_compile_command(Path(tmp)), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiler failed ({result.returncode}): {result.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
        target = library_path()
        if not target.exists():
            _build(target)
        torch.ops.load_library(str(target))
        torch.library.register_fake(f"{OP_NAMESPACE}::gemv")(_fake_gemv)
        torch.library.register_fake(f"{OP_NAMESPACE}::gemv_q16")(_fake_gemv)
        torch.library.register_fake(f"{OP_NAMESPACE}::int4_gemv")(_fake_int4_gemv)
        torch.library.register_fake(f"{OP_NAMESPACE}::decode_attention")(_fake_decode_attention)
        torch.library.register_fake(f"{OP_NAMESPACE}::argmax")(_fake_argmax)
        torch.library.register_fake(f"{OP_NAMESPACE}::int4_widen")(_fake_int4_widen)
        torch.library.register_fake(f"{OP_NAMESPACE}::quantize_kv")(_fake_quantize_kv)
        torch.library.register_fake(f"{OP_NAMESPACE}::gemm")(_fake_gemm)
        torch.library.register_fake(f"{OP_NAMESPACE}::int4_gemm")(_fake_int4_gemm)
        torch.library.register_fake(f"{OP_NAMESPACE}::prefill_attention")(_fake_prefill_attention)
        tune_prefetch()
        return True
    except Exception as exc:  # no compiler, no headers, a link error: keep the pure-torch paths
        _state["error"] = str(exc)
        logger.warning("fastflow: CPU kernel library unavailable (%s); pure-torch paths instead", exc)
        return False


# The GEMVs' prefetch distances "near/far" in weight elements (cpu_kernels.h), the built-in default first.
PREFETCH_CHOICES = ("2304/18432", "1152/9216", "2304/9216", "4608/18432", "2304/36864", "4608/36864")
PREFETCH_DEFAULT_MARGIN = 0.97


def tune_prefetch(megabytes: int = 128, rounds: int = 5) -> tuple[int, int]:
    """Set the GEMVs' prefetch distances for this machine and return them: autotune.py's cached choice,
    else (outside torch.compile, FFL_AUTOTUNE not 0) a timed search -- every candidate streams
    `megabytes` of int8 rows of width 576 (more than a last-level cache holds, as a decode step's
    weights are) through fastflow_cpu::gemv, round robin over `rounds` rounds, best time each (one
    candidate after another drifted: whichever ran last looked fastest) -- else the default.
    Called by `load()`."""
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

    choice = autotune.choose("cpu_gemv_prefetch", (megabytes,), PREFETCH_CHOICES, cost)
    near, far = map(int, choice.split("/"))
    torch.ops.fastflow_cpu.set_prefetch(near, far)
    return near, far


def load_error() -> Optional[str]:
    """Why `load()` returned False (None if it did not, or was not called)."""
    return _state.get("error")


def _fake_gemv(x: Tensor, weights, scales, biases) -> Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def _fake_int4_gemv(x: Tensor, packed, scale_zeros, bias, group_size: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0] * INT4_ROWS))


def _fake_decode_attention(q: Tensor, k_cache, v_cache, filled, scale, window, mask) -> Tensor:
    # (B, Lq, Hq, D) memory seen as (B, Hq, Lq, D), as the kernel returns it
    b, hq, lq, d = q.shape
    return q.new_empty((b, lq, hq, d)).transpose(1, 2)


def _fake_quantize_kv(x: Tensor, fp8: bool) -> Tensor:
    return x.new_empty((*x.shape[:-1], -(-x.shape[-1] // 4) * 4 + 4), dtype=torch.int8)


def _fake_int4_widen(packed: Tensor, scale_zeros, group_size: int) -> Tensor:
    return packed.new_empty((packed.shape[0] * INT4_ROWS, packed.shape[1] * 8), dtype=torch.bfloat16)


def _fake_gemm(x: Tensor, weight: Tensor, scale, bias) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _fake_int4_gemm(x: Tensor, packed: Tensor, scale_zeros, bias, group_size: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0] * INT4_ROWS))


def _fake_prefill_attention(q: Tensor, k, v, scale: float, window: int) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _fake_argmax(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[:-1], dtype=torch.long)


@contextlib.contextmanager
def null_kernels():
    """Within this block the library's kernels return zeros without computing (a benchmark of what
    a decode step costs outside them: benchmarks/decode_overhead.py). Needs `load()`."""
    previous = torch.ops.fastflow_cpu.set_null_kernels(True)
    try:
        yield
    finally:
        torch.ops.fastflow_cpu.set_null_kernels(previous)
