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

The arithmetic lives one layer down, in kernels/cpu_quantize.py: its pure-torch reference
(`quantize_int4_fitted_ref`, `fit_groups`) and the C++ op that does the same search in one pass over
a CPU weight, bit-equal to the reference (seconds per billion weights where the reference takes ~85 s).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import cpu_quantize


def quantize_int4_fitted(w: Tensor, group_size: int, symmetric: bool = False, scale_dtype: torch.dtype | None = None,
                         importance: Tensor | None = None, packed: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Like numerics.quantize_int4 -- (codes uint8 (N, K), scale, zero (N, K // G)) -- on fitted grids.
    importance: (K,) non-negative weight of each input channel's error (the mean square of its inputs
    on calibration data), or None: each weight's own square plus its group's mean square.
    packed: the codes as numerics.pack_int4 packs them, (N, K // 2)."""
    return cpu_quantize.quantize_int4_fitted(w, group_size, symmetric, scale_dtype, importance, packed)
