"""Calibration: per-layer input ranges on user data, and SmoothQuant-style smoothing.

SmoothQuant (Xiao et al. 2023) moves activation outliers into the weights: for input channel j,
s_j = max|X_j|^alpha / max|W_:j|^(1 - alpha), X' = X / s, W' = W * s, so X' W'^T = X W^T. The 1/s
is folded into the norm that produces X when that norm is linear in its weight (Llama's RMSNorm,
LayerNorm: checked numerically, so Gemma's `1 + w` is refused); otherwise each module multiplies its
input by 1/s itself (`W8A8Linear.smooth`), inside its one op call.

Which linears share an input, and which norm produced it, is observed rather than assumed from
module names: on the first calibration batch every norm output and linear input is held alive, so
equal data pointers mean the same tensor.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import Tensor, nn

SMOOTH_MIN = 1e-5  # keeps s finite for dead channels


@dataclasses.dataclass
class InputGroup:
    """Linears reading one tensor, and the norm that produced it (None when not foldable)."""

    names: list
    norm: nn.Module | None = None


def as_batches(calibration_data) -> list[Tensor]:
    """The calibration input_ids as a list of (B, L) int64 tensors; one tensor is one batch."""
    if isinstance(calibration_data, Tensor):
        calibration_data = [calibration_data]
    if not isinstance(calibration_data, Iterable):
        raise TypeError("calibration_data must be an iterable of input_ids tensors, (1, L) or (B, L)")
    batches = []
    for ids in calibration_data:
        ids = torch.as_tensor(ids)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError("calibration input_ids must be integer (B, L) tensors, "
                             f"got {tuple(ids.shape)} {ids.dtype}")
        batches.append(ids.long())
    if not batches:
        raise ValueError("calibration_data is empty")
    return batches


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, nn.LayerNorm) or "RMSNorm" in name or "LayerNorm" in name


@torch.no_grad()
def _linear_in_weight(norm: nn.Module, width: int) -> bool:
    """True when scaling the norm's weight (and bias) by d scales its output by d."""
    w = getattr(norm, "weight", None)
    b = getattr(norm, "bias", None)
    if not isinstance(w, Tensor) or w.shape != (width,) or (b is not None and b.shape != (width,)):
        return False
    x = torch.randn(3, width, dtype=w.dtype, device=w.device)
    d = torch.rand(width, dtype=w.dtype, device=w.device) + 0.5
    base = norm(x).float()
    saved = (w.clone(), b.clone() if b is not None else None)
    w.mul_(d)
    if b is not None:
        b.mul_(d)
    scaled = norm(x).float()
    w.copy_(saved[0])
    if b is not None:
        b.copy_(saved[1])
    return torch.allclose(scaled, base * d.float(), rtol=2e-2, atol=1e-3)


@torch.no_grad()
def collect(model: nn.Module, names: list[str], calibration_data) -> tuple[dict, dict, list[InputGroup]]:
    """Run the calibration data through `model`: per linear, the per-channel input absmax (K,) and
    the per-token input absmax (tokens,), fp32; and the groups of linears sharing an input, with
    their foldable norm."""
    modules = dict(model.named_modules())
    absmax: dict[str, Tensor] = {}
    token_absmax: dict[str, list] = {n: [] for n in names}
    first_batch = {"norm_out": [], "inputs": {}, "other_inputs": []}

    def linear_hook(name):
        def hook(_module, args):
            x = args[0].detach()
            rows = x.reshape(-1, x.shape[-1]).abs()
            amax = rows.amax(dim=0).float()
            token_absmax[name].append(rows.amax(dim=1).float())
            absmax[name] = amax if name not in absmax else torch.maximum(absmax[name], amax)
            if first_batch is not None:
                first_batch["inputs"].setdefault(name, x)
        return hook

    def other_hook(_module, args):  # a linear not being quantized: its input must not be smoothed
        if first_batch is not None and args and isinstance(args[0], Tensor):
            first_batch["other_inputs"].append(args[0])

    def norm_hook(module, _args, out):
        if first_batch is not None and isinstance(out, Tensor):
            first_batch["norm_out"].append((module, out))

    handles = [modules[n].register_forward_pre_hook(linear_hook(n)) for n in names]
    handles += [m.register_forward_hook(norm_hook) for m in modules.values() if _is_norm(m)]
    handles += [m.register_forward_pre_hook(other_hook) for n, m in modules.items()
                if n not in names and (isinstance(m, nn.Linear) or hasattr(m, "in_features"))]
    groups = []
    try:
        for i, ids in enumerate(as_batches(calibration_data)):
            model(input_ids=ids.to(_device(model)), use_cache=False)
            if i == 0:
                groups = _groups(first_batch)
                first_batch = None  # release the held tensors; later batches only update ranges
    finally:
        for h in handles:
            h.remove()
    return absmax, {n: torch.cat(v) for n, v in token_absmax.items() if v}, groups


