"""Scheme handlers: what each quantization scheme does, looked up by its config's `scheme`.

A scheme is a config class (schemes.py: its fields and their checks) and a handler, registered
together by `register_scheme` (the model: torchao's `quantize_` with `register_quantize_module_handler`).
The handler holds everything about the scheme that quantize, report, mixed precision, GPTQ and
save/load need: its module, its calibration, the checks a layer must pass, whether it takes
embeddings. Those modules look the handler up instead of branching on the scheme's name, so a new
scheme brings its config, module and handler and changes none of them (docs/extending.md).
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor, nn

from . import calibration
from .gptq import DAMP, gptq, int4_grid, int8_grid, quantize_layers
from .modules import Fp8Linear, Int4Linear, Int8Embedding, Int8Linear, QuantizedModule, W8A8Linear
from .schemes import Fp8Config, Int4Config, Int8Config, W8A8Config, forget_config, register_config
from .tensor_parallel import check_int4_groups

logger = logging.getLogger("ffl_backend")


class SchemeHandler:
    """The hooks of one scheme. The defaults suit a scheme whose module needs nothing but the layer
    and its config: no calibration, any device, embeddings left in high precision."""

    # (embedding, head) -> quantized embedding; `head` is the module just made from a linear sharing
    # the embedding's weight, or None. None here: the scheme leaves embeddings in high precision.
    quantize_embedding = None

    def __init__(self, module: type):
        # The scheme's quantized module: `from_linear(linear, config, **calibrated)`, `spec()`, and a
        # constructor taking (in_features, out_features, dtype, has_bias, device, **spec extras).
        self.module = module

    def check(self, name: str, linear: nn.Linear, config) -> None:
        """Raise, before any layer is quantized, when this layer cannot take the scheme where it is."""

    def calibrate(self, model: nn.Module, targets: dict, config, calibration_data, kept: dict) -> dict:
        """{name: extra from_linear kwargs} for `targets` from calibration_data (None when not given).
        A layer that is to stay in high precision moves from `targets` to `kept` ({name: reason})."""
        return {}

    def quantize(self, linear: nn.Linear, config, **calibrated) -> QuantizedModule:
        return self.module.from_linear(linear, config, **calibrated)

    def standalone_kwargs(self, config, mean_square: Tensor | None, absmax: float | None) -> dict:
        """from_linear kwargs to quantize one layer by itself (the per-layer report, mixed precision:
        no smoothing, no GPTQ), from its inputs' per-channel mean squares and largest magnitude."""
        return {}

    def extend_report(self, rep: dict, model: nn.Module, targets: dict, config, calibration_data) -> None:
        """Add to a per-layer report (layer_report.py) what this scheme's own calibration measures."""


class WeightOnlyHandler(SchemeHandler):
    """Handlers of WeightOnlyConfig schemes: algorithm="gptq" runs GPTQ (quant/gptq.py) on the grid
    `gptq_weight` gives; round-to-nearest calibrates as `rtn_calibrate` says."""

    def calibrate(self, model, targets, config, calibration_data, kept):
        if config.algorithm != "gptq":
            return self.rtn_calibrate(model, targets, config, calibration_data)
        if calibration_data is None:
            raise ValueError(f"{config.scheme} with algorithm='gptq' needs calibration_data: an iterable of "
                             "input_ids tensors ((1, L) or (B, L)) from text like the model's real inputs")
        return gptq_layers(model, targets, config, calibration_data) if targets else {}

    def rtn_calibrate(self, model, targets, config, calibration_data) -> dict:
        return {}

    def gptq_weight(self, linear: nn.Linear, h: Tensor, config, damp: float) -> tuple[tuple, Tensor]:
        """(the `quantized` tuple from_linear takes, dequantized weight (N, K) fp32) of GPTQ on one
        layer with input Hessian `h`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement GPTQ")


class Int8Handler(WeightOnlyHandler):
    def gptq_weight(self, linear, h, config, damp):
        w = linear.weight.detach()
        codes, scale, _zero, w_hat = gptq(w, h, int8_grid(w), damp)
        return (codes, scale[:, 0].to(w.dtype)), w_hat

    @staticmethod
    def quantize_embedding(embedding, head):
        """One tied to an output head that was just quantized reads that head's int8 table, so the
        pair costs one int8 copy."""
        if isinstance(head, Int8Linear):
            return Int8Embedding.tied_to(head)
        return Int8Embedding.from_embedding(embedding)


class Int4Handler(WeightOnlyHandler):
    def check(self, name, linear, config):
        check_int4_groups(name, linear, config.group_size)  # a tensor-parallel shard the group size must divide

    def rtn_calibrate(self, model, targets, config, calibration_data):
        """Fitted grids weigh each input channel's rounding error by its mean square on the data."""
        if not (config.fits_grid and calibration_data is not None and targets):
            return {}
        importance = calibration.input_mean_squares(model, list(targets), calibration_data)
        return {n: {"importance": importance.get(n)} for n in targets}

    def standalone_kwargs(self, config, mean_square, absmax):
        return {"importance": mean_square} if config.fits_grid else {}

    def gptq_weight(self, linear, h, config, damp):
        w = linear.weight.detach()
        grid = int4_grid(config.group_for(linear.in_features), config.is_symmetric, w.dtype)
        codes, scale, zero, w_hat = gptq(w, h, grid, damp)
        return (codes, scale.to(w.dtype), zero.to(w.dtype)), w_hat


