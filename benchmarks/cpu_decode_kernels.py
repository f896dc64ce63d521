"""The CPU decode kernels one call at a time, for A/B runs across versions of the library:
`attention_decode` (SmolLM2-135M's 9/3 heads of 64, Gemma-3-270M's 4/1 of 256; batch 1 and 4; 48,
300 and 1000 filled slots of a 2048-slot bf16 cache) and the small-batch GEMVs on a weight that sits
in L2 (1024 x 576; `gemv_q16` int8 and `gemv` bf16 with bf16 x; 1, 2, 4 and 8 rows; one thread), so
that the arithmetic, not the memory stream, is what is timed. Median microseconds per call of 5
rounds. The ops' signatures are the same in every version since the library gained gemv_q16 (the
attention op was called `decode_attention` before 2026-12-06; either name is used), so an older
checkout can run this file:

    python benchmarks/cpu_decode_kernels.py --label after --out FILE.json
    PYTHONPATH=<old checkout> FFL_CACHE_DIR=<fresh dir> \
        python benchmarks/cpu_decode_kernels.py --label before --out FILE.json
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

ATTENTION_SHAPES = {"smollm2 9/3x64": (9, 3, 64), "gemma3 4/1x256": (4, 1, 256)}


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    for _ in range(max(10, calls // 10)):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return round(statistics.median(times) * 1e6, 2)


def attention_rows() -> dict:
    ops, out = torch.ops.fastflow_cpu, {}
    attend = ops.attention_decode if hasattr(ops, "attention_decode") else ops.decode_attention
    for name, (hq, hkv, d) in ATTENTION_SHAPES.items():
        for batch in (1, 4):
            q = torch.randn(batch, hq, 1, d, dtype=torch.bfloat16)
            k = torch.randn(batch, hkv, 2048, d, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            for filled in (48, 300, 1000):
                f = torch.tensor(filled)
                out[f"{name} b{batch} filled {filled}"] = per_call_us(
                    lambda: attend(q, k, v, f, d ** -0.5, 0, None), calls=300)
    return out


def gemv_rows() -> dict:
    ops, out = torch.ops.fastflow_cpu, {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w8, scale = torch.randint(-127, 128, (1024, 576), dtype=torch.int8), torch.rand(1024)
        w16 = torch.randn(1024, 576, dtype=torch.bfloat16)
        for rows in (1, 2, 4, 8):
            x = torch.randn(rows, 576, dtype=torch.bfloat16)
            out[f"gemv_q16 int8 {rows} rows"] = per_call_us(lambda: ops.gemv_q16(x, [w8], [scale], []), 1000)
            out[f"gemv bf16 {rows} rows"] = per_call_us(lambda: ops.gemv(x, [w16], [], []), 1000)
    finally:
        torch.set_num_threads(threads)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="", help="what this run measures (e.g. the commit)")
    p.add_argument("--out", help="JSON file to append this row to")
    args = p.parse_args(argv)
    from ffl_backend.bench.grid import report_row
    from ffl_backend.kernels import cpu_lib

    if not cpu_lib.load():
        raise SystemExit(f"CPU kernels not built: {cpu_lib.load_error()}")
    report_row({"label": args.label, "march": cpu_lib.target_arch(), "threads": torch.get_num_threads(),
                "us_per_call": {**attention_rows(), **gemv_rows()}}, args.out)


if __name__ == "__main__":
    main()
