"""Weight quantizers: `torch.ops.fastflow_cpu.quantize_int8` / `quantize_int4` and their references.

int8 per row and int4 on [min, max] grids have their references in numerics.py; the fitted int4 grid
search (the method and why: quant/int4_fit.py) has its reference here, `quantize_int4_fitted_ref`.
The C++ ops (cpu_quantize.cpp says how) do the same fp32 arithmetic in one pass over the weight,
bit-equal to the references, instead of dozens of elementwise torch passes per candidate grid.
`quantize_int8`, `quantize_int4` and `quantize_int4_fitted` below take the op where it applies (an
fp32/bf16/fp16 weight on CPU, the library built) and the reference everywhere else (CUDA, float64).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import numerics as P
from . import cpu_lib

STEPS = [15.0 + 0.1 * i for i in range(-10, 11)]  # levels spanned by a group's range, per candidate
# The reference fits rows in blocks of about this many weights: a 262k-row head at once would take GBs,
# and fp32 temporaries of ~1 MB stay in cache, faster than 16 MB blocks
# (docs/performance.md#quantization-memory-and-fitting).
BLOCK_ELEMENTS = 1 << 18
_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def applies(w: Tensor) -> bool:
    """Whether the C++ op quantizes `w`: an fp32/bf16/fp16 (N, K) weight on CPU, the library built."""
    return w.device.type == "cpu" and w.dim() == 2 and w.dtype in _OP_DTYPES and cpu_lib.load()


def quantize_int8(w: Tensor, scale_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """numerics.quantize_int8: (q int8 (N, K), scale (N,) in `scale_dtype`, default w.dtype)."""
    if applies(w):
        return torch.ops.fastflow_cpu.quantize_int8(w.detach(), scale_dtype or w.dtype)
    return P.quantize_int8(w, scale_dtype)


def quantize_int4(w: Tensor, group_size: int, symmetric: bool = False, scale_dtype: torch.dtype | None = None,
                  packed: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """numerics.quantize_int4 ([min, max] grids): (codes uint8 (N, K), scale, zero (N, K // G)); with
    `packed` the codes as numerics.pack_int4 packs them, (N, K // 2)."""
    if applies(w):
        _check_groups(w, group_size)
        return torch.ops.fastflow_cpu.quantize_int4(w.detach(), group_size, symmetric, scale_dtype or w.dtype, [], None,
                                                    packed)
    return _packed(P.quantize_int4(w, group_size, symmetric, scale_dtype), packed)


def quantize_int4_fitted(w: Tensor, group_size: int, symmetric: bool = False, scale_dtype: torch.dtype | None = None,
                         importance: Tensor | None = None, packed: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Like quantize_int4, on fitted grids (quantize_int4_fitted_ref). The op sums each group in the
    order the reference's `.sum(-1)` takes on a contiguous weight, whatever `w`'s strides."""
    if applies(w):
        _check_groups(w, group_size)
        weights = None if importance is None else channel_weights(importance.to(w.device), torch.float32)
        return torch.ops.fastflow_cpu.quantize_int4(w.detach(), group_size, symmetric, scale_dtype or w.dtype, STEPS,
                                                    weights, packed)
    return _packed(quantize_int4_fitted_ref(w, group_size, symmetric, scale_dtype, importance), packed)


def _packed(quantized: tuple[Tensor, Tensor, Tensor], packed: bool) -> tuple[Tensor, Tensor, Tensor]:
    codes, scale, zero = quantized
    return (P.pack_int4(codes) if packed else codes), scale, zero


def _check_groups(w: Tensor, group_size: int) -> None:
    if w.shape[1] % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {w.shape[1]}")


def channel_weights(importance: Tensor, acc: torch.dtype) -> Tensor:
    """(K,) weights of each input channel's error from an importance vector: dead channels still count."""
    importance = importance.to(acc)
    return importance + 1e-6 * importance.mean().clamp_min(P.SCALE_EPS)


@cpu_lib.fake("quantize_int8")
def _fake_quantize_int8(w: Tensor, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return w.new_empty(w.shape, dtype=torch.int8), w.new_empty(w.shape[0], dtype=scale_dtype)


@cpu_lib.fake("quantize_int4")
def _fake_quantize_int4(w: Tensor, group_size: int, symmetric: bool, scale_dtype: torch.dtype, steps: list,
                        importance: Tensor | None, packed: bool) -> tuple[Tensor, Tensor, Tensor]:
    groups = (w.shape[0], w.shape[1] // group_size)
    codes = (w.shape[0], w.shape[1] // 2 if packed else w.shape[1])
    return (w.new_empty(codes, dtype=torch.uint8), w.new_empty(groups, dtype=scale_dtype),
            w.new_empty(groups, dtype=scale_dtype))


# --- the reference of the fitted grid search -----------------------------------------------------------

def quantize_int4_fitted_ref(w: Tensor, group_size: int, symmetric: bool = False,
                             scale_dtype: torch.dtype | None = None,
                             importance: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Like numerics.quantize_int4 -- (codes uint8 (N, K), scale, zero (N, K // G)) -- on fitted grids.
    importance: (K,) non-negative weight of each input channel's error, or None (quant/int4_fit.py)."""
    n, k = w.shape
    _check_groups(w, group_size)
    dtype = scale_dtype or w.dtype
    acc = P.acc_dtype(w)
    if importance is not None:
        importance = channel_weights(importance, acc).reshape(1, k // group_size, group_size)
    q = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    scale = torch.empty(n, k // group_size, dtype=dtype, device=w.device)
    zero = torch.empty_like(scale)
    rows = max(1, BLOCK_ELEMENTS // k)
    for start in range(0, n, rows):
        g = w[start:start + rows].to(acc).reshape(-1, k // group_size, group_size)
        s, z = fit_groups(g, symmetric, dtype, importance)
        q[start:start + rows] = P.int4_codes(g, s[..., None], z[..., None]).reshape(-1, k)
        scale[start:start + rows], zero[start:start + rows] = s.to(dtype), z.to(dtype)
    return q, scale, zero


def fit_groups(g: Tensor, symmetric: bool, dtype: torch.dtype, importance: Tensor | None) -> tuple[Tensor, Tensor]:
    """(scale, zero) of shape g.shape[:-1] for groups g (..., G), rounded to `dtype`, in g's dtype."""
    weight = importance.expand_as(g) if importance is not None else g.square() + g.square().mean(-1, keepdim=True)
    lo, hi = g.amin(-1), g.amax(-1)
    best_scale, best_zero = P.int4_scale_zero(lo, hi, symmetric, dtype)
    best_err = _weighted_error(g, weight, best_scale, best_zero)
    if not symmetric:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    span = (hi - lo) if not symmetric else torch.maximum(-lo / 8.0, hi / 7.0) * 15.0
    origin = lo if not symmetric else -8.0 * span / 15.0
    shifted = g - origin[..., None]
    sums = (weight.sum(-1), (weight * g).sum(-1))  # the same for every candidate
    for steps in STEPS:
        codes = torch.round(shifted * (steps / span.clamp_min(P.SCALE_EPS))[..., None]).clamp_(0, 15)
        scale, offset = _least_squares(g, weight, codes, symmetric, sums)
        ok = torch.isfinite(scale) & (scale > 0) & torch.isfinite(offset)
        scale = P.stored_scale(torch.where(ok, scale, best_scale), dtype)
        zero = best_zero if symmetric else torch.where(ok, -offset / scale, best_zero).to(dtype).to(g.dtype)
        err = _weighted_error(g, weight, scale, zero)
        better = err < best_err
        best_scale, best_zero = torch.where(better, scale, best_scale), torch.where(better, zero, best_zero)
        best_err = torch.where(better, err, best_err)
    return best_scale, best_zero


def _least_squares(g: Tensor, weight: Tensor, codes: Tensor, symmetric: bool,
                   sums: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The (scale, offset) minimising sum weight * (codes * scale + offset - g)^2 for fixed codes;
    symmetric grids keep offset = -8 * scale (zero point 8) and solve for the scale alone.
    sums: (sum weight, sum weight * g) over each group."""
    if symmetric:
        c = codes - 8.0
        scale = (weight * c * g).sum(-1) / (weight * c * c).sum(-1)
        return scale, -8.0 * scale
    weighted = weight * codes
    (sw, sx), sc = sums, weighted.sum(-1)
    scc, scx = (weighted * codes).sum(-1), (weighted * g).sum(-1)
    det = sw * scc - sc * sc
    return (sw * scx - sx * sc) / det, (scc * sx - sc * scx) / det


def _weighted_error(g: Tensor, weight: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """sum weight * (dequantized - g)^2 per group, codes as numerics.int4_codes makes them (kept in float)."""
    scale, zero = scale[..., None], zero[..., None]
    err = torch.round(g / scale + zero).clamp_(0, 15).sub_(zero).mul_(scale).sub_(g)
    return err.square_().mul_(weight).sum(-1)
