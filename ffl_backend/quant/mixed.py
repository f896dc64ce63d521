"""Mixed precision under a bits-per-weight budget: the "int4-mixed" preset.

Each linear the preset selects gets one of a few formats (TIERS: int4 in groups of 128, 64, 32 --
4.25, 4.5, 5.0 stored bits per weight with bf16 scales and zero points -- and int8 per channel, ~8).
Every layer starts in the cheapest; then, greedily, the upgrade (layer, better format) that removes
the most error per extra stored bit is taken while the average over these linears stays within the
budget.

A layer's error is measured where it matters, at the model's output: with calibration data, the
relative error ||h_q - h||^2 / ||h||^2 of the decoder's last hidden state on calibration tokens when
only that layer takes that format (everything else in high precision); without, the layer's own
relative weight error ||W_q - W||^2 / ||W||^2. A layer's own error says little of what it costs at
the output: how much a layer's error grows on its way there differs by layer type and depth. int4
candidates are fitted as `quantize` fits them (quant/int4_fit.py, weighted by calibration inputs).

Bits are what the quantized module stores (codes, scales, zero points; not the bias), so the budget
is met in memory, not only on paper. The average covers the linears the preset quantizes (the
embedding and lm_head stay in high precision, as with "int4").
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from .calibration import as_batches, input_mean_squares
from .schemes import DEFAULT_SKIP, QuantConfig, select_linears

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
    max_tokens: int = 256  # calibration tokens each candidate format of each layer is measured on

    def steps(self, model: nn.Module, calibration_data=None) -> tuple[list[QuantConfig], dict]:
        """(the QuantConfig steps `quantize` applies, the plan: format per layer, average bpw)."""
        linears = select_linears(model, QuantConfig(scheme="int4", skip=self.skip))
        candidates = {name: [(label, QuantConfig(**fields, skip=())) for label, fields in TIERS
                             if QuantConfig(**fields).keep_reason(lin) is None] for name, lin in linears.items()}
        candidates = {n: c for n, c in candidates.items() if c}
        costs = _costs(model, linears, candidates, calibration_data, self.max_tokens)
        choice = _allocate(costs, {n: linears[n].weight.numel() for n in candidates}, self.budget_bpw)
        plan = {n: candidates[n][i][0] for n, i in choice.items()}
        params = sum(linears[n].weight.numel() for n in choice)
        bits = sum(costs[n][i][0] * linears[n].weight.numel() for n, i in choice.items())
        summary = {"budget_bpw": self.budget_bpw, "bpw": round(bits / max(1, params), 4),
                   "error": "model" if calibration_data is not None else "weight", "formats": plan}
        counts = {label: sum(1 for v in plan.values() if v == label) for label, _ in TIERS}
        logger.info("quantize(int4-mixed): %.3f bits per weight (budget %.2f), layers per format %s, ranked by %s "
                    "error", summary["bpw"], self.budget_bpw, counts, summary["error"])
        steps = []
        for label, fields in TIERS:
            names = tuple(n for n, v in plan.items() if v == label)
            if names:
                steps.append(QuantConfig(**fields, include=names, skip=()))
        return steps, summary


@torch.no_grad()
def _costs(model, linears: dict, candidates: dict, calibration_data, max_tokens: int) -> dict:
    """{name: [(stored bits per weight, error) per candidate format]} (module docstring)."""
    from .handlers import handler_for

    ids = _calibration_ids(calibration_data, max_tokens)
    ids = ids.to(next(model.parameters()).device) if ids is not None else None
    # int4 candidates are fitted as quantize() will fit them: weighted by inputs on all the calibration data
    importance = input_mean_squares(model, list(candidates), calibration_data) if ids is not None else {}
    decoder = model.get_decoder()
    exact = decoder(input_ids=ids).last_hidden_state.double() if ids is not None else None
    costs = {}
    for name, formats in candidates.items():
        linear, row = linears[name], []
        original = linear.weight.data
        for _, cfg in formats:
            handler = handler_for(cfg)
            qm = handler.quantize(linear, cfg, **handler.standalone_kwargs(cfg, importance.get(name), None))
            stored = sum(t.numel() * t.element_size() for k, t in qm.state_dict().items() if k != "bias")
            approx = qm.dequantized_weight().to(original.dtype)
            if exact is None:
                w = original.double()
                err = ((approx.double() - w).square().sum() / w.square().sum()).item()
            else:
                linear.weight.data = approx
                try:
                    got = decoder(input_ids=ids).last_hidden_state.double()
                finally:
                    linear.weight.data = original
                err = ((got - exact).square().sum() / exact.square().sum()).item()
            row.append((8.0 * stored / original.numel(), err))
        costs[name] = row
    return costs


def _calibration_ids(calibration_data, max_tokens: int):
    """The first `max_tokens` calibration tokens as one (1, T) batch, or None."""
    if calibration_data is None:
        return None
    rows = [ids.reshape(-1) for ids in as_batches(calibration_data)]
    return torch.cat(rows)[:max_tokens][None] if rows else None


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
