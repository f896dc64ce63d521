"""`ffl_backend.quantize(model, config, *, calibration_data=None)`: swap nn.Linear in place."""
from __future__ import annotations

import logging

import torch
from torch import nn

from . import calibration
from .file_pages import copy_out_of_file_mappings, file_mappings, page_out, release_free_heap
from .mixed import mixed_config
from .modules import MODULES, Int8Embedding, Int8Linear, QuantizedModule
from .schemes import QuantConfig, resolve_steps, select_linears
from .tensor_parallel import carry_hooks, check_int4_groups, localize
from .weight_layout import share_sibling_packs

logger = logging.getLogger("ffl_backend")

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Attribute on the quantized model recording what was done (read by save_quantized and report).
STATE_ATTR = "_ffl_quant"


def select_embeddings(model: nn.Module, config: QuantConfig) -> dict[str, nn.Embedding]:
    """Plain nn.Embedding modules the config selects (the default `skip` excludes them)."""
    return {name: m for name, m in model.named_modules() if type(m) is nn.Embedding and config.selects(name)}


def _check_supported(name: str, linear: nn.Linear, config: QuantConfig) -> None:
    w = linear.weight
    if w.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: weight dtype {w.dtype} is not supported; quantize from one of {SUPPORTED_DTYPES}")
    if w.device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"{name}: device {w.device} is not supported; move the model to cpu or cuda first")
    if config.scheme == "fp8" and w.device.type == "cuda" and torch.cuda.get_device_capability(w.device) < (9, 0):
        raise RuntimeError(f"{name}: fp8 kernels need a Hopper GPU (sm_90); this one is "
                           f"sm_{''.join(map(str, torch.cuda.get_device_capability(w.device)))}")


def _keep_reason(linear: nn.Linear, config: QuantConfig) -> str | None:
    """Why this layer must stay in high precision under `config`, or None."""
    if config.scheme == "int4" and config.group_for(linear.in_features) is None:
        sizes = config.group_size or "of 32/64/128"
        return f"group_size {sizes} does not divide in_features {linear.in_features}"
    return None


