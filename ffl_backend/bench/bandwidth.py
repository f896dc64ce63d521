"""The machine's memory read ceiling, measured, so decode speed can be put as % of what is possible.

Decode at small batch reads every weight once per step, so its best case is bytes / read rate. The
rate depends on where the bytes live: a buffer bigger than the last-level cache streams from DRAM,
a smaller one (SmolLM2-135M in bf16 is 270 MB, less than some servers' L3) is bound by how fast the
cores pull data through the caches. So each configuration is measured against a buffer of exactly
its own weight bytes, and the grid also records the DRAM rate (1 GiB) and an in-cache rate (32 MiB).
"""
from __future__ import annotations

import time

DRAM_PROBE_BYTES = 1 << 30
CACHE_PROBE_BYTES = 32 << 20


def read_gbs(nbytes: int, device: str = "cpu", seconds: float = 0.5) -> float:
    """Best read rate (GB/s, 1e9) of a full reduction over a buffer of `nbytes`, on `device`.

    A sum reads every byte once and does one add per element, which the vector units hide: it is
    the fastest plain read torch offers. The best pass is taken, since a ceiling is what the machine
    *can* do; the first pass only pages the buffer in and is not timed."""
    import torch

    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if buf.is_cuda else (lambda: None)
    buf.sum()
    sync()
    best, spent = float("inf"), 0.0
    while spent < seconds or best == float("inf"):
        t0 = time.perf_counter()
        buf.sum()
        sync()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return buf.numel() * 4 / best / 1e9


def machine_bandwidth(device: str = "cpu") -> dict:
    """DRAM and in-cache read rates of this machine (GB/s), for the report's environment block."""
    return {"dram_read_gbs": read_gbs(DRAM_PROBE_BYTES, device),
            "cache_read_gbs": read_gbs(CACHE_PROBE_BYTES, device),
            "probe": "best torch.sum over a float32 buffer of 1 GiB (DRAM) and 32 MiB (cache)"}
