"""The pass manager: runs the enabled pattern families over a Dynamo graph, in the registry's
order (registry.py), built-in and registered (extension.py) alike. Each family runs on a
copy-on-failure basis: if a pass raises, the graph is restored to its state before that pass.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.fx as fx

from .fx_utils import fastflow_op_name, is_op
from .registry import pass_function, pattern_families

logger = logging.getLogger("ffl_backend")

class PassContext:
    """What passes may know about the graph beyond its nodes: the real input tensors."""

    def __init__(self, gm: fx.GraphModule, example_inputs, report, options):
        self.gm = gm
        self.report = report
        self.options = options
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.inputs = {n: t for n, t in zip(placeholders, example_inputs) if isinstance(t, torch.Tensor)}

    def tensor(self, node):
        """The real tensor behind a placeholder node (None for anything else)."""
        return self.inputs.get(node)

    def is_param(self, node) -> bool:
        return isinstance(self.tensor(node), torch.nn.Parameter)

    def is_vector_param(self, node) -> bool:
        t = self.tensor(node)
        return isinstance(t, torch.nn.Parameter) and t.dim() == 1

    def decline(self, family: str, node, why: str) -> None:
        self.report.declined[family] += 1
        self.report.reasons.append((family, getattr(node, "name", str(node)), why))


def run_passes(gm: fx.GraphModule, example_inputs, report, options) -> fx.GraphModule:
    """Apply each family in `options.patterns` (in the registry's order); fill `report.matches` / `fallbacks`."""
    if options.inductor and _needs_gradients(example_inputs):
        # fastflow's ops have no backward, and Inductor (AOT autograd) traces one for a graph whose
        # inputs need gradients: such a graph keeps its own ops
        logger.info("fastflow: graph %s needs gradients; pattern families skipped", report.graph_id)
        report.reasons.append(("all", "graph", "needs gradients (fastflow's ops have no backward)"))
        return gm
    ctx = PassContext(gm, example_inputs, report, options)
    for family in (f for f in pattern_families() if f in options.patterns):
        saved = _snapshot(gm.graph)
        try:
            report.matches[family] += pass_function(family)(gm, ctx)
            gm.graph.lint()
        except Exception as exc:  # a broken pattern must never break the user's model
            if options.on_error == "raise":
                raise
            logger.warning("fastflow: pattern family %r failed (%s: %s); graph left without it",
                           family, type(exc).__name__, exc)
            report.fallbacks[family] = f"{type(exc).__name__}: {exc}"
            report.matches[family] = 0
            gm.graph = saved
    gm.recompile()
    return gm


def _needs_gradients(example_inputs) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def _snapshot(graph: fx.Graph) -> fx.Graph:
    """A node-for-node copy (meta dicts shallow-copied, so fake tensors are shared, not cloned).

    Dynamo also tags each placeholder with a `_dynamo_source` attribute (not in meta) that AOT
    autograd asserts on; it is carried over too, or a restored graph would crash in Inductor."""
    copy = fx.Graph(owning_module=graph.owning_module)
    val_map: dict = {}
    out = copy.graph_copy(graph, val_map)
    copy.output(out)
    for old, new in val_map.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return copy


def fastflow_op_counts(gm: fx.GraphModule) -> Counter:
    """fastflow op name -> number of call sites in `gm` (overloads and overload packets alike:
    modules may call `torch.ops.fastflow.x(...)` as well as `.default`)."""
    return Counter(name for node in gm.graph.nodes if (name := fastflow_op_name(node)))


# Ops that every matched family removes: any left in a final graph is math fastflow did not fuse.
ANCHORS = ("rsqrt", "layer_norm", "silu", "gelu", "tanh")


def unfused_anchor_counts(gm: fx.GraphModule) -> Counter:
    """How many anchor ops (rsqrt, silu, ...) remain in `gm`: zero when every site was fused."""
    return Counter(name for node in gm.graph.nodes for name in ANCHORS if is_op(node, name))
