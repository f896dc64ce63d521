"""Pure-torch quantize/dequantize: the reference every kernel and every quantized module is held to.

All arithmetic is in fp32 (or float64 when given float64), whatever the storage dtype. Scales are
rounded to their storage dtype *before* the integer codes are computed, so dequantizing with the
stored scale reproduces exactly the grid the codes were chosen on (no hidden bf16 re-rounding).

Layouts (the contract with the Triton kernels):
- int8: qweight int8 (N, K); scale (N,) in the compute dtype; w = q * scale.
- int4: qweight uint8 (N, K//2), k=2j in the low nibble of byte j, k=2j+1 in the high nibble,
        q in 0..15; scale, zero (N, K//G) in the compute dtype; w = (q - zero) * scale.
- w8a8: qweight int8 (N, K); w_scale (N,) fp32; activations int8 with a per-token or per-tensor scale.
- fp8:  qweight float8_e4m3fn (N, K); w_scale (N,) fp32; activations e4m3 per token.
"""
from __future__ import annotations

import torch
from torch import Tensor

INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# A floor on scales: an all-zero row or group would otherwise divide by zero.
SCALE_EPS = 1e-12


def acc_dtype(t: Tensor) -> torch.dtype:
    """The accumulation dtype of every reference and CPU path: fp32, or float64 for a float64 reference run."""
    return torch.promote_types(t.dtype, torch.float32)


def _ieee_div(t: Tensor, divisor: float) -> Tensor:
    """t / divisor rounded as IEEE division on every device: CUDA divides by a Python scalar as
    t * (1 / divisor), one ulp off at times, and the GPU kernels' scales use true division."""
    return t / torch.tensor(divisor, dtype=t.dtype, device=t.device)