@torch.no_grad()
def input_mean_squares(model: nn.Module, names: list[str], calibration_data) -> dict[str, Tensor]:
    """{name: (K,) fp32 mean over calibration tokens of each input channel's square} for the named
    linears: the diagonal of X^T X / T, what an input channel's weight errors cost at the output."""
    modules = dict(model.named_modules())
    sums: dict[str, Tensor] = {}
    counts = dict.fromkeys(names, 0)

    def hook(name):
        def fn(_module, args):
            rows = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] = rows.square().sum(0) + sums.get(name, 0.0)
            counts[name] += rows.shape[0]
        return fn

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in names]
    try:
        for ids in as_batches(calibration_data):
            model(input_ids=ids.to(_device(model)), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {n: (sums[n] / counts[n]).float() for n in names if n in sums}


def token_range_ratio(token_absmax: Tensor, quantile: float = 0.99) -> float:
    """Largest token's range over the `quantile` token's: how much one static per-tensor scale
    (set by the largest) coarsens the grid for typical tokens. Attention-sink tokens make this large
    in some layers, where a static scale leaves typical tokens a handful of levels."""
    typical = torch.quantile(token_absmax, quantile).clamp_min(1e-12)
    return (token_absmax.max() / typical).item()


def _groups(first_batch) -> list[InputGroup]:
    by_ptr: dict[tuple, InputGroup] = {}
    for name, x in first_batch["inputs"].items():
        key = (x.data_ptr(), tuple(x.shape))
        by_ptr.setdefault(key, InputGroup([])).names.append(name)
    # A norm output also read by a linear outside the targets (say q/k kept in high precision while
    # v is quantized) cannot take 1/s: that reader would see X / s with its weight unscaled.
    shared = {(x.data_ptr(), tuple(x.shape)) for x in first_batch["other_inputs"]}
    for module, out in first_batch["norm_out"]:
        key = (out.data_ptr(), tuple(out.shape))
        group = by_ptr.get(key)
        if group is not None and key not in shared and _linear_in_weight(module, out.shape[-1]):
            group.norm = module
    return list(by_ptr.values())


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def smoothing_factors(act_absmax: Tensor, weights: list[Tensor], alpha: float) -> Tensor:
    """s (K,) fp32 for one input group: max|X_j|^alpha / max_i max|W_ij|^(1 - alpha) over its weights."""
    act = act_absmax.clamp_min(SMOOTH_MIN)
    w_max = torch.stack([w.detach().abs().amax(dim=0).float() for w in weights]).amax(dim=0)
    return (act.pow(alpha) / w_max.clamp_min(SMOOTH_MIN).pow(1 - alpha)).clamp_min(SMOOTH_MIN)


@torch.no_grad()
def smooth(modules: dict[str, nn.Linear], groups: list[InputGroup], absmax: dict[str, Tensor],
           alpha, keep=()) -> dict[str, Tensor]:
    """Apply SmoothQuant in place: weights *= s, norms /= s where foldable. Updates `absmax` to the
    smoothed inputs' ranges. Returns {name: 1/s} for the linears that must scale their own input.

    alpha: one float for every group, or {first name of a group: alpha or None (not smoothed)}.
    keep: linears staying in high precision. In a folded group they take W * s like the rest (their
    input is divided by s too); in an unfolded group their input is not scaled, so neither are they."""
    own_smooth = {}
    for group in groups:
        a = alpha.get(group.names[0]) if isinstance(alpha, dict) else alpha
        if a is None:
            continue
        scaled = group.names if group.norm is not None else [n for n in group.names if n not in keep]
        if not scaled:
            continue
        s = smoothing_factors(absmax[group.names[0]], [modules[n].weight for n in group.names], a)
        for name in scaled:
            w = modules[name].weight
            w.mul_(s.to(w.dtype))
            absmax[name] = absmax[name] / s
        if group.norm is not None:
            group.norm.weight.div_(s.to(group.norm.weight.dtype))
            if getattr(group.norm, "bias", None) is not None:
                group.norm.bias.div_(s.to(group.norm.bias.dtype))
        else:
            own_smooth.update({name: 1.0 / s for name in scaled})
    return own_smooth