# Said once per process to whoever quantizes plain "w8a8" with no calibration data; the figures are
# docs/quantization.md's (SmolLM2-135M, 16k held-out tokens of Pride and Prejudice).
PLAIN_W8A8_HINT = ('quantize("w8a8") without calibration data: per-token int8 activations, no smoothing '
                   '(+3.3% perplexity on SmolLM2-135M); "w8a8-smooth" with calibration_data=[input_ids, ...] '
                   'loses less (+1.0%): docs/quantization.md, "Which W8A8 to pick"')


@functools.lru_cache(maxsize=1)
def _hint_plain_w8a8() -> None:
    logger.warning(PLAIN_W8A8_HINT)


class W8A8Handler(SchemeHandler):
    def calibrate(self, model, targets, config, calibration_data, kept):
        """Static activation ranges, SmoothQuant factors and the output-error search (w8a8_search.py);
        the layers that search keeps in high precision move from `targets` to `kept`."""
        if not config.needs_calibration:
            if calibration_data is None and targets:
                _hint_plain_w8a8()
            return {}
        if calibration_data is None:
            raise ValueError("w8a8 with static=True, smoothquant_alpha or min_output_sqnr needs calibration_data: "
                             "an iterable of input_ids tensors ((1, L) or (B, L)) from text like the model's "
                             "real inputs")
        absmax, token_absmax, groups = calibration.collect(model, list(targets), calibration_data)
        missing = [n for n in targets if n not in absmax]
        if missing:
            raise RuntimeError(f"calibration never reached {missing[:3]}{'...' if len(missing) > 3 else ''}")
        dynamic = _dynamic_fallbacks(config, token_absmax)
        plan = None
        if config.searches:
            from .w8a8_search import search

            plan = search(model, targets, groups, dynamic, config, calibration_data)
        alphas = plan.alphas if plan is not None else config.smoothquant_alpha
        own = (calibration.smooth(targets, groups, absmax, alphas, keep=plan.kept if plan else ())
               if alphas is not None else {})
        if plan is not None:
            for name, reason in plan.kept.items():
                del targets[name]
                kept[name] = reason
        clips = plan.clips if plan is not None else {}
        return {n: {"x_absmax": clips.get(n, 1.0) * absmax[n].max().item()
                    if config.static and n not in dynamic else None, "smooth": own.get(n)}
                for n in targets}

    def standalone_kwargs(self, config, mean_square, absmax):
        return {"x_absmax": absmax if config.static else None}

    def extend_report(self, rep, model, targets, config, calibration_data):
        """With a searching config: each layer's output SQNR as quantize's search measures it (smoothed
        as chosen, held out, token-balanced) and the layers min_output_sqnr would keep."""
        if not config.searches:
            return
        from .w8a8_search import search

        _, token_absmax, groups = calibration.collect(model, list(targets), calibration_data)
        plan = search(model, targets, groups, _dynamic_fallbacks(config, token_absmax), config, calibration_data)
        for r in rep["layers"]:
            r["searched_sqnr_db"] = round(plan.sqnr[r["name"]], 2)
        rep["kept_by_min_output_sqnr"] = plan.kept


