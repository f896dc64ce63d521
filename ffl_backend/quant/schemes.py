"""Quantization configs: one frozen dataclass per scheme, validated on construction, serializable to JSON.

`QuantConfig` is the base of every scheme's config and, called itself, a factory:
`QuantConfig("int4", group_size=32)` returns `Int4Config(group_size=32)`. So the calls and the saved
dicts of the single config every scheme once shared keep working. A scheme's config holds only its own
fields and checks; what the scheme does lives in its handler (quant/handlers.py), and
`handlers.register_scheme` registers the two together.
"""
from __future__ import annotations

import dataclasses
import math
from fnmatch import fnmatchcase
from typing import ClassVar

GROUP_SIZES = (32, 64, 128)
# How weights are rounded: "rtn" (round to nearest) or "gptq" (Hessian-aware, quant/gptq.py), which
# needs calibration data and applies to the weight-only schemes.
ALGORITHMS = ("rtn", "gptq")
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
# 22 dB floor (on SmolLM2 well below plain "w8a8"'s perplexity loss). Quality and speed of each:
# docs/quantization.md.
PRESETS = {
    "int8-all": [{"scheme": "int8", "skip": ()}],
    "int4-all": [{"scheme": "int4", "group_size": 32}, {"scheme": "int8", "include": DEFAULT_SKIP, "skip": ()}],
    "w8a8-static": [{"scheme": "w8a8", "static": True, "smoothquant_alpha": "auto", "clip_search": True,
                     "min_output_sqnr": 22.0}],
    "w8a8-smooth": [{"scheme": "w8a8", "smoothquant_alpha": "auto", "min_output_sqnr": 22.0}],
}


# The fields of the single config every scheme shared before per-scheme configs, in its order (for
# positional arguments after the scheme: QuantConfig("int4", 32)), each with the values that meant
# "not used" for a scheme without that field: dicts saved then carry every field, so a scheme's config
# accepts a field of another scheme at these values and drops it (skip and include: every scheme's).
LEGACY_FIELDS = {"group_size": (None,), "symmetric": (None, True), "grid": (None,), "static": (False,),
                 "static_range_limit": (8.0,), "smoothquant_alpha": (None,), "skip": (), "include": (),
                 "algorithm": ("rtn",), "clip_search": (False,), "min_output_sqnr": (None,)}

_CONFIGS: dict[str, type] = {}  # scheme name -> its config class (register_config)


class _BuildsByScheme(type):
    """Calling QuantConfig itself builds the config of the scheme it names; a scheme's own config
    class builds itself."""

    def __call__(cls, *args, **fields):
        if cls is QuantConfig:
            return _build(*args, **fields)
        return super().__call__(*args, **fields)


@dataclasses.dataclass(frozen=True)
class QuantConfig(metaclass=_BuildsByScheme):
    """What to quantize, and how: the base of every scheme's config, with the fields all schemes have.

    skip, include  fnmatch patterns on module names (e.g. "model.layers.0.*"); a linear is quantized
                   when it matches some `include` pattern and no `skip` pattern.

    `QuantConfig(scheme, **fields)` is the config of that scheme: Int8Config ("int8", weight-only, per
    output channel), Int4Config ("int4", weight-only, group-wise), W8A8Config ("w8a8", int8 weights and
    activations), Fp8Config ("fp8", e4m3 weights and activations), or one registered by
    `handlers.register_scheme`. Each documents its own fields.
    """

    scheme: ClassVar[str] = ""
    # The ffl-eval-ppl / ffl-quant-report options that set this scheme's fields: (flag, field, argparse
    # keyword arguments) each (quant/cli.py adds them; the argparse default is the field's default).
    cli_options: ClassVar[tuple] = ()

    skip: tuple = DEFAULT_SKIP
    include: tuple = ("*",)

    def __post_init__(self):
        for field in ("skip", "include"):
            value = getattr(self, field)
            if isinstance(value, str):  # a lone pattern would otherwise be iterated per character
                value = (value,)
            object.__setattr__(self, field, tuple(value))

    @property
    def needs_calibration(self) -> bool:
        """Whether quantizing under this config needs calibration_data."""
        return False

    def keep_reason(self, linear) -> str | None:
        """Why `linear` must stay in high precision under this config, or None."""
        return None

    @classmethod
    def name_fields(cls, suffix: str) -> dict | None:
        """The fields a scheme name "<scheme>-<suffix>" stands for ("int4-g32"), or None."""
        return None

    def selects(self, name: str) -> bool:
        """Whether the module called `name` is to be quantized under this config."""
        return (any(fnmatchcase(name, p) for p in self.include)
                and not any(fnmatchcase(name, p) for p in self.skip))

    def to_dict(self) -> dict:
        d = {"scheme": self.scheme, **dataclasses.asdict(self)}
        d["skip"], d["include"] = list(self.skip), list(self.include)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> QuantConfig:
        """The config a `to_dict()` dict describes (also one the single former config wrote)."""
        return QuantConfig(**{"scheme": cls.scheme, **d}) if cls.scheme else QuantConfig(**d)


