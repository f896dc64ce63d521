"""Where a SmolLM2-135M decode step goes: torch.profiler over one timed greedy generate() (batch 1,
static cache; --batch for more rows), per-step milliseconds grouped into weight GEMVs, other compiled
kernels, attention, the compiled graph's own Python wrapper, Dynamo's guard check and everything else (HF generate).

    python benchmarks/profile_decode.py --dtype float32 --backend inductor
    python benchmarks/profile_decode.py --dtype float32 --backend fastflow [--options '{"bf16_exact_weights": false}']
    python benchmarks/profile_decode.py --dtype bfloat16 --backend fastflow --quant int4-all   (quantized first)
    python benchmarks/profile_decode.py ... --out benchmarks/results/profile_decode_cpu.json   (appends a row)

Inductor's C++ kernels are profiled by name (`cpp.enable_kernel_profile`); a fused kernel that
holds a GEMV loop counts as a GEMV kernel (the GEMVs dominate it). Profiling adds ~5% to the step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from ffl_backend.bench.grid import report_row

GROUPS = {  # first matching rule wins; keys are profiler event names (substrings)
    "gemv (aten::mm / packed / int8 / int4 / fastflow_cpu::gemv, int4_gemv)": (
        "aten::mm", "mkldnn::_linear_pointwise", "_weight_int8pack_mm", "_weight_int4pack_mm", "fastflow_cpu::"),
    "attention (aten sdpa)": ("scaled_dot_product",),
    "compiled graph wrapper (Python)": ("## Call CompiledFxGraph",),
    "Dynamo guards": ("TorchDynamo Cache Lookup",),
}


def _group(name: str) -> str:
    if name.startswith("graph_") and "cpp_fused" in name:
        return "Inductor C++ kernels (GEMVs fused in, fastflow)" if "sum" in name else "Inductor C++ kernels"
    for group, keys in GROUPS.items():
        if any(k in name for k in keys):
            return group
    return "other (HF generate, small ops)"


def profile(dtype: str, backend: str, options: dict | None, new_tokens: int, quant: str = "none",
            batch: int = 1) -> dict:
    from ffl_backend.bench.session import load_model, prompt_ids, time_generate
    from ffl_backend.generation import configure_generate
    from ffl_backend.models import smollm2_path

    model, tok, _, _ = load_model({"model": str(smollm2_path()), "dtype": dtype, "quant": quant})
    ids = prompt_ids(tok, 16).repeat(batch, 1)
    opts = {**(options or {}), "inductor_config": {"cpp.enable_kernel_profile": True}}
    if backend == "inductor":
        opts = {"cpp.enable_kernel_profile": True}
    configure_generate(model, backend=None if backend == "eager" else backend, options=opts,
                       max_cache_len=16 + new_tokens)
    for _ in range(2):
        time_generate(model, ids, new_tokens)
    rates = [time_generate(model, ids, new_tokens)["decode_tok_s"] for _ in range(3)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        time_generate(model, ids, new_tokens)
    steps = new_tokens - 1
    groups: dict = {}
    for event in prof.key_averages():
        groups[_group(event.key)] = groups.get(_group(event.key), 0.0) + event.self_cpu_time_total / 1e3 / steps
    return {"dtype": dtype, "quant": quant, "backend": backend, "options": options or {}, "batch": batch,
            "decode_tok_s": round(statistics.median(rates), 1), "step_ms": round(1e3 / statistics.median(rates), 2),
            "profiled_ms_per_step": {k: round(v, 2) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--backend", default="fastflow", choices=["eager", "inductor", "fastflow"])
    p.add_argument("--options", type=json.loads, default=None, help="fastflow options as JSON")
    p.add_argument("--quant", default="none", help="scheme or preset (int8, int8-all, int4-all, ...)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="rows per step (the same prompt repeated)")
    p.add_argument("--out", help="JSON file to append this row to")
    args = p.parse_args()
    row = profile(args.dtype, args.backend, args.options, args.new_tokens, args.quant, args.batch)
    report_row(row, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
