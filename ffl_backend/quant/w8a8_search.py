"""W8A8 calibration driven by measured output error rather than by ranges alone.

Three choices, each made on the layers' real inputs captured from the calibration data, by running
the candidate quantized layer (the `w8a8_linear` op the model will run) against the exact X W^T:

- SmoothQuant alpha per input group (`smoothquant_alpha="auto"`): the alpha on ALPHA_GRID with the
  least summed error over the group's linears. One global alpha is a compromise: on SmolLM2 the
  q/k/v and gate/up groups pick 0.75-0.9, o_proj 0.6-0.85, down_proj 0.5-0.85.
- Static activation scale (`clip_search=True`): ratio * absmax, the ratio on CLIP_GRID with the
  least error. Below 1 it clips the rare largest tokens to give the rest more of the 255 levels;
  above 1 it leaves headroom for inputs larger than any seen in calibration.
- Mixed precision (`min_output_sqnr`): a layer whose SQNR, quantized as finally chosen, is below the
  threshold stays in high precision: the per-layer report's "skip list that meets a target", made
  automatic.

How error is measured decides what works (docs/quantization.md has the perplexities):
- Held out: statistics (s, the static scale) are fitted on one half of the rows and the error is
  measured on the other half, both ways. Judged in-sample, the search made perplexity worse than a
  fixed alpha: new text exceeds the smoothed calibration absmax of down_proj several times, and
  in-sample choices (high alpha, strong clipping) fit only the calibration text.
- Token-balanced: each token's squared error is weighted by 1 / (||y_t||^2 + mean ||y||^2).
  Plain MSE is ruled by attention-sink tokens, orders of magnitude above the others in some
  down_proj inputs: it rated well a static scale that keeps the sink exact and leaves every other
  token at almost no levels.

Nothing is mutated here: `search` returns a Plan that the w8a8 handler applies (handlers.py, calibration.smooth).
Smoothing is output-preserving, so inputs captured from the unsmoothed model are divided by each
candidate s here. At most MAX_ROWS token rows are captured per input group, in passes holding at
most CAPTURE_BYTES of inputs, so a large model does not hold every layer's inputs at once.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch import Tensor, nn

from .. import numerics as P
from ..kernels import cpu_quantize
from .calibration import InputGroup, as_batches, smoothing_factors

logger = logging.getLogger("ffl_backend")

ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
CLIP_GRID = (1.5, 1.25, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)
MAX_ROWS = 2048  # token rows captured per input group
CAPTURE_BYTES = 512 * 2**20  # captured inputs held at once, all groups of one pass together


@dataclasses.dataclass
class Plan:
    """What the search chose. alphas: {first name of a group: alpha or None}; clips: {name: ratio of
    the static scale to the calibration absmax} (static layers only); sqnr: {name: held-out,
    token-balanced output SQNR in dB of the chosen form}; kept: {name: why it stays in high precision}."""

    alphas: dict = dataclasses.field(default_factory=dict)
    clips: dict = dataclasses.field(default_factory=dict)
    sqnr: dict = dataclasses.field(default_factory=dict)
    kept: dict = dataclasses.field(default_factory=dict)


@torch.no_grad()
def search(model: nn.Module, targets: dict[str, nn.Linear], groups: list[InputGroup], dynamic: set, cfg,
           calibration_data) -> Plan:
    """The Plan for `targets` (grouped by shared input as calibration.collect found them).
    dynamic: layers that keep per-token activation scales whatever is found here."""
    plan = Plan()
    alphas = ALPHA_GRID if cfg.smoothquant_alpha == "auto" else (cfg.smoothquant_alpha,)
    clips = CLIP_GRID if cfg.clip_search else (1.0,)
    for group, x in captured_inputs(model, groups, calibration_data):
        linears = {n: targets[n] for n in group.names}
        static = {n for n in group.names if cfg.static and n not in dynamic}
        alpha, per_layer = search_group(x, linears, group.norm is not None, static, alphas, clips)
        plan.alphas[group.names[0]] = alpha
        for name, (clip, err) in per_layer.items():
            plan.sqnr[name] = _db(err)
            if clip is not None:
                plan.clips[name] = clip
    if cfg.min_output_sqnr is not None:
        _keep_below(plan, cfg.min_output_sqnr, groups)
    _log(plan, cfg)
    return plan


def search_group(x: Tensor, linears: dict[str, nn.Linear], folded: bool, static: set, alphas,
                 clips) -> tuple[float | None, dict]:
    """(alpha, {name: (clip ratio or None if dynamic, relative output error)}) for linears sharing
    the input rows `x` (T, K). The group's alpha is the one with the least summed relative error
    (noise / signal power, so q, k and v count alike whatever their output scale) at ratio 1; then
    each static layer's ratio is searched at that alpha (a joint search costs len(CLIP_GRID) times more)."""
    folds = _folds(x, linears)
    by_alpha = {a: _errors(folds, linears, folded, static, a, 1.0) for a in alphas}
    alpha = min(alphas, key=lambda a: sum(by_alpha[a].values()))
    chosen = {n: (1.0 if n in static else None, err) for n, err in by_alpha[alpha].items()}
    for clip in clips:
        if clip == 1.0 or not static:
            continue
        for name, err in _errors(folds, linears, folded, static, alpha, clip).items():
            if name in static and err < chosen[name][1]:
                chosen[name] = (clip, err)
    return alpha, chosen