def register_config(cls: type) -> type:
    """Make `cls`, a QuantConfig subclass naming its `scheme`, what QuantConfig(cls.scheme, ...) builds
    (a class decorator). A scheme also needs a handler: `handlers.register_scheme` registers both."""
    if not (isinstance(cls, type) and issubclass(cls, QuantConfig) and cls.scheme):
        raise ValueError(f"{cls.__name__} must subclass QuantConfig and name its `scheme`")
    if _CONFIGS.get(cls.scheme, cls) is not cls:
        raise ValueError(f"scheme {cls.scheme!r} is already {_CONFIGS[cls.scheme].__name__}'s")
    _CONFIGS[cls.scheme] = cls
    return cls


def forget_config(scheme: str) -> None:
    """Undo register_config (handlers.unregister_scheme)."""
    _CONFIGS.pop(scheme, None)


def registered_schemes() -> tuple[str, ...]:
    return tuple(_CONFIGS)


def config_class(scheme: str) -> type:
    """The config class of a registered scheme name."""
    if not isinstance(scheme, str) or scheme not in _CONFIGS:
        raise ValueError(f"unknown quantization scheme {scheme!r}; registered: {registered_schemes()}")
    return _CONFIGS[scheme]


def _build(scheme: str = "int8", *args, **fields) -> QuantConfig:
    """QuantConfig(scheme, ...): the scheme's config of `fields`, dropping the former shared config's
    fields this scheme lacks where they hold their "not used" values (LEGACY_FIELDS)."""
    if len(args) > len(LEGACY_FIELDS):
        raise TypeError(f"QuantConfig takes at most {len(LEGACY_FIELDS) + 1} positional arguments")
    for name, value in zip(LEGACY_FIELDS, args):
        if name in fields:
            raise TypeError(f"QuantConfig got multiple values for {name!r}")
        fields[name] = value
    cls = config_class(scheme)
    own = {f.name for f in dataclasses.fields(cls)}
    owners = {name: [s for s, c in _CONFIGS.items() if name in {f.name for f in dataclasses.fields(c)}]
              for name in set(fields) - own}
    unknown = sorted(name for name, schemes in owners.items() if not schemes and name not in LEGACY_FIELDS)
    if unknown:
        known = sorted({f.name for c in _CONFIGS.values() for f in dataclasses.fields(c)} | {"scheme"})
        raise ValueError(f"unknown QuantConfig field(s) {unknown}; known: {known}")
    for name in owners:
        value = fields.pop(name)
        if value not in LEGACY_FIELDS.get(name, ()):
            where = "/".join(owners[name]) + (" schemes" if len(owners[name]) > 1 else " scheme")
            raise ValueError(f"{name} applies to the {where} only, not {scheme} (got {name}={value!r}); "
                             f"{cls.__name__} has {sorted(own)}")
    return cls(**fields)


