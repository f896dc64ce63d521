"""Mixed precision under a bits-per-weight budget: the "int4-mixed" preset.

Each linear the preset selects gets one of a few formats (TIERS: int4 in groups of 128, 64, 32 --
4.25, 4.5, 5.0 stored bits per weight with bf16 scales and zero points -- and int8 per channel, ~8).
Every layer starts in the cheapest; then, greedily, the upgrade (layer, better format) that removes
the most error per extra stored bit is taken while the model's average stays within the budget.

A layer's error is its relative output noise ||y_q - y||^2 / ||y||^2 on inputs captured from
calibration data (the per-layer report's measurement), or, without calibration data, the relative
weight noise ||W_q - W||^2 / ||W||^2. Layers count alike: one whose inputs carry outliers (Gemma's
down_proj) shows a large output error and is upgraded first.

Bits are what the quantized module stores (codes, scales, zero points; not the bias), so the budget
is met in memory, not only on paper. The average covers the linears the preset quantizes (the
embedding and lm_head stay in high precision, as with "int4").
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from .schemes import DEFAULT_SKIP, QuantConfig

logger = logging.getLogger("ffl_backend")

# Preset names `quantize` (and the CLIs) accept for a MixedPrecision (defined below).
MIXED_PRESETS = ("int4-mixed",)

TIERS = (  # cheapest first
    ("int4-g128", {"scheme": "int4", "group_size": 128}),
    ("int4-g64", {"scheme": "int4", "group_size": 64}),
    ("int4-g32", {"scheme": "int4", "group_size": 32}),
    ("int8", {"scheme": "int8"}),
)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Choose a format per linear (TIERS) so the average stored bits per weight stay <= budget_bpw."""

    budget_bpw: float = 5.0
    skip: tuple = DEFAULT_SKIP
    max_tokens: int = 256  # calibration rows per layer used to measure its output error

    def steps(self, model: nn.Module, calibration_data=None) -> tuple[list[QuantConfig], dict]:
        """(the QuantConfig steps `quantize` applies, the plan: format per layer, average bpw)."""
        from .quantizer import select_linears

        linears = select_linears(model, QuantConfig(scheme="int4", skip=self.skip))
        candidates = {name: [(label, QuantConfig(**fields, skip=())) for label, fields in TIERS
                             if _fits(lin, QuantConfig(**fields))] for name, lin in linears.items()}
        candidates = {n: c for n, c in candidates.items() if c}
        inputs = _inputs(model, list(candidates), calibration_data, self.max_tokens)
        costs = {n: [_measure(linears[n], cfg, inputs.get(n)) for _, cfg in c] for n, c in candidates.items()}
        choice = _allocate(costs, {n: linears[n].weight.numel() for n in candidates}, self.budget_bpw)
        plan = {n: candidates[n][i][0] for n, i in choice.items()}
        params = sum(linears[n].weight.numel() for n in choice)
        bits = sum(costs[n][i][0] * linears[n].weight.numel() for n, i in choice.items())
        summary = {"budget_bpw": self.budget_bpw, "bpw": round(bits / max(1, params), 4),
                   "error": "output" if inputs else "weight", "formats": plan}
        counts = {label: sum(1 for v in plan.values() if v == label) for label, _ in TIERS}
        logger.info("quantize(int4-mixed): %.3f bits per weight (budget %.2f), layers per format %s, ranked by %s "
                    "error", summary["bpw"], self.budget_bpw, counts, summary["error"])
        steps = []
        for label, fields in TIERS:
            names = tuple(n for n, v in plan.items() if v == label)
            if names:
                steps.append(QuantConfig(**fields, include=names, skip=()))
        return steps, summary


def _fits(linear: nn.Linear, cfg: QuantConfig) -> bool:
    return cfg.scheme != "int4" or cfg.group_for(linear.in_features) is not None


def _inputs(model, names, calibration_data, max_tokens) -> dict:
    if calibration_data is None:
        return {}
    from .layer_report import capture_inputs

    return capture_inputs(model, names, calibration_data, max_tokens)


@torch.no_grad()
def _measure(linear: nn.Linear, cfg: QuantConfig, x) -> tuple[float, float]:
    """(stored bits per weight, relative error) of `linear` quantized by `cfg`."""
    from .modules import MODULES

    qm = MODULES[cfg.scheme].from_linear(linear, cfg)
    stored = sum(t.numel() * t.element_size() for k, t in qm.state_dict().items() if k != "bias")
    w = linear.weight.detach().double()
    if x is None:
        err = ((qm.dequantized_weight().double() - w).square().sum() / w.square().sum()).item()
    else:
        exact = x.double() @ w.T
        got = nn.functional.linear(x, qm.dequantized_weight().to(x.dtype)).double()
        err = ((got - exact).square().sum() / exact.square().sum().clamp_min(1e-30)).item()
    return 8.0 * stored / linear.weight.numel(), err


def _allocate(costs: dict, params: dict, budget_bpw: float) -> dict:
    """{name: tier index}: start at each layer's cheapest, then take the upgrade with the largest
    error drop per extra bit that keeps the total within budget, until none fits."""
    choice = {n: 0 for n in costs}
    limit = budget_bpw * sum(params.values())
    used = sum(costs[n][0][0] * params[n] for n in costs)
    if used > limit:
        logger.warning("quantize(int4-mixed): even the cheapest formats take %.3f bits per weight, over the "
                       "budget of %.2f", used / sum(params.values()), budget_bpw)
    while True:
        best, best_gain = None, 0.0
        for n, tiers in costs.items():
            bits_now, err_now = tiers[choice[n]]
            for i in range(choice[n] + 1, len(tiers)):
                extra = (tiers[i][0] - bits_now) * params[n]
                drop = err_now - tiers[i][1]
                if extra > 0 and drop > 0 and used + extra <= limit and drop / extra > best_gain:
                    best, best_gain = (n, i, extra), drop / extra
        if best is None:
            return choice
        n, i, extra = best
        choice[n], used = i, used + extra


def mixed_config(config) -> MixedPrecision | None:
    """The MixedPrecision `config` names ("int4-mixed") or is, else None."""
    if isinstance(config, str) and config in MIXED_PRESETS:
        return MixedPrecision()
    return config if isinstance(config, MixedPrecision) else None
