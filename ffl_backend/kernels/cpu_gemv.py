"""`torch.ops.fastflow_cpu.gemv`: the decode GEMV of the fastflow_cpu library (cpu_lib.py).

    gemv(x, [w_1..w_n], [s_1..s_n] or [], [b_1..b_n] or []) = cat([(x @ w_i.T) * s_i + b_i for each i], -1)

One to MAX_ROWS rows of x (a small batch's decode step: each weight row is loaded once for all of
them); weights int8 (weight-only quantized, `s_i` per output channel) or bf16, all of one dtype
and width; products and sums in fp32, one rounding to x's dtype. Siblings that read the same x
(q/k/v, gate/up) go in one call: one parallel loop streams all their rows. The decode_gemv pattern
family calls it for single-row linears (option `cpu_gemv`) instead of Inductor's loop, because it
prefetches ahead (cpu_gemv.cpp says why; benchmarks/results/cpu_gemv_ab_cpu.json has the A/B).

`torch.ops.fastflow_cpu.gemv_q16` takes the same operands with int8 weights and computes with integer
dot products (cpu_gemv_q16.cpp): each row of x quantized once per call to int16 with one scale,
`quantize_rows_int16`, then exact integer sums; its reference is `gemv_q16_ref`, equal bit for bit.
Which of the two the decode_gemv family calls is the option `int8_activations` (`int8_activations`
below resolves its "auto").

The GEMVs (and cpu_gemm's GEMM) read ahead by prefetch distances tuned per machine: `ready()` sets
them on first use (autotune.tune_prefetch), so callers ask `ready()` rather than `cpu_lib.load()`.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ..numerics import acc_dtype
from . import autotune, cpu_lib

WEIGHT_DTYPES = (torch.int8, torch.bfloat16)
MAX_ROWS = 8  # cpu_gemv.cpp's kMaxRows
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_prefetch_tuned: list = []  # [True] once this process has set the tuned distances


def ready() -> bool:
    """Whether the library's GEMVs are usable here: built and loaded, and (once per process, outside
    torch.compile) their prefetch distances set to this machine's choice, searched if not cached."""
    if not cpu_lib.load():
        return False
    if not _prefetch_tuned and not torch.compiler.is_compiling():
        autotune.tune_prefetch()
        _prefetch_tuned.append(True)
    return True


@cpu_lib.fake("gemv")
@cpu_lib.fake("gemv_q16")
def _fake_gemv(x: Tensor, weights, scales, biases) -> Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def gemv_ref(x: Tensor, weights: Sequence[Tensor], scales: Sequence[Tensor] = (),
             biases: Sequence[Tensor] = ()) -> Tensor:
    """Pure-torch reference of the op: fp32 products and sums, one rounding to x's dtype."""
    acc = acc_dtype(x)  # float64 inputs: an exact reference
    outs = []
    for i, w in enumerate(weights):
        y = x.to(acc) @ w.to(acc).T
        if scales:
            y = y * scales[i].to(acc)
        if biases:
            y = y + biases[i].to(acc)
        outs.append(y.to(x.dtype))
    return torch.cat(outs, -1)


INT16_MAX = 32767.0


def quantize_rows_int16(x: Tensor) -> tuple[Tensor, Tensor]:
    """gemv_q16's activation quantization: per row q = round_half_even(x * (32767 / max|x|)) as int64,
    step = max|x| / 32767, both in fp32 as the kernel computes them (a zero row: q = 0, step = 0)."""
    xf = x.reshape(-1, x.shape[-1]).float()
    largest = xf.abs().amax(dim=1, keepdim=True)
    nonzero = largest > 0
    inv = torch.where(nonzero, torch.tensor(INT16_MAX) / torch.where(nonzero, largest, 1.0), 0.0)
    q = torch.round(xf * inv).clamp_(-INT16_MAX, INT16_MAX).to(torch.int64)
    step = torch.where(nonzero, largest / torch.tensor(INT16_MAX), 0.0)
    return q, step


def gemv_q16_ref(x: Tensor, weights: Sequence[Tensor], scales: Sequence[Tensor] = (),
                 biases: Sequence[Tensor] = ()) -> Tensor:
    """Pure-torch reference of gemv_q16: exact integer sums of the int16 rows and int8 weights, then
    in fp32 sum * step, * scale, + bias, one rounding to x's dtype -- the kernel's operations in its order."""
    q, step = quantize_rows_int16(x)
    outs = []
    for i, w in enumerate(weights):
        y = (q @ w.to(torch.int64).T).float() * step
        if scales:
            y = y * scales[i].float()
        if biases:
            y = y + biases[i].float()
        outs.append(y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0]))
    return torch.cat(outs, -1)


def int8_activations(choice: str) -> str:
    """The option int8_activations resolved: "auto" is "int16" where the library is built for this
    CPU and it has AVX512-VNNI (one `vpdpwssd` per 32 products; benchmarks/results/
    bench_smollm2_int8_activations_cpu_xeon: faster at batch 1 and 4), else "float" (AVX2 machines:
    not yet measured)."""
    if choice != "auto":
        return choice
    return "int16" if cpu_lib.target_has("avx512_vnni") else "float"


def takes(x, weight, *vectors) -> bool:
    """Whether the op accepts these operands (real or fake tensors; None vectors are absent): 1 to
    MAX_ROWS rows of a supported dtype, a contiguous (N, K) int8/bf16 weight, floating (N,) scale/bias vectors, and
    no gradient to compute -- the op has no backward. The one definition both callers use."""
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor) or x.dim() < 1:
        return False
    if x.dtype not in ACTIVATION_DTYPES or x.shape[-1] == 0 or not 1 <= x.numel() // x.shape[-1] <= MAX_ROWS:
        return False
    if weight.dtype not in WEIGHT_DTYPES or weight.dim() != 2 or not weight.is_contiguous():
        return False
    vectors = [v for v in vectors if v is not None]
    if any(not isinstance(v, Tensor) or tuple(v.shape) != (weight.shape[0],) or not v.is_floating_point()
           for v in vectors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, *vectors)))
