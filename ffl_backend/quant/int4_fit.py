"""int4 grids fitted to the weights: per group, the scale and zero point of least weighted squared error.

Round-to-nearest on a group's full [min, max] spends its 16 levels on the two extreme weights. Here,
for each group, candidate grids are tried -- the [min, max] grid itself, then ranges of 14 to 16 steps
across the group (codes L = round((w - min) * steps / (max - min))) -- and for each candidate's codes
the (scale, offset) minimising sum importance * (scale * L + offset - w)^2 is solved in closed form
(llama.cpp's Q4_K quantizer searches the same way). The scale and zero point are rounded to their
storage dtype, the codes recomputed on that stored grid (numerics.int4_codes), and the candidate of
least weighted error on the stored grid kept, so the result is never worse than [min, max] by that measure.

The importance of a weight: with calibration data, the mean square of its input channel over the
calibration tokens (the diagonal of X^T X / T: a layer's output error is sum_k E[x_k^2] dW_k^2 when
inputs are uncorrelated; llama.cpp's "importance matrix"); without, the weight's own square plus the
group's mean square (large weights matter more, no weight counts for nothing).
Measured on Gemma-3-270M, all 126 linears in groups of 32: fitted grids lose far less perplexity than
[min, max], and fitted with calibration data less than without (the perplexities and their results
files: docs/quantization.md).

Same layout as round-to-nearest (codes, scale, zero per group): kernels and save/load are unchanged.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import numerics as P

STEPS = [15.0 + 0.1 * i for i in range(-10, 11)]  # levels spanned by a group's range, per candidate
# Rows are fitted in blocks of about this many weights: a 262k-row head at once would take GBs, and fp32
# temporaries of ~1 MB stay in cache, faster than 16 MB blocks (docs/performance.md#quantization-memory-and-fitting).
BLOCK_ELEMENTS = 1 << 18


def quantize_int4_fitted(w: Tensor, group_size: int, symmetric: bool = False, scale_dtype: torch.dtype | None = None,
                         importance: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Like numerics.quantize_int4 -- (codes uint8 (N, K), scale, zero (N, K // G)) -- on fitted grids.
    importance: (K,) non-negative weight of each input channel's error, or None (module docstring)."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    dtype = scale_dtype or w.dtype
    acc = P.acc_dtype(w)
    if importance is not None:
        importance = importance.to(acc).reshape(1, k // group_size, group_size)
        importance = importance + 1e-6 * importance.mean().clamp_min(P.SCALE_EPS)  # dead channels still count
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
