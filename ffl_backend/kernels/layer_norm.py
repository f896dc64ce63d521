"""LayerNorm over the last dim: `torch.ops.fastflow.layer_norm(x, weight?, bias?, eps)`.

Semantics of `F.layer_norm(x, (N,), weight, bias, eps)`, which is what `nn.LayerNorm` runs in GPT-2
(`ln_1`, `ln_2`, `ln_f`) and GPT-NeoX (`input_layernorm`, `post_attention_layernorm`,
`final_layer_norm`). Cast order: for bf16/fp16 inputs torch computes the mean, the (biased)
variance, the normalisation and the affine `* w + b` all in fp32 and rounds once, to the input
dtype, at the very end. Rounding the normalised value before the affine step (what a naive bf16
kernel does) changes a large share of bf16 outputs of a GPT-2 norm; the single rounding changes only
the rare ones where ulp-level fp32 reduction-order differences straddle a bf16 rounding boundary
(figures: docs/performance.md#numerics).

CPU path: as for rms_norm, the op is a `triton_op` whose body on a non-CUDA tensor is the reference,
so Inductor traces the reference and fuses it; on CUDA the body is the Triton kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..numerics import acc_dtype
from ._triton import (
    HAS_TRITON,
    AotSpec,
    launch,
    on_triton_device,
    row_block,
    row_kernel_specs,
    row_warps,
    rows_2d,
    tl,
    triton,
)


def layer_norm_ref(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                   eps: float) -> Tensor:
    """`F.layer_norm(x, (N,), weight, bias, eps)` written out in torch's cast order.

    Two-pass statistics (mean first, then the mean of squared deviations) rather than
    E[x^2] - E[x]^2: hidden states of GPT-style models carry large per-row offsets (massive
    activations), where the one-pass formula cancels catastrophically in fp32.
    """
    xf = x.to(acc_dtype(x))
    mean = xf.mean(-1, keepdim=True)
    centered = xf - mean
    var = centered.pow(2).mean(-1, keepdim=True)  # biased (divide by N), as layer_norm defines it
    y = centered * torch.rsqrt(var + eps)
    # The affine step stays in the accumulation dtype: torch does not round before it.
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n_cols, x_stride, out_stride, eps,
                           HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        # One program per row. Pass 1 computes each BLOCK chunk's count, mean and sum of squared
        # deviations exactly as the two-pass reference does, and merges the chunks with Chan's
        # parallel-variance formula. That keeps the numerical stability of two-pass variance while
        # reading a wide row only once for the statistics (a third, mean-only pass would read it
        # twice). For rows <= BLOCK (every hidden size up to 8192) it is literally two-pass
        # mean/variance on one register-resident chunk.
        row = tl.program_id(0).to(tl.int64)
        mean = 0.0
        m2 = 0.0
        count = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            xf = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
            # Counting the mask (not n_cols - start) keeps this identical in the interpreter, where
            # the loop variable is a Python int, and on the GPU.
            cnt_b = tl.sum(mask.to(tl.float32), axis=0)
            mean_b = tl.sum(xf, axis=0) / cnt_b
            dev = tl.where(mask, xf - mean_b, 0.0)  # padding lanes must not add (0 - mean)^2
            m2_b = tl.sum(dev * dev, axis=0)
            total = count + cnt_b
            delta = mean_b - mean
            mean = mean + delta * (cnt_b / total)
            m2 = m2 + m2_b + delta * delta * (count * cnt_b / total)
            count = total
        rstd = tl.rsqrt(m2 / n_cols + eps)
        # Pass 2 re-reads the row (from L1/L2) and applies normalisation and affine in fp32,
        # rounding once on the store, as torch does.
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            xf = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
            y = (xf - mean) * rstd
            if HAS_WEIGHT:
                y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)



def _check_affine(name: str, p: Optional[Tensor], n: int) -> None:
    if p is not None and p.numel() != n:
        raise ValueError(f"layer_norm: {name} has {p.numel()} elements, expected {n}")


def layer_norm_triton(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                      eps: float) -> Tensor:
    """The Triton kernel on any tensor Triton can address (CUDA, or CPU under TRITON_INTERPRET)."""
    n = x.shape[-1]
    _check_affine("weight", weight, n)
    _check_affine("bias", bias, n)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # layer_norm keeps x's dtype
    if out.numel() == 0:
        return out  # a zero-size grid is not launchable
    x2 = rows_2d(x)
    out2 = out.view(-1, n)
    w = weight.contiguous() if weight is not None else None
    b = bias.contiguous() if bias is not None else None
    block = row_block(n)
    # Absent weight/bias pass x2 as a never-dereferenced placeholder pointer (constexpr-guarded).
    launch(_layer_norm_kernel, (x2.shape[0],), x2, w if w is not None else x2,
           b if b is not None else x2, out2, n, x2.stride(0), out2.stride(0), eps,
           HAS_WEIGHT=w is not None, HAS_BIAS=b is not None, BLOCK=block,
           num_warps=row_warps(block))
    return out


@torch.library.triton_op("fastflow::layer_norm", mutates_args=())
def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
    if on_triton_device(x):
        return layer_norm_triton(x, weight, bias, eps)
    return layer_norm_ref(x, weight, bias, eps)


def aot_specs() -> list[AotSpec]:
    """Every (dtype, block size, weight?, bias?) the launcher can pick."""
    return row_kernel_specs(
        "layer_norm", _layer_norm_kernel, ("x_ptr", "w_ptr", "b_ptr", "out_ptr"),
        {"n_cols": "i32", "x_stride": "i64", "out_stride": "i64", "eps": "fp32"},
        {"HAS_WEIGHT": (False, True), "HAS_BIAS": (False, True)})
