"""GPTQ (Frantar et al. 2022): weight rounding that compensates each rounding error on the columns
not yet rounded, weighted by the layer's input statistics.

For a linear y = x W^T with calibration inputs X (T, K), the layer's output error for a weight error
dW is ||X dW^T||^2 = sum over rows of dW H dW^T with H = X^T X. GPTQ rounds input column k of W,
then solves for the update of the remaining columns that minimises that error given column k's
rounding error: W[:, k:] -= err_k * Hinv[k, k:] / Hinv[k, k], with Hinv the inverse of H restricted to
the columns not yet rounded. The rows of the upper Cholesky factor of H^-1 give exactly those
restricted inverses, so one factorisation serves every column. Updates are applied lazily per block
of columns (one matmul per block instead of one rank-1 update of the whole matrix per column).

The grid is exactly round-to-nearest's (numerics.int4_scale_zero / quantize_int8): a group's scale
and zero point are chosen when quantization reaches its first column, from the weights as updated
by the errors of the columns before it. So the result is the same layout (codes, scale, zero per
group) that Int4Linear / Int8Linear store, and kernels and save/load are unchanged.

Layers are quantized sequentially by default: one forward pass of the calibration batch, in which
each target layer's hook collects H from its real input, quantizes the layer, and returns the
quantized layer's output, so later layers see the inputs they will see at inference (errors of
earlier layers included). Act-order (rounding columns by decreasing H diagonal) is not done: with
group-wise scales it would either scatter a group's columns or need a permuted storage layout.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .. import numerics as P
from ..kernels import cpu_quantize
from .calibration import as_batches

logger = logging.getLogger("ffl_backend")

DAMP = 0.01  # fraction of mean(diag H) added to the diagonal: keeps H invertible and the updates tame
BLOCK = 128  # columns per lazy update; a multiple of every int4 group size, so groups never straddle blocks
MAX_DAMP_RETRIES = 4  # each multiplies the damping by 10 when H + damping is still not positive definite


@dataclasses.dataclass(frozen=True)
class Grid:
    """A quantization grid per group of `group_size` input columns: `params` maps the group's current
    weights (N, G) fp32 to (scale, zero) (N,), already rounded to their storage dtype; codes are
    round(w / scale + zero) clamped to [qmin, qmax] and dequantize to (code - zero) * scale."""

    group_size: int
    qmin: int
    qmax: int
    params: Callable[[Tensor], tuple[Tensor, Tensor]]
    code_dtype: torch.dtype


def int4_grid(group_size: int, symmetric: bool, scale_dtype: torch.dtype) -> Grid:
    """The full [min, max] range of each group, as round-to-nearest. (A per-group search for a
    narrower, least-squares range was tried on SmolLM2 g128 and did not help once GPTQ compensates.)"""
    def params(wg: Tensor):
        return P.int4_scale_zero(wg.amin(1), wg.amax(1), symmetric, scale_dtype)
    return Grid(group_size, 0, 15, params, torch.uint8)


def int8_grid(w: Tensor) -> Grid:
    """Per-row symmetric int8, its scales fixed up front from the original weights (as RTN's): the
    row is one group, so there is no later point at which to choose them. Every "group" below (a
    size that tiles BLOCK, so updates stay lazy) returns that same scale."""
    scale = cpu_quantize.quantize_int8(w)[1].float()
    zero = torch.zeros_like(scale)
    return Grid(math.gcd(w.shape[1], BLOCK), -int(P.INT8_MAX), int(P.INT8_MAX), lambda _wg: (scale, zero), torch.int8)


def hessian(x: Tensor, valid: Tensor | None = None) -> Tensor:
    """H = X^T X / T (fp32) over the token rows of a layer input `x` (..., K); rows where `valid` is
    False (padding) are left out when `valid` has one entry per row."""
    rows = x.reshape(-1, x.shape[-1])
    if valid is not None and valid.numel() == rows.shape[0]:
        rows = rows[valid.reshape(-1).to(rows.device)]
    rows = rows.float()
    return rows.T @ rows / max(rows.shape[0], 1)


def _inverse_cholesky(h: Tensor, damp: float) -> Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, in fp32 (factorised in fp64)."""
    h = h.double().clone()
    diag = h.diagonal()
    diag[diag == 0] = 1.0  # an input channel that was always zero: its column is simply rounded
    for attempt in range(MAX_DAMP_RETRIES + 1):
        damped = h + damp * diag.mean() * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
        chol, info = torch.linalg.cholesky_ex(damped)
        if info == 0:
            inv = torch.cholesky_inverse(chol)
            return torch.linalg.cholesky(inv, upper=True).float()
        logger.warning("gptq: Hessian not positive definite with damping %g; retrying with %g", damp, damp * 10)
        damp *= 10
    raise RuntimeError(f"gptq: Hessian not positive definite even with damping {damp / 10:g}")


@torch.no_grad()
def gptq(w: Tensor, h: Tensor, grid: Grid, damp: float = DAMP) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Quantize weight `w` (N, K) given its input Hessian `h` (K, K): (codes (N, K) in grid.code_dtype,
    scale, zero (N, K // G) fp32 holding storage-dtype values, dequantized weight (N, K) fp32)."""
    n, k = w.shape
    g = grid.group_size
    if k % g:
        raise ValueError(f"group_size {g} does not divide in_features {k}")
    block = g * max(1, BLOCK // g)  # whole groups per block, so a group's columns share one working copy
    u = _inverse_cholesky(h, damp)
    work = w.detach().float().clone()
    codes = torch.empty(n, k, dtype=torch.int16, device=w.device)
    w_hat = torch.empty(n, k, dtype=torch.float32, device=w.device)
    scales, zeros = [], []
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        blk = work[:, b0:b1].clone()  # this block's columns, receiving the in-block updates
        err = torch.empty_like(blk)
        for i in range(b1 - b0):
            col = b0 + i
            if col % g == 0:  # a new group: its grid from the weights as updated so far
                scale, zero = grid.params(blk[:, i:i + g])
                scales.append(scale)
                zeros.append(zero)
            q = torch.round(blk[:, i] / scale + zero).clamp_(grid.qmin, grid.qmax)
            codes[:, col] = q.to(torch.int16)
            w_hat[:, col] = (q - zero) * scale
            # The error, scaled by the column's inverse-Hessian pivot, pushed onto the later columns.
            err[:, i] = (blk[:, i] - w_hat[:, col]) / u[col, col]
            blk[:, i:] -= err[:, i:i + 1] * u[col:col + 1, col:b1]
        work[:, b1:] -= err @ u[b0:b1, b1:]  # the whole block's updates on the columns after it
    return codes.to(grid.code_dtype), torch.stack(scales, 1), torch.stack(zeros, 1), w_hat


class _Done(Exception):
    """Raised by the last target's hook: nothing after it (e.g. the logits) needs computing."""


def _one_batch(calibration_data) -> tuple[Tensor, Tensor]:
    """All calibration sequences as one (B, L) batch, right-padded by repeating each one's last token,
    with the (B, L) mask of real tokens. In a causal LM real tokens never attend to later padding."""
    seqs = [row for ids in as_batches(calibration_data) for row in ids]
    length = max(s.numel() for s in seqs)
    ids = torch.stack([torch.cat([s, s[-1:].expand(length - s.numel())]) for s in seqs])
    valid = torch.arange(length)[None] < torch.tensor([s.numel() for s in seqs])[:, None]
    return ids, valid


@torch.no_grad()
def quantize_layers(model: nn.Module, targets: dict[str, nn.Linear], quantize_weight: Callable, calibration_data,
                    *, damp: float = DAMP, sequential: bool = True) -> dict[str, dict]:
    """{name: {"quantized": ...}}, the from_linear kwargs of every target, from one forward pass of the
    calibration data (one batch). quantize_weight(linear, h, damp): GPTQ of one layer on its scheme's
    grid, giving (the `quantized` tuple, dequantized weight (N, K) fp32) (handlers.gptq_weight).
    sequential: each layer's output during that pass comes from its quantized weight (inputs of later
    layers carry earlier layers' errors, as at inference); False: every Hessian comes from the
    high-precision model. The model's weights are not modified."""
    ids, valid = _one_batch(calibration_data)
    done: dict[str, dict] = {}
    start = time.perf_counter()

    def hook(name):
        def fn(module, args, output):
            if name in done:  # a module called twice per forward: quantized on its first call
                return None
            x = args[0]
            quantized, w_hat = quantize_weight(module, hessian(x, valid), damp)
            done[name] = {"quantized": quantized}
            if len(done) == len(targets):
                raise _Done
            if sequential:
                return nn.functional.linear(x, w_hat.to(module.weight.dtype), module.bias)
            return None
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in targets.items()]
    try:
        model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
    except _Done:
        pass
    finally:
        for handle in handles:
            handle.remove()
    missing = [n for n in targets if n not in done]
    if missing:
        raise RuntimeError(f"gptq calibration never reached {missing[:3]}{'...' if len(missing) > 3 else ''}")
    logger.info("gptq: %d layers on %d calibration tokens in %.1f s", len(done), int(valid.sum()),
                time.perf_counter() - start)
    return done
