"""Per-layer quantization error: `ffl_backend.quant.report(model, config, calibration_data)`.

For every linear the config would quantize: the weight SQNR (dequantized vs original) and the output
SQNR on that layer's real inputs, captured from the calibration data, against a float64 run of the
original layer. Sorted worst first, with the skip list that meets a target output SQNR: keeping
exactly the layers below the target in high precision. Each layer is judged alone, on unsmoothed
inputs (SmoothQuant changes the layer's neighbours, so it is left out of a per-layer view).
With a w8a8 config that searches (smoothquant_alpha="auto", clip_search, min_output_sqnr), each
layer also gets the output SQNR that quantize's search measures (quant/w8a8_search.py: smoothed as
chosen, held out, token-balanced) and the layers min_output_sqnr would keep.
The model is not modified.
"""
from __future__ import annotations

import json

import torch
from torch import nn

from .. import numerics as P
from .calibration import as_batches
from .handlers import handler_for
from .schemes import resolve, select_linears

DEFAULT_TARGET_SQNR = 25.0  # dB


@torch.no_grad()
def capture_inputs(model: nn.Module, names: list[str], calibration_data, max_tokens: int) -> dict:
    """{name: (T, K) inputs} for each linear, the first `max_tokens` token rows it saw."""
    modules = dict(model.named_modules())
    seen: dict[str, list] = {n: [] for n in names}

    def hook(name):
        def fn(_module, args):
            have = sum(t.shape[0] for t in seen[name])
            if have < max_tokens:
                x = args[0].detach()
                seen[name].append(x.reshape(-1, x.shape[-1])[: max_tokens - have].clone())
        return fn

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in names]
    try:
        for ids in as_batches(calibration_data):
            model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(v) for n, v in seen.items() if v}


def _layer_errors(name: str, linear: nn.Linear, x: torch.Tensor, cfg, handler) -> dict:
    # from the inputs as quantize() calibrates: their mean squares (int4 grid fit), their range (w8a8 static)
    extra = handler.standalone_kwargs(cfg, x.double().square().mean(0).float(), x.abs().max().item())
    qm = handler.quantize(linear, cfg, **extra)
    w = linear.weight.detach()
    exact = nn.functional.linear(x.double(), w.double(), None if linear.bias is None else linear.bias.double())
    return {"name": name, "in_features": linear.in_features, "out_features": linear.out_features,
            "weight_sqnr_db": round(P.sqnr(w, qm.dequantized_weight()), 2),
            "output_sqnr_db": round(P.sqnr(exact, qm(x)), 2)}


def report(model: nn.Module, config, calibration_data, *, target_sqnr: float = DEFAULT_TARGET_SQNR,
           max_tokens: int = 256) -> dict:
    """{"config", "target_sqnr_db", "layers" (worst output SQNR first), "kept" (layers the scheme
    cannot take), "skip_for_target" (layers below target_sqnr)}. Print with `format_table`."""
    cfg = resolve(config)
    handler = handler_for(cfg)
    targets = select_linears(model, cfg)
    kept = {n: r for n, m in targets.items() if (r := cfg.keep_reason(m))}
    targets = {n: m for n, m in targets.items() if n not in kept}
    inputs = capture_inputs(model, list(targets), calibration_data, max_tokens)
    layers = [_layer_errors(n, m, inputs[n], cfg, handler) for n, m in targets.items() if n in inputs]
    layers.sort(key=lambda r: r["output_sqnr_db"])
    rep = {"config": cfg.to_dict(), "target_sqnr_db": target_sqnr, "layers": layers, "kept": kept,
           "skip_for_target": [r["name"] for r in layers if r["output_sqnr_db"] < target_sqnr]}
    handler.extend_report(rep, model, targets, cfg, calibration_data)
    return rep


def format_table(rep: dict, limit: int | None = None) -> str:
    rows = rep["layers"][:limit] if limit else rep["layers"]
    width = max([len(r["name"]) for r in rows] + [5])
    searched = bool(rows) and "searched_sqnr_db" in rows[0]
    lines = [f"{'layer':<{width}}  {'shape':>11}  {'weight dB':>9}  {'output dB':>9}"
             + ("  searched dB" if searched else "")]
    for r in rows:
        shape = f"{r['out_features']}x{r['in_features']}"
        lines.append(f"{r['name']:<{width}}  {shape:>11}  {r['weight_sqnr_db']:>9.2f}  {r['output_sqnr_db']:>9.2f}"
                     + (f"  {r['searched_sqnr_db']:>11.2f}" if searched else ""))
    skip = rep["skip_for_target"]
    lines.append(f"{len(skip)} of {len(rep['layers'])} layers below {rep['target_sqnr_db']} dB"
                 + (f"; skip={json.dumps(skip)}" if skip else ""))
    for name, reason in rep.get("kept_by_min_output_sqnr", {}).items():
        lines.append(f"min_output_sqnr keeps in high precision: {name} ({reason})")
    for name, reason in rep["kept"].items():
        lines.append(f"kept in high precision: {name} ({reason})")
    return "\n".join(lines)
