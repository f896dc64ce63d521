"""`torch.ops.fastflow_cpu.gemm` and `int4_gemm`: a prompt's linears where torch has no fast kernel for them.

    gemm(x, w, scale or None, bias or None)       = (x @ w.T) * scale + bias    w: bf16 / fp16 / int8 (N, K)
    int4_gemm(x, packed, scale_zeros, bias, G)    = x @ W.T + bias              W: int4_gemv's layout

fp32 products and sums, one rounding to x's dtype (fp32, bf16 or fp16); the references below. The C++
(cpu_gemm.cpp) widens the weight block by block into fp32 panels and runs a register-tiled FMA GEMM:
on an AVX2 CPU torch's bf16 GEMM is emulated (far below the FMA peak:
docs/performance.md#decode-attention-packed-linears-and-prompts) and its quantized CPU kernels are
GEMVs run row after row, so a prompt's linears were the slowest part of a prompt there. On CPUs with
AMX, bf16 x against int8 weights, or int4 weights in groups of a multiple of 32, takes tile multiplies
over weight blocks widened to bf16 in L1 instead (cpu_gemm_amx.cpp: the weight read once, the
multiply on the matrix unit); same definition, fp32 sums in another order.

Who calls it, and from how many rows (`prompt_gemm_min_rows`, searched per machine and weight shape):
- bf16 / fp16 `nn.Linear`s of a model `optimize()` patched (ffl_backend/prompt_linears.py), on CPUs
  without native bf16 matrix instructions (`replaces_bf16_matmul`; with AMX or AVX512-BF16 oneDNN's
  bf16 GEMM is the faster one);
- int8 / int4 weight-only linears (quant_linear.py), where the row kernels would otherwise take a
  prompt row by row; on CPUs with native bf16 matmul, only below the rows from which widening the
  whole weight to bf16 for oneDNN is faster (quant_linear.WIDEN_MIN_ROWS).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..numerics import acc_dtype
from . import autotune, cpu_gemv, cpu_lib
from .cpu_isa import target_has
from .int4_layout import INT4_ROWS, int4_gemv_ref

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.int8)

# Rows from which a prompt's linear takes the GEMM, searched per machine and weight shape among these
# (the first where the search is off; the last: never). Below, the caller's own path (F.linear, the
# quantized row kernels) is at least as fast: the GEMM widens the whole weight once per call.
MIN_ROWS_CHOICES = (8, 2, 4, 16, 32, 64, 1 << 30)
_TUNING_ROWS = (2, 4, 8, 16, 32, 64)  # the prompt sizes a threshold is judged on


def gemm_ref(x: Tensor, weight: Tensor, scale: Optional[Tensor] = None, bias: Optional[Tensor] = None) -> Tensor:
    """Pure-torch reference of `gemm`: fp32 (float64 for float64 inputs) products and sums, the scale
    and bias in that precision, one rounding to x's dtype."""
    acc = acc_dtype(x)
    y = x.to(acc) @ weight.to(acc).T
    if scale is not None:
        y = y * scale.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def int4_gemm_ref(x: Tensor, packed: Tensor, scale_zeros: Tensor, bias: Optional[Tensor], group_size: int) -> Tensor:
    """Pure-torch reference of `int4_gemm`: the same definition as `int4_gemv`'s."""
    return int4_gemv_ref(x, packed, scale_zeros, bias, group_size)


@cpu_lib.fake("gemm")
def _fake_gemm(x: Tensor, weight: Tensor, scale, bias) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@cpu_lib.fake("int4_gemm")
def _fake_int4_gemm(x: Tensor, packed: Tensor, scale_zeros, bias, group_size: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0] * INT4_ROWS))


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether this process multiplies bf16 matrices natively (AMX tiles or AVX512-BF16, on the CPU and
    allowed by FFL_CPU_MARCH): then oneDNN's bf16 GEMM serves a prompt, else `gemm` does."""
    return target_has("amx_tile") or target_has("avx512_bf16")


def available() -> bool:
    """Whether the ops are built here (the fastflow_cpu library; its prefetch distances are the GEMVs')."""
    return cpu_gemv.ready()


def replaces_bf16_matmul() -> bool:
    """Whether bf16 / fp16 prompts take fastflow's fp32 tiles (`gemm`, `prefill_attention`) instead of
    torch's kernels: on CPUs without native bf16 matmul, where torch's are emulated."""
    return not native_bf16_matmul() and available()


def takes(x: Tensor, weight: Tensor) -> bool:
    """Whether `gemm` accepts these operands: a floating x with rows, an (N, K) weight of a supported
    dtype, no gradient to compute (the op has no backward)."""
    return (x.dtype in ACTIVATION_DTYPES and weight.dtype in WEIGHT_DTYPES and weight.dim() == 2
            and x.dim() >= 1 and x.shape[-1] == weight.shape[1] and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def prompt_gemm_min_rows(kind: str, n: int, k: int, make_paths=None) -> int:
    """The row count from which a linear of `kind` ("bf16", "fp16", "int8", "int4") with an (n, k)
    weight takes the GEMM on this machine (autotune.row_threshold). `make_paths()` gives {False: the
    caller's own path, True: the GEMM} on a random weight of that shape (bf16 / fp16: F.linear against
    `gemm`, made here)."""
    return autotune.row_threshold(f"prompt_gemm_min_rows:{kind}", (n, k), MIN_ROWS_CHOICES, _TUNING_ROWS,
                                  make_paths or functools.partial(_float_paths, kind, n, k))


def _float_paths(kind: str, n: int, k: int) -> dict:
    """{False: F.linear, True: gemm} for a random (n, k) bf16 or fp16 weight."""
    w = (torch.randn(n, k) / k**0.5).to(torch.bfloat16 if kind == "bf16" else torch.float16)
    return {False: lambda x: torch.nn.functional.linear(x.to(w.dtype), w),
            True: lambda x: torch.ops.fastflow_cpu.gemm(x.to(w.dtype), w, None, None)}


def use_gemm(x: Tensor, kind: str, n: int, k: int, make_paths=None) -> bool:
    """Whether this call of a `kind` linear with an (n, k) weight takes the GEMM (see the module doc;
    `make_paths`: as for `prompt_gemm_min_rows`)."""
    rows = x.numel() // max(1, x.shape[-1])
    return (rows >= min(MIN_ROWS_CHOICES) and x.dtype in ACTIVATION_DTYPES and available()
            and rows >= prompt_gemm_min_rows(kind, n, k, make_paths))
