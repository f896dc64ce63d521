"""Users' pattern families: `ffl_backend.register_pattern` rewrites every subgraph of a Dynamo graph
that computes `pattern(...)` into `replacement(...)`, typically a call of an op made with
`ffl_backend.register_op` (kernels/user_ops.py).

Matching is torch.fx's subgraph rewriter on the Dynamo (torch-level) graph: both functions are
traced with torch.fx (`trace`), and a site matches when it calls the same functions and methods
with the same literals, spelled and wired the same way. A registered family is a family like the
built-ins (registry.py): it runs in the pass manager's order, `patterns=`/`disable_patterns=` name it,
the fusion report counts its matches and declines, and a pass that raises falls back the same way.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Callable

import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

from . import fx_utils as U
from .registry import add_family, remove_family


@dataclasses.dataclass(frozen=True)
class PatternMatch:
    """One site a registered pattern matched, as its `check` sees it.

    family: the family's name
    inputs: the pattern function's argument name -> the graph node (or literal) bound to it
    nodes:  the graph nodes the rewrite replaces, in pattern order
    ctx:    the pass context (`ctx.tensor(node)`: the real tensor of a graph input; `ctx.options`)
    """

    family: str
    inputs: dict
    nodes: tuple
    ctx: object

    def value(self, name: str):
        """The fake tensor Dynamo recorded for input `name` (shape, dtype, device), or None."""
        return U.value(self.inputs[name])

    def tensor(self, name: str):
        """The real tensor behind input `name` when it is a graph input (a parameter, a buffer or an
        argument), else None."""
        node = self.inputs[name]
        return self.ctx.tensor(node) if isinstance(node, fx.Node) else None


class PatternFamily:
    """The pass of one registered family: `family(gm, ctx) -> number of sites rewritten`."""

    def __init__(self, name: str, pattern_graph: fx.Graph, replacement: Callable, anchor, check):
        self.name, self.pattern_graph, self.replacement = name, pattern_graph, replacement
        self.anchor, self.check = anchor, check

    def __call__(self, gm: fx.GraphModule, ctx) -> int:
        if self.anchor is not None and not any(_is_anchor(n, self.anchor) for n in gm.graph.nodes):
            return 0  # the cheap skip: no graph without the anchor can hold a match
        filters = [] if self.check is None else [lambda match, *_: self._accepts(match, ctx)]
        # the replacement is traced here, not at registration: it may call an op registered later,
        # and a replacement that fails to trace falls back like any pass that raises
        replaced = replace_pattern_with_filters(gm, self.pattern_graph, trace(self.replacement), match_filters=filters)
        for site in replaced:
            _record_values(site.replacements)
        return len(replaced)

    def _accepts(self, match, ctx) -> bool:
        """Run the user's check on one match; a decline is counted in the report with its reason."""
        placeholders = [n for n in self.pattern_graph.nodes if n.op == "placeholder"]
        inner = [n for n in self.pattern_graph.nodes if n.op not in ("placeholder", "output")]
        site = PatternMatch(self.name, {p.target: match.nodes_map[p] for p in placeholders},
                            tuple(match.nodes_map[n] for n in inner), ctx)
        verdict = self.check(site)
        if isinstance(verdict, str) or not verdict:
            why = verdict if isinstance(verdict, str) else f"check {getattr(self.check, '__name__', 'check')} declined"
            ctx.decline(self.name, match.returning_nodes[0], why)
            return False
        return True


def register_pattern(name: str, pattern: Callable, replacement: Callable, *, anchor=None,
                     check: Callable | None = None, before: str | None = None, after: str | None = None,
                     replace: bool = False) -> None:
    """Add pattern family `name`: every subgraph of a graph compiled afterwards that computes
    `pattern(*inputs)` is replaced by `replacement(*inputs)` (docs/extending.md).

    pattern, replacement: plain torch functions taking the same arguments (tensors the subgraph
                reads); spell the pattern as the model does (`torch.sigmoid(x)` and `x.sigmoid()`
                are different graph nodes).
    anchor:     a function or op (matched by identity), or a name (a function, op or method of that
                name): graphs without one skip the family without matching.
    check:      `check(PatternMatch) -> bool | str`, run on each match before it is rewritten: True
                rewrites; False, or a string saying why, declines (counted in the report).
    before/after: run right before/after that family (a built-in or an earlier registered one);
                default: after every family registered so far.
    replace:    redefine a family of this name registered earlier (else that is an error).
    """
    for role, fn in (("pattern", pattern), ("replacement", replacement), ("check", check)):
        if fn is not None and not callable(fn):
            raise TypeError(f"fastflow: register_pattern {name!r}: {role} must be callable, got {type(fn).__name__}")
    if anchor is not None and not (isinstance(anchor, str) or callable(anchor)):
        raise TypeError(f"fastflow: register_pattern {name!r}: anchor must be a name or a function/op")
    _check_arity(name, pattern, replacement)
    try:  # traced once, here: a pattern that cannot be traced is a registration error, not a fallback
        pattern_graph = trace(pattern)
    except Exception as exc:
        raise ValueError(f"fastflow: pattern of {name!r} does not trace with torch.fx: {exc}") from exc
    add_family(name, PatternFamily(name, pattern_graph, replacement, anchor, check), before=before, after=after,
               replace=replace)


def unregister_pattern(name: str) -> None:
    """Remove the registered family `name` (graphs compiled with it keep their rewrites)."""
    remove_family(name)


def trace(fn: Callable) -> fx.Graph:
    """`fn`'s graph as Dynamo records the same code: calls of torch.nn.functional (and math) kept as
    written. Plain symbolic tracing records them with every default filled in (`F.silu(x)` becomes
    `F.silu(x, inplace=False)`), which would never match the node Dynamo made of `F.silu(x)`."""
    return fx.Tracer(autowrap_modules=(math, F)).trace(fn)


def _check_arity(name: str, pattern: Callable, replacement: Callable) -> None:
    """The rewriter binds the replacement's arguments to the pattern's, one for one."""
    counts = [len(inspect.signature(fn).parameters) for fn in (pattern, replacement)]
    if counts[0] != counts[1]:
        raise ValueError(f"fastflow: register_pattern {name!r}: pattern takes {counts[0]} arguments, "
                         f"replacement {counts[1]}; they must take the same inputs")


def _is_anchor(node: fx.Node, anchor) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    if isinstance(anchor, str):
        return anchor in (node.target, getattr(node.target, "__name__", None))
    return node.target is anchor or getattr(node.target, "overloadpacket", None) is anchor


def _record_values(nodes) -> None:
    """Give each node a replacement inserted the example value (a fake tensor) Dynamo records on its
    own nodes: families that run later read shapes and dtypes from it (fx_utils.value). Running the
    replacement's ops on fake tensors also surfaces a broken op (no fake implementation, wrong
    arguments) inside the pass, where it falls back, instead of in Inductor."""
    for node in nodes:  # in graph order: each node's inputs have values before it
        if node.op not in ("call_function", "call_method") or any(U.value(n) is None for n in node.all_input_nodes):
            continue  # not an op, or an input without a value to compute from
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), U.value)
        # the mode Dynamo made these values in (the backend's tracing context may hold another)
        fake_mode = next((v.fake_mode for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, FakeTensor)), None)
        if fake_mode is None:
            continue
        fn = node.target if node.op == "call_function" else getattr(type(args[0]), node.target)
        with fake_mode:
            node.meta["example_value"] = fn(*args, **kwargs)