def _dynamic_fallbacks(config, token_absmax: dict) -> set:
    """Static w8a8 layers whose calibration shows token outliers get per-token scales instead:
    one static scale would leave typical tokens fewer than 127 / ratio levels."""
    if not config.static:
        return set()
    ratios = {n: calibration.token_range_ratio(t) for n, t in token_absmax.items()}
    dynamic = {n for n, r in ratios.items() if r > config.static_range_limit}
    if dynamic:
        worst = sorted(dynamic, key=ratios.get, reverse=True)[:3]
        logger.warning("quantize(w8a8 static): %d of %d layers use dynamic per-token activation scales: "
                       "token range ratio > %g (worst: %s)", len(dynamic), len(ratios), config.static_range_limit,
                       ", ".join(f"{n} {ratios[n]:.0f}x" for n in worst))
    return dynamic


class Fp8Handler(SchemeHandler):
    def check(self, name, linear, config):
        device = linear.weight.device
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
            raise RuntimeError(f"{name}: fp8 kernels need a Hopper GPU (sm_90); this one is "
                               f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}")


_HANDLERS: dict[str, SchemeHandler] = {}


def register_scheme(config: type, handler: SchemeHandler, *, replace: bool = False) -> None:
    """Make `config.scheme` a quantization scheme: `QuantConfig(scheme, ...)` builds a `config`, and
    quantize, report and load use `handler` for it. Registering a scheme twice is an error unless
    replace=True."""
    if config.scheme in _HANDLERS and not replace:
        raise ValueError(f"quantization scheme {config.scheme!r} is already registered (replace=True replaces it)")
    if replace:
        forget_config(config.scheme)
    register_config(config)
    _HANDLERS[config.scheme] = handler


def unregister_scheme(scheme: str) -> None:
    """Remove a scheme registered by register_scheme (built-in ones included)."""
    _HANDLERS.pop(scheme, None)
    forget_config(scheme)


def handler_for(config) -> SchemeHandler:
    """The handler of a config, or of a scheme name."""
    scheme = config if isinstance(config, str) else config.scheme
    if scheme not in _HANDLERS:
        raise ValueError(f"no handler for quantization scheme {scheme!r}; registered: {tuple(_HANDLERS)} "
                         "(handlers.register_scheme adds one)")
    return _HANDLERS[scheme]


def embedding_schemes() -> tuple[str, ...]:
    """The schemes that quantize the embeddings they select."""
    return tuple(s for s, h in _HANDLERS.items() if h.quantize_embedding is not None)


def gptq_weight(linear: nn.Linear, h: Tensor, config, damp: float = DAMP) -> tuple[tuple, Tensor]:
    """GPTQ of one linear under a weight-only `config` (WeightOnlyHandler.gptq_weight)."""
    return handler_for(config).gptq_weight(linear, h, config, damp)


def gptq_layers(model: nn.Module, targets: dict, config, calibration_data, **options) -> dict:
    """{name: {"quantized": ...}} of GPTQ on every target under `config` (gptq.quantize_layers)."""
    return quantize_layers(model, targets, lambda linear, h, damp: gptq_weight(linear, h, config, damp),
                           calibration_data, **options)


def replaced_type(spec: dict) -> type:
    """The high-precision module type a saved quantized module (its `spec()`) replaced."""
    return nn.Embedding if spec["scheme"] == Int8Embedding.scheme else nn.Linear


def build_module(spec: dict, device="cpu") -> QuantizedModule:
    """An empty (uninitialized) module from a quantized module's `spec()`, to load saved buffers into."""
    spec = dict(spec)
    if spec["scheme"] == Int8Embedding.scheme:
        spec.pop("scheme")
        return Int8Embedding(spec.pop("num_embeddings"), spec.pop("embedding_dim"), getattr(torch, spec.pop("dtype")),
                             device)
    cls = handler_for(spec.pop("scheme")).module
    dtype = getattr(torch, spec.pop("dtype"))
    args = (spec.pop("in_features"), spec.pop("out_features"), dtype, spec.pop("has_bias"), device)
    return cls(*args, **spec)


register_scheme(Int8Config, Int8Handler(Int8Linear))
register_scheme(Int4Config, Int4Handler(Int4Linear))
register_scheme(W8A8Config, W8A8Handler(W8A8Linear))
register_scheme(Fp8Config, Fp8Handler(Fp8Linear))