@dataclasses.dataclass
class _Fold:
    """Held-out rows `x` with their exact outputs, and the per-channel absmax of the other rows: the
    statistics s and the static scale are fitted on. Fitting and judging on the same rows rewards
    scales that only fit the calibration text: on SmolLM2's down_proj, new text exceeds the smoothed
    calibration absmax several times, and a clip ratio chosen in-sample loses out of sample."""

    fit_absmax: Tensor
    x: Tensor
    refs: dict
    token_weights: dict


def _folds(x: Tensor, linears: dict[str, nn.Linear]) -> list[_Fold]:
    """Two folds: each half of the rows (consecutive calibration windows) judged on the other's fit."""
    halves = (x[: len(x) // 2], x[len(x) // 2:]) if len(x) >= 2 else (x, x)
    folds = []
    for fit, held in (halves, halves[::-1]):
        xf = held.float()
        refs = {n: xf @ m.weight.float().T for n, m in linears.items()}
        weights = {n: _token_weights(y) for n, y in refs.items()}
        folds.append(_Fold(fit.float().abs().amax(dim=0), held, refs, weights))
    return folds


def _errors(folds: list[_Fold], linears: dict[str, nn.Linear], folded: bool, static: set,
            alpha: float | None, clip: float) -> dict[str, float]:
    """{name: held-out relative output error} with smoothing `alpha` and static scales at
    `clip` * the fitted absmax (dynamic layers: per-token scales), summed over the folds."""
    noise = dict.fromkeys(linears, 0.0)
    signal = dict.fromkeys(linears, 0.0)
    for fold in folds:
        xs, s = _smoothed_input(fold.x, fold.fit_absmax, [m.weight for m in linears.values()], alpha, folded)
        x_absmax = (fold.fit_absmax if s is None else fold.fit_absmax / s).max().item()
        x_scale = torch.tensor(max(clip * x_absmax, P.SCALE_EPS) / P.INT8_MAX)
        for name, m in linears.items():
            w = m.weight if s is None else (m.weight.float() * s).to(m.weight.dtype)  # rounded as stored
            qw, w_scale = cpu_quantize.quantize_int8(w.detach(), torch.float32)
            y = _w8a8(xs, qw, w_scale, x_scale if name in static else None)
            ref, tw = fold.refs[name], fold.token_weights[name]
            noise[name] += ((y - ref).pow(2).sum(dim=1) * tw).sum(dtype=torch.float64).item()
            signal[name] += (ref.pow(2).sum(dim=1) * tw).sum(dtype=torch.float64).item()
    return {n: noise[n] / max(signal[n], 1e-300) for n in linears}


def _token_weights(y: Tensor) -> Tensor:
    """Per-token weights 1 / (||y_t||^2 + mean ||y||^2) on the squared error. Plain MSE is ruled
    by attention-sink tokens, whose outputs dwarf the others in some layers: a static scale that
    keeps them exact but leaves every other token a few levels scores well. The added mean keeps
    tokens with near-zero outputs from dominating instead."""
    norms = y.pow(2).sum(dim=1)
    return 1.0 / (norms + norms.mean()).clamp_min(1e-30)


def _smoothed_input(x: Tensor, act_absmax: Tensor, weights: list[Tensor], alpha: float | None,
                    folded: bool) -> tuple[Tensor, Tensor | None]:
    """(X / s as the quantized layer will see it, s). Folded into a norm, X / s is that norm's
    output in the model dtype; otherwise the layer multiplies its fp32 input by 1/s itself."""
    if alpha is None:
        return x.float(), None
    s = smoothing_factors(act_absmax, weights, alpha)
    xs = x.float() * (1.0 / s)
    return (xs.to(x.dtype).float() if folded else xs), s


def _w8a8(xs: Tensor, qw: Tensor, w_scale: Tensor, x_scale: Tensor | None) -> Tensor:
    return torch.ops.fastflow.w8a8_linear(xs, qw, w_scale.to(xs.device),
                                          None if x_scale is None else x_scale.to(xs.device), None, None)


def _db(err: float) -> float:
    return math.inf if err <= 0.0 else -10.0 * math.log10(err)


def _keep_below(plan: Plan, min_sqnr: float, groups: list[InputGroup]) -> None:
    """Record the layers below `min_sqnr` as kept; a group left with no quantized member is not
    smoothed at all (smoothing would then only add the bf16 rounding of W * s)."""
    for name, db in plan.sqnr.items():
        if db < min_sqnr:
            plan.kept[name] = f"output SQNR {db:.1f} dB on calibration data < min_output_sqnr {min_sqnr:g} dB"
    for group in groups:
        if all(n in plan.kept for n in group.names):
            plan.alphas[group.names[0]] = None


def _log(plan: Plan, cfg) -> None:
    if plan.kept:
        worst = sorted(plan.kept, key=plan.sqnr.get)
        shown = ", ".join(f"{n} {plan.sqnr[n]:.1f} dB" for n in worst[:3]) + (
            f" and {len(worst) - 3} more" if len(worst) > 3 else "")
        logger.warning("quantize(w8a8): keeping %d of %d layer(s) in high precision: output SQNR below "
                       "min_output_sqnr %g dB (%s)", len(plan.kept), len(plan.sqnr), cfg.min_output_sqnr, shown)
    chosen = [a for a in plan.alphas.values() if a is not None]
    clipped = sum(1 for c in plan.clips.values() if c < 1.0)
    logger.info("quantize(w8a8): searched %d groups (alpha %s), %d of %d static scales clipped below absmax",
                len(plan.alphas), f"{min(chosen):g}..{max(chosen):g}" if chosen else "none", clipped,
                len(plan.clips))


@torch.no_grad()
def captured_inputs(model: nn.Module, groups: list[InputGroup], calibration_data):
    """Yield (group, (T, K) input rows in the model's dtype) for every group, T <= MAX_ROWS, one
    forward pass over the calibration data per chunk of groups (CAPTURE_BYTES per chunk)."""
    modules = dict(model.named_modules())
    batches = as_batches(calibration_data)
    rows = min(MAX_ROWS, sum(b.numel() for b in batches))
    for chunk in _chunks(groups, modules, rows):
        seen = {id(g): [] for g in chunk}
        handles = [modules[g.names[0]].register_forward_pre_hook(_capture_hook(seen[id(g)], rows)) for g in chunk]
        try:
            for ids in batches:
                model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        for g in chunk:
            if seen[id(g)]:
                yield g, torch.cat(seen.pop(id(g)))


def _capture_hook(store: list, rows: int):
    def hook(_module, args):
        have = sum(t.shape[0] for t in store)
        if have < rows:
            x = args[0].detach()
            store.append(x.reshape(-1, x.shape[-1])[: rows - have].clone())
    return hook


def _chunks(groups: list[InputGroup], modules: dict, rows: int):
    """Groups split so that each chunk's captured rows fit in CAPTURE_BYTES (at least one group each)."""
    chunk, size = [], 0
    for g in groups:
        w = modules[g.names[0]].weight
        nbytes = rows * w.shape[1] * w.element_size()
        if chunk and size + nbytes > CAPTURE_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(g)
        size += nbytes
    if chunk:
        yield chunk
