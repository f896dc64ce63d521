"""The pattern families: the one list that the pass manager runs, the backend's options validate,
the fusion report names and the tests enumerate.

Built-in order matters: horizontal fusion first (it changes which linears feed the gates), then norms
(the residual-add fold needs the RMSNorm op in place), then activations, then rotary and decode
attention written out (inline_sdpa), then the CPU linears: single-row GEMVs first (decode_gemv), the rest pre-packed
(packed_linear).

Families registered at run time (extension.py, `ffl_backend.register_pattern`) join the same
namespace: after the built-ins, or right before/after a family they name -- a built-in or one
registered earlier, so the order is always defined (no cycles) -- in registration order.
"""
from __future__ import annotations

import logging
from importlib import import_module
from itertools import takewhile
from typing import Callable, NamedTuple

logger = logging.getLogger("ffl_backend")

# family -> (module of this package, its pass function `fn(gm, ctx) -> matches`), in run order.
FAMILIES = {
    "horizontal": ("horizontal", "horizontal_pass"),
    "rms_norm": ("norms", "rms_norm_pass"),
    "add_rms_norm": ("norms", "add_rms_norm_pass"),
    "layer_norm": ("norms", "layer_norm_pass"),
    "gated_act": ("activations", "gated_act_pass"),
    "gelu": ("activations", "gelu_pass"),
    "rotary": ("rotary", "rotary_pass"),
    "inline_sdpa": ("inline_sdpa", "inline_sdpa_pass"),
    "decode_gemv": ("decode_gemv", "decode_gemv_pass"),
    "packed_linear": ("packed_linear", "packed_linear_pass"),
}
# The built-in families, in run order (registered ones are in pattern_families()).
PATTERN_FAMILIES = tuple(FAMILIES)
# Former names of built-in families, still accepted wherever a family is named (with a warning).
RENAMED = {"decode_attention": "inline_sdpa"}


class Registered(NamedTuple):
    """A family added at run time: its pass and where it runs (`before` or `after` another family)."""

    pass_fn: Callable
    before: str | None
    after: str | None


# Registered families in registration order (dicts keep it), which breaks ties in placement.
_registered: dict[str, Registered] = {}


def pattern_families() -> tuple:
    """Every family, built-in and registered, in the order the pass manager runs them."""
    order = list(PATTERN_FAMILIES)
    for name, entry in _registered.items():
        if entry.before is not None:
            order.insert(order.index(entry.before), name)
        elif entry.after is not None:
            # after `after` and after families registered earlier at the same place (registration order)
            at = order.index(entry.after) + 1
            while at < len(order) and order[at] in _registered and _registered[order[at]].after == entry.after:
                at += 1
            order.insert(at, name)
        else:
            order.append(name)
    return tuple(order)


def registered_families() -> tuple:
    """The names of the families registered at run time, oldest first."""
    return tuple(_registered)


def current_name(name):
    """A family's name, with a former name (RENAMED) replaced by its current one and a warning."""
    if name in RENAMED:
        logger.warning("fastflow: pattern family %r is now called %r", name, RENAMED[name])
        return RENAMED[name]
    return name


def unknown_families(names) -> list:
    """The names in `names` that are no family (sorted), for the options' error message."""
    return sorted(set(names) - set(pattern_families()))


def add_family(name: str, pass_fn: Callable, *, before: str | None = None, after: str | None = None,
               replace: bool = False) -> None:
    """Register `pass_fn(gm, ctx) -> matches` as family `name`, validated before anything changes."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"fastflow: a pattern family name must be an identifier, got {name!r}")
    if name in FAMILIES:
        raise ValueError(f"fastflow: {name!r} is a built-in pattern family; pick another name")
    if name in _registered and not replace:
        raise ValueError(f"fastflow: pattern family {name!r} is already registered (replace=True to redefine it)")
    if before is not None and after is not None:
        raise ValueError("fastflow: give `before` or `after`, not both")
    before, after = current_name(before), current_name(after)
    place = before if before is not None else after
    earlier = [*PATTERN_FAMILIES, *takewhile(lambda f: f != name, _registered)]
    if place is not None and place not in earlier:
        raise ValueError(f"fastflow: {name!r} can run next to a built-in or an earlier registered family, "
                         f"not {place!r}; those are: {earlier}")
    _registered[name] = Registered(pass_fn, before, after)  # a replaced family keeps its registration rank


def remove_family(name: str) -> None:
    """Forget the registered family `name`. One that others are placed next to stays until they go."""
    if name in FAMILIES:
        raise ValueError(f"fastflow: {name!r} is a built-in pattern family; disable it with disable_patterns")
    if name not in _registered:
        raise ValueError(f"fastflow: no registered pattern family {name!r}; registered: {registered_families()}")
    placed = [f for f, e in _registered.items() if name in (e.before, e.after)]
    if placed:
        raise ValueError(f"fastflow: families {placed} are placed next to {name!r}; unregister them first")
    del _registered[name]


def pass_function(family: str):
    """The pass of `family`. A built-in's is looked up on its module at each call (so a test may
    replace it)."""
    if family in _registered:
        return _registered[family].pass_fn
    module, name = FAMILIES[family]
    return getattr(import_module(f"{__package__}.{module}"), name)
