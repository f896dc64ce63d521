"""The pattern families: the one list that the pass manager runs, the backend's options validate,
the fusion report names and the tests enumerate.

Order matters: horizontal fusion first (it changes which linears feed the gates), then norms (the
residual-add fold needs the RMSNorm op in place), then activations, then rotary and decode
attention, then the CPU linears: single-row GEMVs first (decode_gemv), the rest pre-packed
(packed_linear).
"""
from __future__ import annotations

from importlib import import_module

# family -> (module of this package, its pass function `fn(gm, ctx) -> matches`), in run order.
FAMILIES = {
    "horizontal": ("horizontal", "horizontal_pass"),
    "rms_norm": ("norms", "rms_norm_pass"),
    "add_rms_norm": ("norms", "add_rms_norm_pass"),
    "layer_norm": ("norms", "layer_norm_pass"),
    "gated_act": ("activations", "gated_act_pass"),
    "gelu": ("activations", "gelu_pass"),
    "rotary": ("rotary", "rotary_pass"),
    "decode_attention": ("decode_attention", "decode_attention_pass"),
    "decode_gemv": ("decode_gemv", "decode_gemv_pass"),
    "packed_linear": ("packed_linear", "packed_linear_pass"),
}
PATTERN_FAMILIES = tuple(FAMILIES)


def pass_function(family: str):
    """The pass of `family`, looked up on its module at each call (so a test may replace it)."""
    module, name = FAMILIES[family]
    return getattr(import_module(f"{__package__}.{module}"), name)
