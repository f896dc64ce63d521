"""Bias-add + GELU + residual-add: `torch.ops.fastflow.gelu_residual(x, bias?, residual?, approximate)`.

Computes `gelu(x + bias, approximate) + residual`, the MLP activation of GPT-2 (`gelu_new`, tanh)
and GPT-NeoX/Pythia (`gelu`, erf) with the bias add in front and an optional residual add behind.

Cast order, matching what eager HF runs in bf16/fp16:
- `x + bias` is an eager add: computed in fp32, rounded to the storage dtype.
- GELU in fp32, rounded once. `F.gelu` (HF's `GELUActivation` / `GELUTanh`) upcasts low-precision
  inputs to fp32 internally and rounds once, and this op does the same for both approximations.
  GPT-2's `NewGELUActivation` instead runs its formula op by op in the input dtype (bf16 rounds after
  the pow, the mul, the add, the tanh, ...); we deliberately do not replicate those five roundings:
  in fp32 the formulas are identical, in bf16 our single rounding is the more accurate result.
- `+ residual` is again an eager add: fp32, rounded to the (promoted) storage dtype.

CPU path: as for rms_norm, the op is a `triton_op` whose body on a non-CUDA tensor is the reference,
so Inductor traces the reference and fuses it; on CUDA the body is the Triton kernel.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..numerics import acc_dtype
from ._triton import AOT_DTYPES, HAS_TRITON, AotSpec, launch, on_triton_device, ptr, tl, triton

APPROXIMATIONS = ("none", "tanh")  # F.gelu's names: "none" = exact erf form, "tanh" = GPT-2's
# Elementwise: 1024 elements per program, 8 per thread at 4 warps (two 128-bit bf16 vectors).
BLOCK = 1024
NUM_WARPS = 4
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)


def _check_approximate(approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"gelu approximate must be one of {APPROXIMATIONS}, got {approximate!r}")



def gelu_ref(h: Tensor, approximate: str) -> Tensor:
    """GELU of `h` computed in fp32 (or float64), rounded once to h's dtype.

    The formulas are HF's own Python forms: erf is `GELUActivation._gelu_python`, tanh is
    `NewGELUActivation.forward` (= `GELUTanh._gelu_tanh_python`), so in fp32 they agree bit for bit.
    """
    _check_approximate(approximate)
    hf = h.to(acc_dtype(h))
    if approximate == "tanh":
        g = 0.5 * hf * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (hf + 0.044715 * torch.pow(hf, 3.0))))
    else:
        g = hf * 0.5 * (1.0 + torch.erf(hf / math.sqrt(2.0)))
    return g.to(h.dtype)


def gelu_residual_ref(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
                      approximate: str) -> Tensor:
    """`gelu(x + bias) + residual` in eager HF's cast order (see the module docstring)."""
    h = x + bias if bias is not None else x  # rounds to the storage dtype, as the eager add does
    out = gelu_ref(h, approximate)
    return out + residual if residual is not None else out


if HAS_TRITON:

    @triton.jit
    def _gelu_residual_kernel(x_ptr, bias_ptr, res_ptr, out_ptr, n_elements, n_cols,
                              TANH: tl.constexpr, HAS_BIAS: tl.constexpr,
                              HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        # Flat elementwise over contiguous tensors. int64 offsets: a (batch*seq, intermediate)
        # activation can pass 2^31 elements at long context.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            # bias is (N,), broadcast along the last dim of the row-major input.
            b = tl.load(bias_ptr + offs % n_cols, mask=mask, other=0.0)
            # Round the sum to the storage dtype before GELU, as HF's eager `x + bias` does.
            x = (x.to(tl.float32) + b.to(tl.float32)).to(x_ptr.dtype.element_ty)
        xf = x.to(tl.float32)
        if TANH:
            # 0.5 * x * (1 + tanh(u)) == x * sigmoid(2u) == x / (1 + exp(-2u)). tl.math has no
            # tanh; this form needs one exp, saturates cleanly (exp -> inf gives -0, exp -> 0 gives
            # x), and avoids the 1 + tanh(u) cancellation for negative x.
            u = 0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)
            g = xf / (1.0 + tl.exp(-2.0 * u))
        else:
            g = 0.5 * xf * (1.0 + tl.math.erf(xf * 0.7071067811865476))
        g = g.to(x_ptr.dtype.element_ty)  # HF rounds the activation before the residual add
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + offs, mask=mask, other=0.0)
            out = g.to(tl.float32) + r.to(tl.float32)
        else:
            out = g
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_residual_triton(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
                         approximate: str) -> Tensor:
    """The Triton kernel on any tensor Triton can address (CUDA, or CPU under TRITON_INTERPRET)."""
    _check_approximate(approximate)
    n = x.shape[-1] if x.dim() else 1
    # Dtypes follow eager promotion: h = x + bias, out = gelu(h) + residual. The kernel rounds to
    # x_ptr's dtype, so a mixed-dtype x is upcast to h's dtype here (exact; the rare case).
    h_dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
    out_dtype = h_dtype if residual is None else torch.promote_types(h_dtype, residual.dtype)
    if bias is not None and bias.numel() != n:
        raise ValueError(f"gelu_residual: bias has {bias.numel()} elements, expected {n}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"gelu_residual: residual shape {tuple(residual.shape)} != x shape "
                         f"{tuple(x.shape)} (the kernel does not broadcast the residual)")
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    numel = out.numel()
    if numel == 0:
        return out  # a zero-size grid is not launchable
    xc = x.to(h_dtype).contiguous()
    b = bias.to(h_dtype).contiguous() if bias is not None else None
    r = residual.contiguous() if residual is not None else None
    # Absent bias/residual pass xc as a never-dereferenced placeholder pointer (constexpr-guarded).
    launch(_gelu_residual_kernel, (triton.cdiv(numel, BLOCK),), xc,
           b if b is not None else xc, r if r is not None else xc, out, numel, n,
           TANH=approximate == "tanh", HAS_BIAS=b is not None, HAS_RESIDUAL=r is not None,
           BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


@torch.library.triton_op("fastflow::gelu_residual", mutates_args=())
def gelu_residual(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
                  approximate: str) -> Tensor:
    if on_triton_device(x):
        return gelu_residual_triton(x, bias, residual, approximate)
    return gelu_residual_ref(x, bias, residual, approximate)


def aot_specs() -> list[AotSpec]:
    """Every (dtype, approximation, bias?, residual?) the launcher can pick. n_elements is i32
    here; Triton re-specialises it to i64 past 2^31 elements, which only changes the mask compare
    (offsets are int64 either way)."""
    specs = []
    for dt in AOT_DTYPES:
        for tanh in (False, True):
            for has_b in (False, True):
                for has_r in (False, True):
                    sig = {"x_ptr": ptr(dt), "bias_ptr": ptr(dt), "res_ptr": ptr(dt),
                           "out_ptr": ptr(dt), "n_elements": "i32", "n_cols": "i32",
                           "TANH": "constexpr", "HAS_BIAS": "constexpr",
                           "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr"}
                    approx = "tanh" if tanh else "none"
                    specs.append(AotSpec(f"gelu_residual[{dt},{approx},bias={has_b},res={has_r}]",
                                         _gelu_residual_kernel, sig,
                                         {"TANH": tanh, "HAS_BIAS": has_b, "HAS_RESIDUAL": has_r,
                                          "BLOCK": BLOCK},
                                         num_warps=NUM_WARPS))
    return specs
