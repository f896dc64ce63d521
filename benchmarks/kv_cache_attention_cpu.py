"""Decode attention over a bf16 vs int8 vs fp8 (e4m3) KV cache on CPU: the C++ kernel
(`fastflow_cpu::attention_decode`, kernels/cpu_attention.cpp) at SmolLM2-135M's shape (9 query heads,
3 KV heads, head dim 64), one new token, at several filled lengths and batch sizes; and the cache's
bytes. Interleaved rounds, median of each.

    flock /tmp/ffl_cpu.lock .venv/bin/python benchmarks/kv_cache_attention_cpu.py \
        --out benchmarks/results/kv_cache_attention_cpu_<cpu>.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ffl_backend.attention.kv_quant import quantize_kv
from ffl_backend.bench.grid import environment
from ffl_backend.kernels import cpu_lib

FORMATS = {"bfloat16": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _caches(batch: int, length: int, fmt):
    k, v = (torch.randn(batch, 3, length, 64, dtype=torch.bfloat16) for _ in range(2))
    return (k, v) if fmt is None else (quantize_kv(k, fmt), quantize_kv(v, fmt))


def _time(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1088, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out")
    args = parser.parse_args()
    assert cpu_lib.load(), "the fastflow_cpu library must build"
    rows = []
    for batch in args.batches:
        for length in args.lengths:
            q = torch.randn(batch, 9, 1, 64, dtype=torch.bfloat16)
            filled = torch.tensor(length)
            calls = {name: (lambda c=_caches(batch, length, fmt): torch.ops.fastflow_cpu.attention_decode(
                q, c[0], c[1], filled, 0.125, 0, None)) for name, fmt in FORMATS.items()}
            n = max(20, 200_000 // (batch * length))
            times = {name: [] for name in calls}
            for name, fn in calls.items():
                _time(fn, n)  # warm-up
            for _ in range(args.rounds):
                for name, fn in calls.items():
                    times[name].append(_time(fn, n))
            for name, fmt in FORMATS.items():
                k, v = _caches(1, 1, fmt)
                row_bytes = k.shape[-1] * k.element_size()
                rows.append({"batch": batch, "filled": length, "cache": name, "us": statistics.median(times[name]),
                             "cache_bytes": 2 * batch * 3 * length * row_bytes})
                base = statistics.median(times["bfloat16"])
                rows[-1]["speedup_vs_bf16"] = base / rows[-1]["us"]
                print(f"b{batch} filled {length:5d} {name:9s} {rows[-1]['us']:8.1f} us  "
                      f"x{rows[-1]['speedup_vs_bf16']:.2f}  {rows[-1]['cache_bytes'] / 2**20:.2f} MiB/layer")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"environment": environment(), "threads": torch.get_num_threads(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
