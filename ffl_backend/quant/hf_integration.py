"""`AutoModelForCausalLM.from_pretrained(dir)` for models saved by `save_quantized`.

transformers lets a library register its own quantization config and quantizer
(`transformers.quantizers.auto.register_quantization_config` / `register_quantizer`). Once
`register_with_transformers()` has run (`save_quantized` and `load_quantized` call it; call it
yourself in a fresh process before `from_pretrained`), a folder whose config.json carries
`quantization_config: {"quant_method": "fastflow", ...}` loads quantized:

1. transformers builds the model on the meta device; `_process_model_before_weight_loading` swaps
   every listed nn.Linear for an empty quantized module (the specs saved in the config);
2. transformers loads model.safetensors into those buffers by name: nothing is re-quantized and
   the high-precision weights are never materialized;
3. `_process_model_after_weight_loading` derives each module's CPU forms (`finalize`).

`from_pretrained(hp_dir, quantization_config=FastflowQuantizationConfig(scheme="int8"))` instead
quantizes a high-precision checkpoint right after loading it (peak memory: the full model).

Registration changes a transformers-global table, so it is an explicit call, never an import side
effect. Without it transformers warns "Unknown quantization type, got fastflow" and would load
garbage into a plain model, so `load_quantized` (which needs no registration) stays the safe route.
"""
from __future__ import annotations

import logging

from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .handlers import build_module, replaced_type
from .quantizer import STATE_ATTR, _set_module, quantize, quantized_modules, share_cpu_forms
from .weight_layout import finalization_units, finalize_unit

logger = logging.getLogger("ffl_backend")

QUANT_METHOD = "fastflow"


class FastflowQuantizationConfig(QuantizationConfigMixin):
    """The `quantization_config` entry of a saved config.json.

    Pre-quantized: `modules` maps each quantized layer name to its `QuantizedLinear.spec()`;
    `quant_config` and `kept` record how it was made. To quantize at load time, pass `scheme`
    (and optionally the other `QuantConfig` fields as `quant_config`) with `modules` empty."""

    def __init__(self, modules: dict | None = None, quant_config: dict | None = None, kept: dict | None = None,
                 scheme: str | None = None, tied: dict | None = None, **kwargs):
        self.quant_method = QUANT_METHOD
        self.modules = dict(modules or {})
        self.tied = dict(tied or {})  # buffer -> buffer it shares (a tied int8 embedding and lm_head)
        # a dict (one QuantConfig) or, for a multi-step preset such as "int4-all", a list of them
        quant_config = quant_config or ({"scheme": scheme} if scheme else {})
        self.quant_config = list(quant_config) if isinstance(quant_config, (list, tuple)) else dict(quant_config)
        self.kept = dict(kept or {})
        if not self.modules and not self.quant_config:
            raise ValueError("FastflowQuantizationConfig needs either saved `modules` or a `scheme` to quantize with")

    def to_dict(self) -> dict:
        return {"quant_method": self.quant_method, "modules": self.modules, "quant_config": self.quant_config,
                "kept": self.kept, "tied": self.tied}


class FastflowHfQuantizer(HfQuantizer):
    """Loads fastflow-quantized checkpoints (pre-quantized) or quantizes after loading (not)."""

    requires_calibration = False

    def __init__(self, quantization_config: FastflowQuantizationConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        if self.pre_quantized and not quantization_config.modules:
            raise ValueError("this checkpoint's quantization_config lists no quantized modules: it was not "
                             "saved by ffl_backend.quant.save_quantized")

    def _process_model_before_weight_loading(self, model, **kwargs):
        if not self.pre_quantized:
            return model
        for name, spec in self.quantization_config.modules.items():
            try:
                current = model.get_submodule(name)
            except AttributeError as exc:
                raise ValueError(f"quantization_config names {name}, absent from {type(model).__name__}") from exc
            if not isinstance(current, replaced_type(spec)):
                raise ValueError(f"quantization_config names {name}, which is not a {replaced_type(spec).__name__}")
            _set_module(model, name, build_module(spec, device="meta"))
        # transformers would re-tie `lm_head.weight` to the embedding; replaced modules have no weight
        # (their own tied buffers are shared after loading, below).
        replaced = tuple(f"{name}." for name in self.quantization_config.modules)
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        model.all_tied_weights_keys = {k: v for k, v in tied.items()
                                       if not k.startswith(replaced) and not v.startswith(replaced)}
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        cfg = self.quantization_config
        if not self.pre_quantized:
            quantize(model, cfg.quant_config)
            state = getattr(model, STATE_ATTR)
            cfg.modules = {name: m.spec() for name, m in quantized_modules(model).items()}
            cfg.kept = dict(state["kept"])
            return model
        for unit in finalization_units(model):  # sibling int4 linears: one CPU form, made as one
            finalize_unit(unit)  # may re-align (copy) buffers: tie after it
        for alias, target in cfg.tied.items():  # both were loaded: keep one copy
            owner, _, buffer = alias.rpartition(".")
            setattr(model.get_submodule(owner), buffer, model.get_buffer(target))
        share_cpu_forms(model)
        setattr(model, STATE_ATTR, {"config": cfg.quant_config, "kept": cfg.kept})
        return model

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def register_with_transformers() -> None:
    """Make `from_pretrained` understand `quant_method: "fastflow"` (idempotent)."""
    if QUANT_METHOD in AUTO_QUANTIZER_MAPPING:
        return
    register_quantization_config(QUANT_METHOD)(FastflowQuantizationConfig)
    register_quantizer(QUANT_METHOD)(FastflowHfQuantizer)
    logger.debug("registered the %r quantizer with transformers", QUANT_METHOD)


def config_entry(model, tied: dict | None = None, modules: dict | None = None) -> dict:
    """The config.json `quantization_config` of a model quantized by ffl_backend; `tied`: buffers
    saved twice that share one tensor once loaded ({alias: target}); `modules`: each quantized
    module's spec as saved (default: `spec()`)."""
    state = getattr(model, STATE_ATTR, {})
    if modules is None:
        modules = {name: m.spec() for name, m in quantized_modules(model).items()}
    return FastflowQuantizationConfig(modules, state.get("config"), state.get("kept"), tied=tied).to_dict()
