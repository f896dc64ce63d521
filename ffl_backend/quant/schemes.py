"""Quantization configs: one frozen dataclass, validated on construction, serializable to JSON."""
from __future__ import annotations

import dataclasses
import math
from fnmatch import fnmatchcase

SCHEMES = ("int8", "int4", "w8a8", "fp8")
GROUP_SIZES = (32, 64, 128)
# How weights are rounded: "rtn" (round to nearest) or "gptq" (Hessian-aware, quant/gptq.py), which
# needs calibration data and applies to the weight-only schemes.
ALGORITHMS = ("rtn", "gptq")
GPTQ_SCHEMES = ("int8", "int4")
# How an int4 group's scale and zero point are chosen (round-to-nearest): "fit" searches for the grid of
# least importance-weighted error (quant/int4_fit.py), "minmax" spans the group's [min, max].
INT4_GRIDS = ("fit", "minmax")
# Mixed precision by default: embeddings and the output head stay in high precision. They are the
# layers whose error every token sees, and lm_head is often tied to the embedding.
DEFAULT_SKIP = ("lm_head", "*embed*", "*wte", "*wpe")
# Named configs beyond the schemes' defaults, each a list of configs applied in order (a later step
# quantizes what earlier ones left in high precision). "int8-all": int8 everywhere, embeddings and
# lm_head included (a tied pair shares one int8 table). "int4-all": int4 linears in groups of 32 (the
# group of llama.cpp's Q4 formats), then the embedding and lm_head in int8 (the head is a large share
# of a small model's bytes). "w8a8-static": static activation scales chosen by measured output error
# (per-group SmoothQuant alpha, clip search; quant/w8a8_search.py), layers whose calibration tokens span
# more than 8x keep per-token scales, layers still below 22 dB output SQNR kept in high precision.
# "w8a8-smooth": per-token activation scales after the searched per-group SmoothQuant alpha, the same
# 22 dB floor (SmolLM2, 16k tokens: +1.0% against +2.8% for plain "w8a8"). Quality and speed of each:
# docs/quantization.md.
PRESETS = {
    "int8-all": [{"scheme": "int8", "skip": ()}],
    "int4-all": [{"scheme": "int4", "group_size": 32}, {"scheme": "int8", "include": DEFAULT_SKIP, "skip": ()}],
    "w8a8-static": [{"scheme": "w8a8", "static": True, "smoothquant_alpha": "auto", "clip_search": True,
                     "min_output_sqnr": 22.0}],
    "w8a8-smooth": [{"scheme": "w8a8", "smoothquant_alpha": "auto", "min_output_sqnr": 22.0}],
}


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """What to quantize, and how.

    scheme         "int8" (weight-only, per output channel), "int4" (weight-only, group-wise),
                   "w8a8" (int8 weights and activations), "fp8" (e4m3 weights and activations).
    group_size     int4 only: 32, 64 or 128 input channels per scale; a layer whose in_features it does
                   not divide stays in high precision (logged). None (default): per layer, the
                   smallest of 32, 64, 128 that divides its in_features -- 32 for nearly every model,
                   llama.cpp's Q4 group. Larger groups cost quality the smaller scales do not save
                   in speed (docs/quantization.md: SmolLM2 +0.14% at 32, +43% with 64/128).
    symmetric      int4 only: True = zero point fixed at 8; False (default) = per-group zero point.
                   The other schemes are symmetric by construction.
    grid           int4 round-to-nearest only: "fit" (default) = each group's scale and zero point of least
                   squared error, weighted by the input channels' mean squares on calibration data when
                   it is given, else by the weights' own squares (quant/int4_fit.py; Gemma-3 perplexity
                   +3.8% with data, +12.5% without, against +22% for "minmax"); "minmax" = the group's
                   [min, max]. GPTQ chooses its own grid per group as it goes ([min, max]).
    static         w8a8 only: one activation scale per layer from calibration data (True) or one per
                   token at run time (False, the default).
    static_range_limit  w8a8 static: a layer whose largest calibration token exceeds its 99th-percentile
                   token by more than this factor keeps per-token scales (logged); inf = never.
    smoothquant_alpha  w8a8 only: SmoothQuant migration strength in [0, 1], or None (no smoothing), or
                   "auto": per input group, the alpha of least output error on calibration data
                   (quant/w8a8_search.py).
    clip_search    w8a8 static: each layer's static activation scale is clip_ratio * calibration absmax,
                   the ratio searched for the least output error on calibration data (False: absmax).
    min_output_sqnr  w8a8: a layer whose output SQNR (dB) on calibration data, quantized as finally
                   chosen, is below this stays in high precision (logged, listed in _ffl_quant["kept"]).
    skip, include  fnmatch patterns on module names (e.g. "model.layers.0.*"); a linear is quantized
                   when it matches some `include` pattern and no `skip` pattern.
    algorithm      "rtn" (default): round each weight to the nearest grid point. "gptq" (int4, int8):
                   GPTQ, which rounds column by column and moves each column's error onto the
                   columns not yet rounded, weighted by the layer's input statistics from calibration
                   data (required). Same stored layout and kernels as "rtn".
    """

    scheme: str = "int8"
    group_size: int | None = None
    symmetric: bool | None = None
    grid: str | None = None
    static: bool = False
    static_range_limit: float = 8.0
    smoothquant_alpha: float | str | None = None
    skip: tuple = DEFAULT_SKIP
    include: tuple = ("*",)
    algorithm: str = "rtn"
    clip_search: bool = False
    min_output_sqnr: float | None = None

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown quantization scheme {self.scheme!r}; choose one of {SCHEMES}")
        if self.scheme == "int4" and self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, got {self.group_size}")
        if self.scheme != "int4" and self.symmetric is False:
            raise ValueError(f"{self.scheme} is symmetric only; symmetric=False applies to int4")
        if self.grid is not None and (self.scheme != "int4" or self.grid not in INT4_GRIDS):
            raise ValueError(f"grid applies to the int4 scheme only and is one of {INT4_GRIDS}, "
                             f"got {self.grid!r} for {self.scheme}")
        if self.scheme != "w8a8" and (self.static or self.smoothquant_alpha is not None):
            raise ValueError("static and smoothquant_alpha apply to the w8a8 scheme only")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; choose one of {ALGORITHMS}")
        if self.algorithm == "gptq" and self.scheme not in GPTQ_SCHEMES:
            raise ValueError(f"algorithm 'gptq' applies to the weight-only schemes {GPTQ_SCHEMES}, not {self.scheme}")
        if self.smoothquant_alpha is not None and self.smoothquant_alpha != "auto" and (
                isinstance(self.smoothquant_alpha, str) or not 0.0 <= self.smoothquant_alpha <= 1.0):
            raise ValueError(f"smoothquant_alpha must be in [0, 1] or 'auto', got {self.smoothquant_alpha!r}")
        if self.clip_search and not self.static:
            raise ValueError("clip_search chooses static activation scales: it needs scheme='w8a8', static=True")
        sqnr = self.min_output_sqnr
        if sqnr is not None and (self.scheme != "w8a8" or isinstance(sqnr, bool)
                                 or not isinstance(sqnr, (int, float)) or math.isnan(sqnr)):
            raise ValueError(f"min_output_sqnr applies to the w8a8 scheme only and must be a number of dB, "
                             f"got {self.min_output_sqnr!r} for {self.scheme}")
        for field in ("skip", "include"):
            value = getattr(self, field)
            if isinstance(value, str):  # a lone pattern would otherwise be iterated per character
                value = (value,)
            object.__setattr__(self, field, tuple(value))

    @property
    def is_symmetric(self) -> bool:
        """int4 defaults to per-group zero points; every other scheme is symmetric only."""
        return self.symmetric if self.symmetric is not None else self.scheme != "int4"

    @property
    def fits_grid(self) -> bool:
        """Whether int4 round-to-nearest fits each group's grid (quant/int4_fit.py) instead of [min, max]."""
        return self.scheme == "int4" and self.algorithm == "rtn" and (self.grid or "fit") == "fit"

    def group_for(self, in_features: int) -> int | None:
        """The int4 group size for a layer of `in_features` inputs, or None when none fits."""
        sizes = (self.group_size,) if self.group_size is not None else sorted(GROUP_SIZES)
        return next((g for g in sizes if in_features % g == 0), None)

    @property
    def needs_calibration(self) -> bool:
        return (self.static or self.smoothquant_alpha is not None or self.algorithm == "gptq"
                or self.min_output_sqnr is not None)

    @property
    def searches(self) -> bool:
        """Whether w8a8 calibration measures candidate quantizations (quant/w8a8_search.py)."""
        return self.smoothquant_alpha == "auto" or self.clip_search or self.min_output_sqnr is not None

    def selects(self, name: str) -> bool:
        """Whether the module called `name` is to be quantized under this config."""
        return (any(fnmatchcase(name, p) for p in self.include)
                and not any(fnmatchcase(name, p) for p in self.skip))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["skip"], d["include"] = list(self.skip), list(self.include)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QuantConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown QuantConfig field(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


def select_linears(model, config: QuantConfig) -> dict:
    """{name: module} of the plain nn.Linear modules `config` selects (already-quantized modules are
    not nn.Linear; optimize()'s PromptLinear, prompt_linears.py, says it is one)."""
    from torch import nn

    def plain(m) -> bool:
        return type(m) is nn.Linear or getattr(type(m), "is_plain_linear", False)

    return {name: m for name, m in model.named_modules() if plain(m) and config.selects(name)}


def resolve_steps(config) -> list[QuantConfig]:
    """The configs `quantize` applies in order: one for a config, dict or scheme name; a preset's
    steps for a preset name (PRESETS); each element's for a list."""
    if isinstance(config, str) and config in PRESETS:
        return [QuantConfig.from_dict(step) for step in PRESETS[config]]
    if isinstance(config, (list, tuple)):
        return [step for item in config for step in resolve_steps(item)]
    return [resolve(config)]


def scheme_name_fields(name: str) -> dict:
    """QuantConfig fields named by a scheme name: {"scheme": name}, or for "int4-g<N>" the int4
    scheme with group size N."""
    scheme, sep, group = name.partition("-g")
    if sep and scheme == "int4" and group.isdigit():
        return {"scheme": "int4", "group_size": int(group)}
    return {"scheme": name}


def resolve(config) -> QuantConfig:
    """A QuantConfig from a QuantConfig, a dict of its fields, a scheme name ("int8", "int4",
    "w8a8", "fp8"; "int4-g32" etc. for a fixed int4 group size) meaning that scheme's defaults, or a
    one-step preset name ("int8-all")."""
    if isinstance(config, QuantConfig):
        return config
    if isinstance(config, str) and config in PRESETS:
        steps = resolve_steps(config)
        if len(steps) != 1:
            raise ValueError(f"preset {config!r} has {len(steps)} steps; only quantize() applies it "
                             "(pass one of its schemes here)")
        return steps[0]
    if isinstance(config, str):
        return QuantConfig(**scheme_name_fields(config))
    if isinstance(config, dict):
        return QuantConfig.from_dict(config)
    raise TypeError(f"expected a QuantConfig, a dict, a scheme name {SCHEMES} or a preset {tuple(PRESETS)}, "
                    f"got {type(config).__name__}")