def stored_scale(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Round the scale to its storage dtype, then continue in fp32/fp64 with exactly that value."""
    return scale.clamp_min(SCALE_EPS).to(dtype).to(scale.dtype).clamp_min(SCALE_EPS)


# --- int8 per output channel (weight-only and W8A8 weights) ------------------------------------

# Rows are quantized in blocks of about this many elements: rows are independent, and a whole
# 49152 x 576 embedding at once would hold ~3 float copies of it (~340 MB) at the peak.
INT8_BLOCK_ELEMENTS = 1 << 20


def quantize_int8(w: Tensor, scale_dtype: torch.dtype | None = None,
                  block_elements: int = INT8_BLOCK_ELEMENTS) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: (q int8 (N, K), scale (N,) in `scale_dtype`, default w.dtype)."""
    out_dtype = scale_dtype or w.dtype
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=out_dtype, device=w.device)
    rows = max(1, block_elements // max(1, w.shape[1]))
    for start in range(0, w.shape[0], rows):
        wf = w[start:start + rows].to(acc_dtype(w))
        s = stored_scale(_ieee_div(wf.abs().amax(dim=1), INT8_MAX), out_dtype)
        q[start:start + rows] = torch.round(wf / s[:, None]).clamp_(-INT8_MAX, INT8_MAX)
        scale[start:start + rows] = s
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    acc = torch.promote_types(dtype, torch.float32)
    return (q.to(acc) * scale.to(acc)[:, None]).to(dtype)


# --- int4 group-wise ------------------------------------------------------------------------------

def quantize_int4(w: Tensor, group_size: int, symmetric: bool = False,
                  scale_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Group-wise 4-bit codes: (q uint8 (N, K) in 0..15, unpacked; scale, zero (N, K//G)).

    Symmetric: zero = 8 and scale = max(-min/8, max/7), so both ends of [-8, 7] are used.
    Asymmetric: the group's [min, max] (widened to include 0) maps onto [0, 15] with a
    fractional zero point, the same affine grid as torch's int4 kernels and GGUF Q4_1."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    dtype = scale_dtype or w.dtype
    g = w.to(acc_dtype(w)).reshape(n, k // group_size, group_size)
    scale, zero = int4_scale_zero(g.amin(-1), g.amax(-1), symmetric, dtype)
    q = int4_codes(g, scale[..., None], zero[..., None])
    return q.reshape(n, k), scale.to(dtype), zero.to(dtype)


def int4_scale_zero(lo: Tensor, hi: Tensor, symmetric: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The int4 grid of groups spanning [lo, hi]: (scale, zero) already rounded to `dtype` but
    returned in lo's (fp32/fp64) dtype. Shared by round-to-nearest and GPTQ, so both produce
    codes on exactly the grid that the stored scale and zero dequantize."""
    if symmetric:
        scale = stored_scale(torch.maximum(_ieee_div(-lo, 8.0), _ieee_div(hi, 7.0)), dtype)
        return scale, torch.full_like(scale, 8.0)
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    scale = stored_scale(_ieee_div(hi - lo, 15.0), dtype)
    return scale, (-lo / scale).to(dtype).to(scale.dtype)


def int4_codes(w: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """round(w / scale + zero) in 0..15 as uint8 (scale and zero broadcast against w)."""
    return torch.round(w / scale + zero).clamp_(0, 15).to(torch.uint8)


def pack_int4(q: Tensor) -> Tensor:
    """(N, K) codes 0..15 -> (N, K//2) uint8: even k in the low nibble, odd k in the high nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """(N, K//2) uint8 -> (N, K) uint8 codes."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(packed: Tensor, scale: Tensor, zero: Tensor, group_size: int,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    acc = torch.promote_types(dtype, torch.float32)
    q = unpack_int4(packed).to(acc)
    s = scale.to(acc).repeat_interleave(group_size, dim=1)
    z = zero.to(acc).repeat_interleave(group_size, dim=1)
    return ((q - z) * s).to(dtype)


# --- fp8 e4m3 per output channel ------------------------------------------------------------------

def quantize_fp8(w: Tensor) -> tuple[Tensor, Tensor]:
    """(q float8_e4m3fn (N, K), scale (N,) fp32 = row absmax / 448)."""
    wf = w.to(acc_dtype(w))
    scale = stored_scale(_ieee_div(wf.abs().amax(dim=1), FP8_MAX), torch.float32)
    q = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.float()


def dequantize_fp8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    acc = torch.promote_types(dtype, torch.float32)
    return (q.to(acc) * scale.to(acc)[:, None]).to(dtype)


# --- activations --------------------------------------------------------------------------------

# Activations are quantized in fp32 whatever their dtype, float64 included: the codes are data, not an
# approximation a wider type would refine, so every device path and the reference pick the same codes.
# Ties round half to even (torch.round, the fp8 cast); an all-zero row gets scale 0 and zero codes.

def quantize_act_int8(x2d: Tensor, x_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """int8 activations: per token (row absmax / 127) when `x_scale` is None, else that static
    per-tensor scale. Returns (q int8 (M, K), scale (M, 1) or (1, 1) fp32)."""
    xf = x2d.float()
    if x_scale is None:
        scale = _ieee_div(xf.abs().amax(dim=1, keepdim=True), INT8_MAX)
    else:
        scale = x_scale.float().reshape(1, 1)
    q = torch.round(xf / torch.where(scale > 0, scale, 1.0)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_act_fp8(x2d: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token e4m3 activations: (q (M, K), scale (M, 1) fp32 = row absmax / 448)."""
    xf = x2d.float()
    scale = _ieee_div(xf.abs().amax(dim=1, keepdim=True), FP8_MAX)
    q = (xf / torch.where(scale > 0, scale, 1.0)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def sqnr(ref: Tensor, approx: Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when identical)."""
    ref, approx = ref.double(), approx.double()
    noise = (ref - approx).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0.0:
        return float("inf")
    return 10.0 * torch.log10(torch.tensor(signal / noise)).item()
