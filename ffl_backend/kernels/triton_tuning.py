"""Tile configs of the quantized-linear Triton kernels, autotuned per GPU and shape where one is present.

Each launch shape -- kernel, x dtype, rows (bucketed to a power of two), N, K, int4 group -- picks
from a few (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) candidates by timing each on the device (CUDA
events, after one launch that compiles it), once per GPU model and Triton version; autotune.py caches
the choice on disk ($FFL_CACHE_DIR/autotune.json, FFL_AUTOTUNE=0 turns it off). The first candidate
is the built-in default: what the interpreter, CPU tests, traced graphs with nothing cached, and
FFL_AUTOTUNE=0 use, and what aot.py compiles ahead of time (the others compile on the device, on
first use, as Triton's own autotuner does).

Inductor bakes a traced launch's config into the compiled graph, and nothing is timed while tracing
or capturing a CUDA graph: `optimize()` therefore runs each quantized linear once eagerly at the
batch it was given (quant.modules.pretune_linears) before the first compile.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from . import autotune

Config = tuple  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps)
GEMV_MAX_M = 16
# Decode (M <= 16): narrow N-blocks and a long K step (many programs for a small grid); more or
# fewer columns per program and a longer K step. Prefill: the GEMM tile and its neighbours.
GEMV_CANDIDATES = ((16, 32, 128, 4), (16, 64, 128, 4), (16, 16, 256, 4), (16, 32, 256, 4), (16, 64, 64, 2))
GEMM_CANDIDATES = ((64, 128, 64, 4), (128, 128, 64, 8), (64, 64, 64, 4), (128, 64, 32, 4))
TIMED_LAUNCHES = 10


def candidates(m: int, group_size: int | None = None) -> tuple[Config, ...]:
    """The configs for M rows, default first; int4 caps BLOCK_K at the group size (one K step, one group)."""
    base = GEMV_CANDIDATES if m <= GEMV_MAX_M else GEMM_CANDIDATES
    capped = ((bm, bn, bk if group_size is None else min(bk, group_size), w) for bm, bn, bk, w in base)
    return tuple(dict.fromkeys(capped))


def default_config(m: int, group_size: int | None = None) -> Config:
    return candidates(m, group_size)[0]


@functools.cache
def device_key(index: int) -> str:
    import triton

    return f"{torch.cuda.get_device_name(index)} | triton {triton.__version__}"


def _can_time(x: torch.Tensor) -> bool:
    """A real CUDA tensor, outside tracing and CUDA-graph capture: only then is a launch timed."""
    from torch._subclasses.fake_tensor import is_fake

    return (x.device.type == "cuda" and not is_fake(x) and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing())


def time_on_device(run: Callable[[Config], None], config: Config) -> float:
    """Seconds per launch of `run(config)`: one launch to compile and warm, then TIMED_LAUNCHES."""
    run(config)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(TIMED_LAUNCHES):
        run(config)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / TIMED_LAUNCHES


def launch_config(kernel_name: str, x2d: torch.Tensor, n: int, group_size: int | None,
                  run: Callable[[Config], None], measure=time_on_device) -> Config:
    """The config to launch `kernel_name` with for x2d (M, K) and N outputs; `run(config)` launches it
    (into the call's own output: the last launch, the real one, writes it again)."""
    m = x2d.shape[0]
    options = candidates(m, group_size)
    if not autotune.enabled():
        return options[0]
    if not _can_time(x2d):  # traced (maybe with a symbolic M), interpreted, or captured: never timed
        known = x2d.device.type == "cuda" and all(isinstance(v, int) for v in (*x2d.shape, n))
        cached = autotune.cached(f"triton_{kernel_name}", _shape(x2d, n, group_size), options,
                                 machine=device_key(x2d.device.index or 0)) if known else None
        return cached or options[0]
    return autotune.choose(f"triton_{kernel_name}", _shape(x2d, n, group_size), options,
                           lambda config: measure(run, config), machine=device_key(x2d.device.index or 0))


def _shape(x2d: torch.Tensor, n: int, group_size: int | None) -> tuple:
    m, k = x2d.shape
    return (str(x2d.dtype).replace("torch.", ""), 1 << max(0, (m - 1).bit_length()), n, k, group_size or 0)
