"""The instruction sets this process uses on the CPU: the CPU's own, or fewer where FFL_CPU_MARCH asks.

FFL_CPU_MARCH (an -march level: x86-64, x86-64-v2, x86-64-v3 = AVX2, x86-64-v4 = AVX-512) is what
the fastflow_cpu library is compiled for (cpu_lib.py) and what every choice between CPU paths asks
(`target_has`): an AVX2 build on an AVX-512 machine then also decides as an AVX2 CPU would -- the
project's proxy for AVX2-only CPUs, together with torch's ATEN_CPU_CAPABILITY=avx2 and
ONEDNN_MAX_CPU_ISA=AVX2 (docs/performance.md).
"""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path


def target_arch() -> str:
    """The -march the library is built for: this CPU unless FFL_CPU_MARCH names another (e.g.
    x86-64-v3 for the AVX2 path on an AVX-512 machine, x86-64 for the portable one; tests use it)."""
    return os.environ.get("FFL_CPU_MARCH", "native")


# What a build for each -march level may use, as /proc/cpuinfo names the flags (x86-64-v3: AVX2 CPUs such
# as AMD Zen 2/3; x86-64-v4: AVX-512 without VNNI, BF16 or AMX).
MARCH_FLAGS = {"x86-64": (), "x86-64-v2": ("sse4_2", "popcnt"),
               "x86-64-v3": ("sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi2"),
               "x86-64-v4": ("sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw",
                             "avx512vl", "avx512dq", "avx512cd")}


def target_has(flag: str) -> bool:
    """Whether this process acts on a CPU with `flag` (a /proc/cpuinfo name): the CPU has it and the
    target (FFL_CPU_MARCH) allows it. Choices between paths ask this, not the CPU, so an AVX2 build on
    an AVX-512 machine also decides as an AVX2 CPU would."""
    if flag not in cpu_flags().split():
        return False
    arch = target_arch()
    return arch == "native" or flag in MARCH_FLAGS.get(arch, ())


@functools.cache
def cpu_flags() -> str:
    """This CPU's /proc/cpuinfo flags line (the processor name where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
