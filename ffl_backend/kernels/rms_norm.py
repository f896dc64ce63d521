"""RMSNorm and residual-add + RMSNorm: `torch.ops.fastflow.rms_norm` / `add_rms_norm`.

Model differences are parameters, not copies:
- `offset`: Gemma scales by `1 + w` (offset=1.0); Llama, Mistral, Qwen, Phi-3 by `w` (offset=0.0).
- `weight_in_fp32`: where HF applies the weight. Llama: `w * normed.to(input_dtype)` (round, then
  multiply in the weight's dtype). Gemma: `(normed * (1 + w.float())).type_as(x)` (multiply in fp32,
  round once). The two round differently in bf16, so each model gets its own cast order.

CPU path: the ops are `triton_op`s whose body on a non-CUDA tensor is the reference, so under
torch.compile Inductor traces the reference and fuses it into one C++ loop per row, which also fuses
with its neighbours; an opaque call cannot (it beat one in a scratch timing when this op was written;
no committed benchmark). On CUDA the body is the Triton kernel.
"""
from __future__ import annotations

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


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
                 weight_in_fp32: bool = False) -> Tensor:
    """HF's RMSNorm in HF's cast order (LlamaRMSNorm, or GemmaRMSNorm when weight_in_fp32).

    HF computes in fp32 (`x.float()`); here it is "at least fp32" so a float64 run of this
    reference is a true high-precision reference for the tests, and fp32/bf16 runs are HF's."""
    acc = acc_dtype(x)
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        return (normed * (offset + weight.to(acc))).to(x.dtype)
    w = weight + offset if offset else weight
    return w * normed.to(x.dtype)


def add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
                     weight_in_fp32: bool = False) -> tuple[Tensor, Tensor]:
    """`h = residual + x; (rms_norm(h), h)`: the decoder's residual add fused with the next norm."""
    hidden = residual + x
    return rms_norm_ref(hidden, weight, eps, offset, weight_in_fp32), hidden


def _out_dtype(x: Tensor, weight: Tensor, weight_in_fp32: bool) -> torch.dtype:
    return x.dtype if weight_in_fp32 else torch.promote_types(x.dtype, weight.dtype)


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, hid_ptr, n_cols, x_stride, res_stride,
                         out_stride, hid_stride, eps, offset,
                         HAS_RESIDUAL: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr,
                         BLOCK: tl.constexpr):
        # One program per row. Pass 1 accumulates the sum of squares in fp32 (and, with a residual,
        # writes h = residual + x rounded to the storage dtype, as HF's eager add does); pass 2
        # re-reads the row (from L1/L2) and applies the scale in the model's cast order.
        row = tl.program_id(0).to(tl.int64)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
                x = (r.to(tl.float32) + x.to(tl.float32)).to(hid_ptr.dtype.element_ty)
                tl.store(hid_ptr + row * hid_stride + cols, x, mask=mask)
            xf = x.to(tl.float32)
            acc += xf * xf
        inv_rms = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            if HAS_RESIDUAL:
                x = tl.load(hid_ptr + row * hid_stride + cols, mask=mask, other=0.0)
            else:
                x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
            normed = x.to(tl.float32) * inv_rms
            if not WEIGHT_IN_FP32:
                normed = normed.to(x.dtype).to(tl.float32)  # HF rounds before the weight multiply
            tl.store(out_ptr + row * out_stride + cols, (normed * w).to(out_ptr.dtype.element_ty),
                     mask=mask)



def _launch_rms(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, offset: float,
                weight_in_fp32: bool) -> tuple[Tensor, Tensor | None]:
    n = x.shape[-1]
    x2 = rows_2d(x)
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight, weight_in_fp32), device=x.device)
    out2 = out.view(-1, n)
    if residual is not None:
        r2 = rows_2d(residual)
        hidden = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        h2 = hidden.view(-1, n)
    else:
        r2 = h2 = hidden = None
    block = row_block(n)
    launch(_rms_norm_kernel, (x2.shape[0],), x2, r2 if r2 is not None else x2, weight.contiguous(),
           out2, h2 if h2 is not None else out2, n, x2.stride(0),
           r2.stride(0) if r2 is not None else 0, out2.stride(0), h2.stride(0) if h2 is not None else 0,
           eps, offset, HAS_RESIDUAL=residual is not None, WEIGHT_IN_FP32=weight_in_fp32,
           BLOCK=block, num_warps=row_warps(block))
    return out, hidden


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
                    weight_in_fp32: bool = False) -> Tensor:
    """The Triton kernel on any tensor Triton can address (CUDA, or CPU under TRITON_INTERPRET)."""
    return _launch_rms(x, None, weight, eps, offset, weight_in_fp32)[0]


def add_rms_norm_triton(x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
                        weight_in_fp32: bool = False) -> tuple[Tensor, Tensor]:
    return _launch_rms(x, residual, weight, eps, offset, weight_in_fp32)


@torch.library.triton_op("fastflow::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
             weight_in_fp32: bool = False) -> Tensor:
    if on_triton_device(x):
        return rms_norm_triton(x, weight, eps, offset, weight_in_fp32)
    return rms_norm_ref(x, weight, eps, offset, weight_in_fp32)


@torch.library.triton_op("fastflow::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
                 weight_in_fp32: bool = False) -> tuple[Tensor, Tensor]:
    if on_triton_device(x):
        return add_rms_norm_triton(x, residual, weight, eps, offset, weight_in_fp32)
    return add_rms_norm_ref(x, residual, weight, eps, offset, weight_in_fp32)


def aot_specs() -> list[AotSpec]:
    """Every (dtype, block size, residual, cast order) the launcher can pick."""
    return row_kernel_specs(
        "rms_norm", _rms_norm_kernel, ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "hid_ptr"),
        {"n_cols": "i32", "x_stride": "i64", "res_stride": "i64", "out_stride": "i64", "hid_stride": "i64",
         "eps": "fp32", "offset": "fp32"},
        {"HAS_RESIDUAL": (False, True), "WEIGHT_IN_FP32": (False, True)})
