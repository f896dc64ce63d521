"""Prompt processing's linears alone: M rows (a 512-token prompt) through a model's layers' linears
(random weights) per candidate CPU path, bf16 activations. `--shape smollm2-135m`: one layer's seven
linears (q, k, v, o, gate, up, down), 30 layers; `--shape llama-3.2-3b`: the four a layer runs after
optimize()'s horizontal fusion (qkv, o, gate-up, down), 4 layers (0.8 GB of bf16 weights).

Candidates per weight format: the row kernels (torch's int8, fastflow's int4_gemv); the op as
quant_linear runs it (it widens from WIDEN_MIN_ROWS rows where the CPU has native bf16 matrices);
"widen then GEMM": the weight widened to bf16 right before a oneDNN bf16 GEMM, whose AMX /
AVX-512-BF16 paths serve the multiply; for int8 also an integer GEMM (`torch._int_mm`) on
activations quantized per token; fastflow's fp32 GEMM over weights widened block by block
(`fastflow_cpu::gemm` / `int4_gemm`, kernels/cpu_gemm.py: with AMX, tile multiplies over blocks widened
in L1 for int8 / int4). Median and min of 5 passes over all layers' calls (each layer its own weights, as
in a real prompt: SmolLM2's 212 MB of bf16 weights stream from DRAM where the L3 is smaller).
FFL_CPU_MARCH / ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA select the instruction sets (the record says
which), e.g. the AVX2 proxy on an AVX-512 machine: FFL_CPU_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2.

    python benchmarks/prefill_linear_paths.py [--rows 512] [--shape smollm2-135m|llama-3.2-3b] \
        [--out benchmarks/results/prefill_linear_paths_cpu_<cpu>.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform

import torch
import torch.nn.functional as F
from cpu_gemv_layers import time_passes  # a sibling script: run from the repository root as shown

SHAPES = {  # (n, k) of one layer's linears, layers
    "smollm2-135m": ([(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)], 30),
    "llama-3.2-3b": ([(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)], 4),
}
GROUP = 32


def _layers(rows: int, shape: str) -> list:
    from ffl_backend import numerics as P
    from ffl_backend.kernels.quant_linear import int4_cpu_form

    linears, layers = SHAPES[shape]
    x = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {k for _, k in linears}}
    out = []
    for _ in range(layers):
        for n, k in linears:
            w = torch.randn(n, k) / k**0.5
            q8, s8 = P.quantize_int8(w, torch.bfloat16)
            q4, s4, z4 = P.quantize_int4(w, GROUP, scale_dtype=torch.bfloat16)
            packed4, sz4 = int4_cpu_form(P.pack_int4(q4), s4, z4, GROUP)
            out.append(dict(x=x[k], w=w.to(torch.bfloat16), q8=q8, s8=s8, q4=P.pack_int4(q4), s4=s4, z4=z4,
                            packed4=packed4, sz4=sz4))
    return out


def candidates() -> dict:
    from ffl_backend import numerics as P
    from ffl_backend.kernels.quant_linear import int4_cpu_linear

    def int8_activations(c):
        qx, xs = P.quantize_act_int8(c["x"].float())
        return (torch._int_mm(qx, c["q8"].T).float() * xs * c["s8"].float()).to(torch.bfloat16)

    def int4_kernel(c):
        return torch.ops.fastflow_cpu.int4_gemv(c["x"], c["packed4"], c["sz4"], None, GROUP)

    return {
        "bf16 F.linear": lambda c: F.linear(c["x"], c["w"]),
        "int8 _weight_int8pack_mm": lambda c: torch._weight_int8pack_mm(c["x"], c["q8"], c["s8"]),
        "int8 widen then GEMM": lambda c: F.linear(c["x"], c["q8"].to(torch.bfloat16) * c["s8"][:, None]),
        "int8 x int8 _int_mm (per-token x)": int8_activations,
        "int4 fastflow int4_gemv": int4_kernel,
        "int4 widen then GEMM (torch)": lambda c: F.linear(
            c["x"], P.dequantize_int4(c["q4"], c["s4"], c["z4"], GROUP, torch.bfloat16)),
        "int4 widen then GEMM (int4_widen)": lambda c: F.linear(
            c["x"], torch.ops.fastflow_cpu.int4_widen(c["packed4"], c["sz4"], GROUP)),
        "int4 op (quant_linear's CPU path)": lambda c: int4_cpu_linear(c["x"], c["packed4"], c["sz4"], GROUP, None),
        "int8 op (quant_linear's CPU path)": lambda c: torch.ops.fastflow.int8_linear(c["x"], c["q8"], c["s8"], None,
                                                                                        c["s8"]),
        "bf16 fastflow gemm": lambda c: torch.ops.fastflow_cpu.gemm(c["x"], c["w"], None, None),
        "int8 fastflow gemm": lambda c: torch.ops.fastflow_cpu.gemm(c["x"], c["q8"], c["s8"], None),
        "int4 fastflow int4_gemm": lambda c: torch.ops.fastflow_cpu.int4_gemm(c["x"], c["packed4"], c["sz4"], None,
                                                                               GROUP),
    }


def cpu_model() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--out")
    args = parser.parse_args()
    from ffl_backend.kernels import cpu_lib

    if not cpu_lib.load():
        raise SystemExit(f"CPU kernels not built: {cpu_lib.load_error()}")
    torch.manual_seed(0)
    layers = _layers(args.rows, args.shape)
    linears, count = SHAPES[args.shape]
    flops = 2 * args.rows * sum(n * k for n, k in linears) * count
    results = {}
    for name, fn in candidates().items():
        timing = time_passes(lambda c: fn(c), [(c,) for c in layers], passes=5)
        timing["gflops"] = round(flops / timing["median_ms"] / 1e6, 1)
        results[name] = timing
        print(f"{name:<28} {timing['median_ms']:8.1f} ms  (min {timing['min_ms']:.1f})  "
              f"{timing['gflops']:7.1f} GFLOP/s", flush=True)
    record = {"shape": args.shape, "rows": args.rows, "layers": count, "group_size": GROUP,
              "threads": torch.get_num_threads(),
              "cpu": cpu_model(), "march": cpu_lib.target_arch(), "aten": torch.backends.cpu.get_cpu_capability(),
              "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "default"), "torch": torch.__version__,
              "results": results}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)


if __name__ == "__main__":
    main()
