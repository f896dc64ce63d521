"""`ffl_backend.quantize(model, config, *, calibration_data=None)`: swap nn.Linear in place."""
from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from .. import progress
from .file_pages import copy_out_of_file_mappings, file_mappings, release_free_heap, release_pages
from .handlers import embedding_schemes, handler_for
from .mixed import mixed_config
from .modules import Int4Linear, QuantizedModule
from .schemes import QuantConfig, resolve_steps, select_linears
from .tensor_parallel import carry_hooks, localize
from .weight_layout import completed_group, share_sibling_group, share_sibling_packs

logger = logging.getLogger("ffl_backend")

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Attribute on the quantized model recording what was done (read by save_quantized and report).
STATE_ATTR = "_ffl_quant"


def select_embeddings(model: nn.Module, config: QuantConfig) -> dict[str, nn.Embedding]:
    """Plain nn.Embedding modules the config selects (the default `skip` excludes them)."""
    return {name: m for name, m in model.named_modules() if type(m) is nn.Embedding and config.selects(name)}


def _check_supported(name: str, linear: nn.Linear) -> None:
    w = linear.weight
    if w.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: weight dtype {w.dtype} is not supported; quantize from one of {SUPPORTED_DTYPES}")
    if w.device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"{name}: device {w.device} is not supported; move the model to cpu or cuda first")


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


def _check_layers(model: nn.Module, steps: list) -> None:
    """Layers a step cannot take where they are (dtype, device, a scheme's own checks: an fp8 GPU, an
    int4 tensor-parallel shard): an error before any layer is quantized."""
    for step in steps:
        handler = handler_for(step)
        for name, linear in select_linears(model, step).items():
            _check_supported(name, linear)
            handler.check(name, linear, step)


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
    with progress.timed("quantize") as phase:
        if mixed is not None:
            with phase("plan"), progress.status("quantize: measuring each linear's error for the mixed plan"):
                steps, plan = mixed.steps(model, calibration_data)
        else:
            steps, plan = resolve_steps(config), None
        _check_layers(model, steps)
        done = sum(_quantize_step(model, step, calibration_data, phase) for step in steps)
        if len(steps) > 1:
            getattr(model, STATE_ATTR)["config"] = [step.to_dict() for step in steps]
        if plan is not None:
            getattr(model, STATE_ATTR)["mixed"] = plan
        with phase("finish"):
            copy_out_of_file_mappings(model, skip=(QuantizedModule,))  # lets the replaced weights' pages go
            share_cpu_forms(model)
            release_free_heap()
        phase.detail = progress.count(done, "linear")
    return model


def step_label(cfg: QuantConfig) -> str:
    """How the progress bar and the summary line name a step: its scheme, group size and algorithm
    when they are set ("int4 g32", "int8 gptq")."""
    group, algorithm = getattr(cfg, "group_size", None), getattr(cfg, "algorithm", "rtn")
    return " ".join([cfg.scheme, *([f"g{group}"] if group else []), *([algorithm] if algorithm != "rtn" else [])])


def _quantize_step(model: nn.Module, cfg: QuantConfig, calibration_data, phase: progress.Phases) -> int:
    """Quantize the linears (and embeddings) `cfg` selects; returns how many linears it quantized."""
    handler = handler_for(cfg)
    label = step_label(cfg)
    targets = select_linears(model, cfg)
    kept = {name: r for name, m in targets.items() if (r := cfg.keep_reason(m))}
    for name in kept:
        del targets[name]
    _warn_kept(cfg, kept)
    if not targets:
        logger.warning("quantize(%s): no nn.Linear layer matched include=%s skip=%s", cfg.scheme, cfg.include, cfg.skip)
    # {name: extra from_linear kwargs} from calibration; layers it keeps in high precision move to `kept`.
    # Calibrating runs the model on the data: a phase of its own, with nothing to count while it runs.
    calibrating = calibration_data is not None and bool(targets)
    with (phase(f"calibrate {label}") if calibrating else contextlib.nullcontext()), \
            (progress.status(f"quantize {label}: calibrating") if calibrating else contextlib.nullcontext()):
        extra = handler.calibrate(model, targets, cfg, calibration_data, kept)
    total = len(targets)
    with phase(label, progress.count(total, "linear")), progress.bar(total, f"quantize {label}", "linear") as bar:
        by_weight = {}  # id of a replaced linear's weight -> its quantized module (to share tied tables)
        mappings = file_mappings()
        for name in list(targets):
            linear = targets.pop(name)  # drop our reference so the high-precision weight can be freed
            by_weight[id(linear.weight)] = handler.quantize(linear, cfg, **extra.get(name, {}))
            _set_module(model, name, by_weight[id(linear.weight)])
            release_pages(linear.weight, mappings)  # a checkpoint's pages it read: not needed any more
            del linear
            # q/k/v (gate/up) complete: their int4 CPU forms become slices of one tensor now, the old
            # forms freed (and trimmed below) before the next layer's exist -- not all at the end
            if (group := completed_group(model, name, Int4Linear)) is not None:
                share_sibling_group(group)
            # The quantizing temporaries of a large layer can land in glibc's heap (its mmap threshold
            # rises after large frees) and stay there as RSS, on a 1.7B model enough by the last layer to
            # make the peak (docs/quantization.md, peak RSS). Trimming as we go keeps the peak at the weights.
            release_free_heap()
            bar.update(1)
        _quantize_embeddings(model, cfg, handler, by_weight, kept)
    state = getattr(model, STATE_ATTR, {"config": cfg.to_dict(), "kept": {}})
    state["kept"].update(kept)
    setattr(model, STATE_ATTR, state)
    return total


def _quantize_embeddings(model: nn.Module, cfg: QuantConfig, handler, by_weight: dict, kept: dict) -> None:
    """Selected nn.Embedding layers take the scheme's quantized embedding, when it has one; `by_weight`
    gives the module just made from a linear sharing an embedding's weight (a tied head)."""
    for name, emb in select_embeddings(model, cfg).items():
        if handler.quantize_embedding is None:
            only = "/".join(embedding_schemes())
            kept[name] = f"embeddings are quantized by the {only} scheme only, not {cfg.scheme}"
            logger.warning("quantize(%s): keeping embedding %s in high precision (%s only)", cfg.scheme, name, only)
            continue
        _set_module(model, name, handler.quantize_embedding(emb, by_weight.get(id(emb.weight))))


def share_cpu_forms(model: nn.Module) -> None:
    """Lay out the CPU forms of sibling quantized linears so compiled code can read them as one
    tensor without a fused copy (int4 packs, patterns/horizontal_int4.py). After quantizing or loading."""
    share_sibling_packs(model)


def quantized_modules(model: nn.Module) -> dict[str, QuantizedModule]:
    """Every quantized layer (linears and int8 embeddings) by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedModule)}
