"""The CPU decode GEMVs alone, layer by layer: fastflow's kernels (`fastflow_cpu::gemv` for int8 and
bf16, `int4_gemv`) against torch's own (`_weight_int8pack_mm`, `F.linear`, `_weight_int4pack_mm_for_cpu`)
and `gemv_q16` (int8 over int16-quantized activations) over 30 SmolLM2-135M-shaped layers (q, k, v, o,
gate, up, down; random weights), bf16 x of `--rows` rows (1: batch-1 decode; 2-8: a small batch's step).

Every layer has weights of its own, as in a real decode step: one weight timed over and over would sit
in L2 and measure the cache, not the stream. Each kernel times 30 layers' worth of calls, median and
min of 7 passes. Which instruction-set path the kernel took follows from the CPU (or FFL_CPU_MARCH).

    python benchmarks/cpu_gemv_layers.py [--group-size 32] [--rows 1] [--out benchmarks/results/cpu_gemv_layers.json]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

SMOLLM2_LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LAYERS = 30


def time_passes(fn, calls, passes: int = 7) -> dict:
    """Median and min over `passes` of calling `fn` on every argument tuple of `calls` (one warm-up first)."""
    fn(*calls[0])
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        for args in calls:
            fn(*args)
        times.append(time.perf_counter() - start)
    return {"median_ms": round(statistics.median(times) * 1e3, 2), "min_ms": round(min(times) * 1e3, 2)}


def _calls(group_size: int, rows: int = 1) -> dict:
    from ffl_backend.kernels import int4_layout
    from ffl_backend.kernels.quant_linear import int4_cpu_scale_zeros

    x = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
    calls = {name: [] for name in ("int8", "bf16", "int4", "torch_int4")}
    for _ in range(LAYERS):
        for n, k in SMOLLM2_LAYER:
            calls["int8"].append((x[k], torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) / 100))
            calls["bf16"].append((x[k], torch.randn(n, k, dtype=torch.bfloat16)))
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            scale_zeros = int4_cpu_scale_zeros(torch.rand(n, k // group_size) / 10,
                                               torch.full((n, k // group_size), 8.0))
            calls["int4"].append((x[k], *int4_layout.int4_layout(codes, scale_zeros, group_size)))
            calls["torch_int4"].append((x[k], torch._convert_weight_to_int4pack_for_cpu(codes.int(), 1), scale_zeros))
    return calls


def measure(group_size: int, rows: int = 1) -> dict:
    from ffl_backend.kernels import cpu_lib

    if not cpu_lib.load():
        raise SystemExit(f"CPU kernels not built: {cpu_lib.load_error()}")
    ops, calls = torch.ops.fastflow_cpu, _calls(group_size, rows)
    kernels = {
        "fastflow gemv int8": (lambda x, w, s: ops.gemv(x, [w], [s], []), calls["int8"]),
        "fastflow gemv_q16 int8": (lambda x, w, s: ops.gemv_q16(x, [w], [s], []), calls["int8"]),
        "torch _weight_int8pack_mm": (lambda x, w, s: torch._weight_int8pack_mm(x, w, s.to(x.dtype)), calls["int8"]),
        "fastflow gemv bf16": (lambda x, w: ops.gemv(x, [w], [], []), calls["bf16"]),
        "torch F.linear bf16": (torch.nn.functional.linear, calls["bf16"]),
        f"fastflow int4_gemv g{group_size}": (
            lambda x, p, sz: ops.int4_gemv(x, p, sz, None, group_size), calls["int4"]),
        f"torch _weight_int4pack_mm_for_cpu g{group_size}": (
            lambda x, p, sz: torch._weight_int4pack_mm_for_cpu(x, p, group_size, sz), calls["torch_int4"]),
    }
    return {"layers_per_pass": LAYERS, "rows": rows, "march": cpu_lib.target_arch(), "threads": torch.get_num_threads(),
            "ms_per_pass": {name: time_passes(fn, args) for name, (fn, args) in kernels.items()}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--rows", type=int, default=1, help="activation rows per call (1 to 8)")
    p.add_argument("--out", help="JSON file to append this row to")
    args = p.parse_args(argv)
    from ffl_backend.bench.grid import report_row

    report_row(measure(args.group_size, args.rows), args.out)


if __name__ == "__main__":
    main()
