"""CPU linear family: parameter linears in bf16/fp16 -> `fastflow.packed_linear` (pre-packed oneDNN
weights; see ffl_backend/kernels/packed_linear.py for why). Runs after horizontal fusion, so fused
q/k/v and gate/up weights are packed as one. Weights are packed here, at compile time."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from ..kernels.packed_linear import can_pack, prepack
from . import fx_utils as U


def _weight_tensor(node, ctx):
    """The real tensor behind a weight argument: a parameter placeholder or a fused-weight buffer."""
    if isinstance(node, fx.Node) and node.op == "get_attr":
        t = getattr(ctx.gm, node.target, None)
        return t if isinstance(t, torch.Tensor) else None
    t = ctx.tensor(node)
    return t if isinstance(t, torch.nn.Parameter) else None


def packed_linear_pass(gm: fx.GraphModule, ctx) -> int:
    graph, count = gm.graph, 0
    for node in [n for n in graph.nodes if U.is_op(n, "linear")]:
        x, w_node, b_node = node.args[0], U.arg(node, 1, "weight"), U.arg(node, 2, "bias")
        w = _weight_tensor(w_node, ctx)
        xv = U.value(x)
        if w is None or not can_pack(w) or xv is None or xv.dtype != w.dtype:
            if w is not None and w.device.type == "cpu":
                ctx.decline("packed_linear", node, "weight is not a packable bf16/fp16 CPU parameter")
            continue
        if b_node is not None and not isinstance(_weight_tensor(b_node, ctx), torch.Tensor):
            ctx.decline("packed_linear", node, "bias is not a parameter")
            continue
        # A dynamic row count (a prompt's sequence dim) packs for the traced example's rows: reading it
        # through a hint adds no guard, where int() would specialize the graph to that one length.
        rows = 1 if xv.dim() < 2 else optimization_hint(xv.numel() // max(1, xv.shape[-1]), fallback=16)
        prepack(w, rows)
        new = U.copy_meta(U.call_op(graph, torch.ops.fastflow.packed_linear.default, (x, w_node, b_node), node), node)
        node.replace_all_uses_with(new)
        U.erase_dead(graph, [node])
        count += 1
    return count
