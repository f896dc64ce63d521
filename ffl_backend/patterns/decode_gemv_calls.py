"""Single-row CPU linears -> `fastflow_cpu::gemv` calls, siblings that read one row grouped into one call
(int8 weights: `gemv_q16` instead where the option int8_activations is "int16").

decode_gemv decides which linears take the hand-written kernel (kernels/cpu_gemv.py, fastflow_cpu::gemv) and hands them
here as `KernelGemv` records; `emit_kernel_calls` rewrites them. Linears reading the same activation
node with the same weight dtype and the same operands present (scale, bias) become one call, placed
at the first of them: q/k/v (3 calls -> 1) and gate/up (2 -> 1) of an int8 Llama layer; the call
returns the outputs concatenated and each member reads its slice (a view). Their weights
stay separate tensors -- the kernel walks a list -- so grouping costs no fused copy of the weights.
Weights, scales and biases are graph inputs or constants (get_attr nodes, hoisted above the call when
a later member's constant sits below the first member), so moving a member's call up to the first
member's position never reads a value before it exists.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Optional

import torch
import torch.fx as fx

from . import fx_utils as U


@dataclasses.dataclass
class KernelGemv:
    node: fx.Node              # the linear (or fastflow.int8_linear) call being replaced
    x: fx.Node                 # the single activation row
    weight: fx.Node            # (N, K) int8 or bf16
    weight_dtype: torch.dtype
    rows: int                  # N
    scale: Optional[fx.Node]   # (N,) per-output-channel scale (int8) or None
    bias: Optional[fx.Node]    # (N,) or None


def _group_key(g: KernelGemv):
    return g.x, g.weight_dtype, g.scale is None, g.bias is None


def _hoist_constants(graph: fx.Graph, nodes: list, before: fx.Node) -> None:
    """Move get_attr nodes that come after `before` up to just before it (they read no other node)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in nodes:
        if isinstance(node, fx.Node) and node.op == "get_attr" and order[node] > order[before]:
            before.prepend(node)


def _emit_group(graph: fx.Graph, members: list, int8_op) -> None:
    first = members[0].node
    scales = [m.scale for m in members] if members[0].scale is not None else []
    biases = [m.bias for m in members] if members[0].bias is not None else []
    args = (members[0].x, [m.weight for m in members], scales, biases)
    _hoist_constants(graph, [*args[1], *scales, *biases], first)
    with graph.inserting_before(first):
        op = int8_op if members[0].weight_dtype == torch.int8 else torch.ops.fastflow_cpu.gemv.default
        call = graph.call_function(op, args)
        items, start = [], 0
        for m in members:  # each member's output: its slice of the concatenated result
            items.append(call if len(members) == 1 else graph.call_function(torch.narrow, (call, -1, start, m.rows)))
            start += m.rows
    for member, item in zip(members, items):
        U.copy_meta(item, member.node)
        member.node.replace_all_uses_with(item)
    U.erase_dead(graph, [m.node for m in members])


def emit_kernel_calls(gm: fx.GraphModule, gemvs: list, int8_activations: str = "float") -> None:
    """Replace `gemvs` (in graph order) by grouped kernel calls; int8 weights call `gemv_q16` when
    `int8_activations` (the backend option) is "int16"."""
    if not gemvs:  # nothing to emit, and the library may not be loaded: its ops are not registered
        return
    ops = torch.ops.fastflow_cpu
    int8_op = ops.gemv_q16.default if int8_activations == "int16" else ops.gemv.default
    groups = defaultdict(list)
    for g in gemvs:
        groups[_group_key(g)].append(g)
    for members in groups.values():
        _emit_group(gm.graph, members, int8_op)