def _warn_kept(cfg: QuantConfig, kept: dict) -> None:
    """One warning per distinct reason (a model can have hundreds of layers with the same one)."""
    by_reason: dict[str, list] = {}
    for name, reason in kept.items():
        by_reason.setdefault(reason, []).append(name)
    for reason, names in by_reason.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        logger.warning("quantize(%s): keeping %d layer(s) in high precision (%s): %s",
                       cfg.scheme, len(names), reason, shown)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` in place of the one called `name`, keeping its hooks (a tensor-parallel all-reduce)."""
    carry_hooks(model.get_submodule(name), module)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _check_shards(model: nn.Module, steps: list) -> None:
    """Tensor-parallel shards an int4 group size cannot divide: an error before any layer is quantized."""
    for step in steps:
        if step.scheme == "int4":
            for name, linear in select_linears(model, step).items():
                check_int4_groups(name, linear, step.group_size)


@torch.no_grad()
def quantize(model: nn.Module, config, *, calibration_data=None) -> nn.Module:
    """Quantize `model`'s selected nn.Linear layers in place and return `model`.

    config: a QuantConfig, its dict, a scheme name ("int8", "int4", "int4-g32" and the like, "w8a8",
    "fp8"), a preset name ("int8-all", "int4-all": embedding and lm_head included) or a list of these,
    applied in order; or "int4-mixed" / a `quant.mixed.MixedPrecision`: a format per linear chosen
    by measured error under a bits-per-weight budget (its plan in `model._ffl_quant["mixed"]`).
    calibration_data: iterable of input_ids tensors ((1, L) or (B, L)); required by w8a8 with
    `static=True` or `smoothquant_alpha` set, and by algorithm="gptq"; int4 uses it when given to
    weigh each input channel's rounding error (quant/int4_fit.py). Layers that cannot take the
    scheme (int4 group size not dividing in_features) stay in high precision with a logged warning
    and are listed in `model._ffl_quant["kept"]`."""
    localize(model)  # a transformers tensor-parallel model: plain local shards (quant/tensor_parallel.py)
    mixed = mixed_config(config)
    steps, plan = mixed.steps(model, calibration_data) if mixed is not None else (resolve_steps(config), None)
    _check_shards(model, steps)
    for step in steps:
        _quantize_step(model, step, calibration_data)
    if len(steps) > 1:
        getattr(model, STATE_ATTR)["config"] = [step.to_dict() for step in steps]
    if plan is not None:
        getattr(model, STATE_ATTR)["mixed"] = plan
    copy_out_of_file_mappings(model, skip=(QuantizedModule,))  # lets the replaced weights' pages go
    share_cpu_forms(model)
    release_free_heap()
    return model


def _quantize_step(model: nn.Module, cfg: QuantConfig, calibration_data) -> None:
    targets = select_linears(model, cfg)
    for name, linear in targets.items():
        _check_supported(name, linear, cfg)
    kept = {name: r for name, m in targets.items() if (r := _keep_reason(m, cfg))}
    for name in kept:
        del targets[name]
    _warn_kept(cfg, kept)
    if not targets:
        logger.warning("quantize(%s): no nn.Linear layer matched include=%s skip=%s", cfg.scheme, cfg.include, cfg.skip)
    extra = _calibrate(model, targets, cfg, calibration_data, kept)
    by_weight = {}  # id of a replaced linear's weight -> its quantized module (to share tied tables)
    mappings = file_mappings()
    for name in list(targets):
        linear = targets.pop(name)  # drop our reference so the high-precision weight can be freed
        by_weight[id(linear.weight)] = MODULES[cfg.scheme].from_linear(linear, cfg, **extra.get(name, {}))
        _set_module(model, name, by_weight[id(linear.weight)])
        page_out(linear.weight, mappings)  # a checkpoint's pages it read: not needed any more
        del linear
        # The quantizing temporaries of a large layer can land in glibc's heap (its mmap threshold
        # rises after large frees) and stay there as RSS: ~0.8 GB by the last layer of a 1.7B model in
        # one run of three, which made the peak. Trimming as we go keeps the peak at the weights.
        release_free_heap()
    _quantize_embeddings(model, cfg, by_weight, kept)
    state = getattr(model, STATE_ATTR, {"config": cfg.to_dict(), "kept": {}})
    state["kept"].update(kept)
    setattr(model, STATE_ATTR, state)


def _quantize_embeddings(model: nn.Module, cfg: QuantConfig, by_weight: dict, kept: dict) -> None:
    """Selected nn.Embedding layers become Int8Embedding (int8 scheme only). One tied to an output
    head that was just quantized reads that head's int8 table, so the pair costs one int8 copy."""
    for name, emb in select_embeddings(model, cfg).items():
        if cfg.scheme != "int8":
            kept[name] = f"embeddings are quantized by the int8 scheme only, not {cfg.scheme}"
            logger.warning("quantize(%s): keeping embedding %s in high precision (int8 only)", cfg.scheme, name)
            continue
        head = by_weight.get(id(emb.weight))
        if isinstance(head, Int8Linear):
            _set_module(model, name, Int8Embedding.tied_to(head))
        else:
            _set_module(model, name, Int8Embedding.from_embedding(emb))


def _calibrate(model, targets: dict, cfg: QuantConfig, calibration_data, kept: dict | None = None) -> dict:
    """{name: extra from_linear kwargs} from calibration (int4 fitted grids' input importance, w8a8
    static ranges, SmoothQuant, GPTQ).
    Layers that the w8a8 error search keeps in high precision move from `targets` to `kept`."""
    if cfg.algorithm == "gptq":
        return _gptq(model, targets, cfg, calibration_data)
    if cfg.fits_grid and calibration_data is not None and targets:
        importance = calibration.input_mean_squares(model, list(targets), calibration_data)
        return {n: {"importance": importance.get(n)} for n in targets}
    if cfg.scheme != "w8a8":
        return {}
    if not cfg.needs_calibration:
        return {}
    if calibration_data is None:
        raise ValueError("w8a8 with static=True, smoothquant_alpha or min_output_sqnr needs calibration_data: "
                         "an iterable of input_ids tensors ((1, L) or (B, L)) from text like the model's real inputs")
    absmax, token_absmax, groups = calibration.collect(model, list(targets), calibration_data)
    missing = [n for n in targets if n not in absmax]
    if missing:
        raise RuntimeError(f"calibration never reached {missing[:3]}{'...' if len(missing) > 3 else ''}")
    dynamic = _dynamic_fallbacks(cfg, token_absmax)
    plan = None
    if cfg.searches:
        from .w8a8_search import search

        plan = search(model, targets, groups, dynamic, cfg, calibration_data)
    alphas = plan.alphas if plan is not None else cfg.smoothquant_alpha
    own = (calibration.smooth(targets, groups, absmax, alphas, keep=plan.kept if plan else ())
           if alphas is not None else {})
    if plan is not None:
        for name, reason in plan.kept.items():
            del targets[name]
            if kept is not None:
                kept[name] = reason
    clips = plan.clips if plan is not None else {}
    return {n: {"x_absmax": clips.get(n, 1.0) * absmax[n].max().item() if cfg.static and n not in dynamic else None,
                "smooth": own.get(n)}
            for n in targets}


def _gptq(model, targets: dict, cfg: QuantConfig, calibration_data) -> dict:
    """{name: {"quantized": GPTQ codes and scales}} (quant/gptq.py), from one calibration pass."""
    if calibration_data is None:
        raise ValueError(f"{cfg.scheme} with algorithm='gptq' needs calibration_data: an iterable of input_ids "
                         "tensors ((1, L) or (B, L)) from text like the model's real inputs")
    if not targets:
        return {}
    from .gptq import quantize_layers

    return quantize_layers(model, targets, cfg, calibration_data)


def _dynamic_fallbacks(cfg: QuantConfig, token_absmax: dict) -> set:
    """Static w8a8 layers whose calibration shows token outliers get per-token scales instead:
    one static scale would leave typical tokens fewer than 127 / ratio levels."""
    if not cfg.static:
        return set()
    ratios = {n: calibration.token_range_ratio(t) for n, t in token_absmax.items()}
    dynamic = {n for n, r in ratios.items() if r > cfg.static_range_limit}
    if dynamic:
        worst = sorted(dynamic, key=ratios.get, reverse=True)[:3]
        logger.warning("quantize(w8a8 static): %d of %d layers use dynamic per-token activation scales: "
                       "token range ratio > %g (worst: %s)", len(dynamic), len(ratios), cfg.static_range_limit,
                       ", ".join(f"{n} {ratios[n]:.0f}x" for n in worst))
    return dynamic


def share_cpu_forms(model: nn.Module) -> None:
    """Lay out the CPU forms of sibling quantized linears so compiled code can read them as one
    tensor without a fused copy (int4 packs, patterns/horizontal_int4.py). After quantizing or loading."""
    share_sibling_packs(model)


def quantized_modules(model: nn.Module) -> dict[str, QuantizedModule]:
    """Every quantized layer (linears and int8 embeddings) by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedModule)}