@dataclasses.dataclass(frozen=True)
class WeightOnlyConfig(QuantConfig):
    """Base of the weight-only schemes, whose weights GPTQ can round (handlers.WeightOnlyHandler).

    algorithm      "rtn" (default): round each weight to the nearest grid point. "gptq": GPTQ, which
                   rounds column by column and moves each column's error onto the columns not yet
                   rounded, weighted by the layer's input statistics from calibration data (required).
                   Same stored layout and kernels as "rtn".
    """

    algorithm: str = "rtn"

    def __post_init__(self):
        super().__post_init__()
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; choose one of {ALGORITHMS}")

    @property
    def needs_calibration(self) -> bool:
        return self.algorithm == "gptq"


@register_config
@dataclasses.dataclass(frozen=True)
class Int8Config(WeightOnlyConfig):
    """int8 weights, one scale per output channel. The one scheme that also quantizes the embeddings
    it selects (skip=(): a tied embedding and lm_head share one int8 table)."""

    scheme = "int8"


@register_config
@dataclasses.dataclass(frozen=True)
class Int4Config(WeightOnlyConfig):
    """int4 weights in groups of input channels, a scale and a zero point per group.

    group_size     32, 64 or 128 input channels per scale; a layer whose in_features it does not divide
                   stays in high precision (logged). None (default): per layer, the smallest of 32, 64,
                   128 that divides its in_features -- 32 for nearly every model, llama.cpp's Q4 group.
                   Larger groups cost quality the smaller scales do not save in speed (SmolLM2's
                   perplexities per group size: docs/quantization.md). Scheme name "int4-g<N>": group N.
    symmetric      True = zero point fixed at 8; False (default) = per-group zero point.
    grid           round-to-nearest only: "fit" (default) = each group's scale and zero point of least
                   squared error, weighted by the input channels' mean squares on calibration data when
                   it is given, else by the weights' own squares (quant/int4_fit.py; Gemma-3 perplexity
                   with and without data against "minmax": docs/quantization.md); "minmax" = the group's
                   [min, max]. GPTQ chooses its own grid per group as it goes ([min, max]).
    """

    scheme = "int4"
    cli_options = (
        ("--group-size", "group_size", dict(
            type=int, default=None,
            help="int4 group size (default: 32, else the smallest of 64/128 that fits; or int4-g64)")),
        ("--int4-grid", "grid", dict(
            choices=INT4_GRIDS, default=None,
            help="int4 schemes (not presets): 'fit' (default: least weighted error) or 'minmax'")),
    )

    group_size: int | None = None
    symmetric: bool | None = None
    grid: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, got {self.group_size}")
        if self.grid is not None and self.grid not in INT4_GRIDS:
            raise ValueError(f"int4 grid must be one of {INT4_GRIDS}, got {self.grid!r}")

    @property
    def is_symmetric(self) -> bool:
        return bool(self.symmetric)

    @property
    def fits_grid(self) -> bool:
        """Whether round-to-nearest fits each group's grid (quant/int4_fit.py) instead of [min, max]."""
        return self.algorithm == "rtn" and (self.grid or "fit") == "fit"

    def group_for(self, in_features: int) -> int | None:
        """The group size for a layer of `in_features` inputs, or None when none fits."""
        sizes = (self.group_size,) if self.group_size is not None else sorted(GROUP_SIZES)
        return next((g for g in sizes if in_features % g == 0), None)

    def keep_reason(self, linear) -> str | None:
        if self.group_for(linear.in_features) is None:
            sizes = self.group_size or "of 32/64/128"
            return f"group_size {sizes} does not divide in_features {linear.in_features}"
        return None

    @classmethod
    def name_fields(cls, suffix: str) -> dict | None:
        return {"group_size": int(suffix[1:])} if suffix[:1] == "g" and suffix[1:].isdigit() else None


def _alpha(text: str):
    return text if text == "auto" else float(text)


@register_config
@dataclasses.dataclass(frozen=True)
class W8A8Config(QuantConfig):
    """int8 weights (per output channel) and int8 activations.

    static         one activation scale per layer from calibration data (True) or one per token at run
                   time (False, the default).
    static_range_limit  static: a layer whose largest calibration token exceeds its 99th-percentile
                   token by more than this factor keeps per-token scales (logged); inf = never.
    smoothquant_alpha  SmoothQuant migration strength in [0, 1], or None (no smoothing), or "auto": per
                   input group, the alpha of least output error on calibration data (quant/w8a8_search.py).
    clip_search    static: each layer's static activation scale is clip_ratio * calibration absmax, the
                   ratio searched for the least output error on calibration data (False: absmax).
    min_output_sqnr  a layer whose output SQNR (dB) on calibration data, quantized as finally chosen, is
                   below this stays in high precision (logged, listed in _ffl_quant["kept"]).
    """

    scheme = "w8a8"
    cli_options = (
        ("--static", "static", dict(action="store_true", help="w8a8: static activation scales from calibration")),
        ("--alpha", "smoothquant_alpha", dict(
            type=_alpha, default=None,
            help="w8a8: SmoothQuant alpha, or 'auto' (per input group, least output error)")),
        ("--clip-search", "clip_search", dict(
            action="store_true",
            help="w8a8 static: search each layer's static scale (clip ratio x absmax) for least output error")),
        ("--min-output-sqnr", "min_output_sqnr", dict(
            type=float, default=None,
            help="w8a8: keep layers whose calibration output SQNR (dB) is below this in high precision")),
        ("--static-range-limit", "static_range_limit", dict(
            type=float, default=8.0,
            help="w8a8 static: token range ratio above which a layer keeps per-token scales")),
    )

    static: bool = False
    static_range_limit: float = 8.0
    smoothquant_alpha: float | str | None = None
    clip_search: bool = False
    min_output_sqnr: float | None = None

    def __post_init__(self):
        super().__post_init__()
        alpha = self.smoothquant_alpha
        if alpha is not None and alpha != "auto" and (isinstance(alpha, str) or not 0.0 <= alpha <= 1.0):
            raise ValueError(f"smoothquant_alpha must be in [0, 1] or 'auto', got {alpha!r}")
        if self.clip_search and not self.static:
            raise ValueError("clip_search chooses static activation scales: it needs static=True")
        sqnr = self.min_output_sqnr
        if sqnr is not None and (isinstance(sqnr, bool) or not isinstance(sqnr, (int, float)) or math.isnan(sqnr)):
            raise ValueError(f"min_output_sqnr must be a number of dB, got {sqnr!r}")

    @property
    def needs_calibration(self) -> bool:
        return self.static or self.smoothquant_alpha is not None or self.min_output_sqnr is not None

    @property
    def searches(self) -> bool:
        """Whether calibration measures candidate quantizations (quant/w8a8_search.py)."""
        return self.smoothquant_alpha == "auto" or self.clip_search or self.min_output_sqnr is not None


@register_config
@dataclasses.dataclass(frozen=True)
class Fp8Config(QuantConfig):
    """e4m3 weights (a scale per output channel) and activations; its kernels need a Hopper GPU (sm_90)
    on CUDA."""

    scheme = "fp8"


# The built-in schemes (register_scheme adds more; registered_schemes() lists them all).
SCHEMES = registered_schemes()


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
    """QuantConfig fields named by a scheme name: {"scheme": name} for a registered scheme, else for
    "<scheme>-<suffix>" what that scheme's `name_fields(suffix)` gives ("int4-g32": group size 32)."""
    base, _, suffix = name.partition("-")
    fields = None if name in _CONFIGS or base not in _CONFIGS else _CONFIGS[base].name_fields(suffix)
    return {"scheme": base, **fields} if fields is not None else {"scheme": name}


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
    raise TypeError(f"expected a QuantConfig, a dict, a scheme name {registered_schemes()} or a preset "
                    f"{tuple(PRESETS)}, "
                    f"got {type(config).__name__}")
