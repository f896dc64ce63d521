"""Horizontal fusion for int4 linears on CPU: siblings reading one input become one packed GEMM.

An int4 model's decode step calls torch's `_weight_int4pack_mm_for_cpu` once per linear: 7 per
Llama layer. At batch 1 each call is a few microseconds of fixed cost (the compiled wrapper's Python
line, the dispatcher, a thread fork/join) on ~20 us of work, so q/k/v and gate/up -- linears that
read the same activation -- are fused into one call each, as `horizontal` does for dense linears:
7 calls per layer become 4 (SmolLM2 int4-all decode: 104 -> 113 tok/s, measured in one process).
int8 linears are left alone: their decode GEMVs are Inductor loops (decode_gemv), where fusing
measured no gain and would cost a fused copy of the weights.

The fused weight is packed afresh from the concatenated portable form (codes, scales, zeros):
torch's CPU packing blocks rows in 64s, so concatenating packed tensors is wrong unless every
member but the last has a multiple of 64 rows (tests/patterns/test_int4_siblings.py). It is a
compile-time constant made once per set of weights (weight_cache), like the dense fused weights:
changing weights after compiling needs `torch._dynamo.reset()`.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx
from torch import Tensor

from ..kernels import weight_cache
from ..kernels.quant_linear import int4_cpu_linear, int4_cpu_pack
from . import fx_utils as U

FUSED_PREFIX = "_fastflow_int4_fused"


def _member(node: fx.Node, ctx):
    """(input, group size, (qweight, scale, zero), bias) of an int4 linear on CPU module buffers that
    runs torch's packed kernel, or None (no CPU packed form: the op runs its reference, left as is)."""
    if U.fastflow_op_name(node) != "int4_linear":
        return None
    group_size = U.arg(node, 4, "group_size")
    portable = tuple(ctx.tensor(U.arg(node, i)) for i in (1, 2, 3))
    b_node = U.arg(node, 5, "bias")
    bias = ctx.tensor(b_node) if b_node is not None else None
    if (any(t is None for t in portable) or (b_node is not None and bias is None) or not isinstance(group_size, int)
            or ctx.tensor(U.arg(node, 6, "cpu_packed")) is None or portable[0].device.type != "cpu"):
        return None
    return node.args[0], group_size, portable, bias


def _key(kind: str, tensors: list) -> str:
    """A weight_cache kind naming every member beyond the first (the entry is keyed on that one)."""
    return kind + ":" + ",".join(f"{t.data_ptr()}/{t._version}" for t in tensors[1:])


def _fused_pack(portables: list, group_size: int):
    """torch's CPU form (packed, scale_zeros) of the row-concatenated weights, or (None, None)."""
    def make(_):
        q, s, z = (torch.cat([p[i] for p in portables]) for i in range(3))
        return int4_cpu_pack(q, s, z, group_size)
    return weight_cache.derived(_key("int4_siblings", [p[0] for p in portables]), portables[0][0], make)


def _constant(gm: fx.GraphModule, tensor: Tensor) -> fx.Node:
    return gm.graph.get_attr(U.attach_constant(gm, tensor, FUSED_PREFIX))


def fuse_int4_siblings(gm: fx.GraphModule, ctx) -> int:
    """Fuse every group of >= 2 CPU int4 linears with the same input, group size and bias-ness."""
    graph = gm.graph
    groups = defaultdict(list)
    for node in graph.nodes:
        found = _member(node, ctx)
        if found is not None:
            x, group_size, portable, bias = found
            groups[(x, group_size, portable[0].shape[1], bias is not None)].append((node, portable, bias))
    count = 0
    for (x, group_size, *_), members in groups.items():
        if len(members) < 2:
            continue
        nodes, portables, biases = zip(*members)
        if len({p[0].data_ptr() for p in portables}) != len(portables):
            ctx.decline("horizontal", nodes[0], "the same int4 weight appears twice")
            continue
        packed, scale_zeros = _fused_pack(list(portables), group_size)
        if packed is None:
            ctx.decline("horizontal", nodes[0], "torch's CPU int4 pack refuses the fused shape")
            continue
        sizes = [p[0].shape[0] for p in portables]
        with graph.inserting_before(nodes[0]):
            bias = (_constant(gm, weight_cache.derived(_key("int4_bias", list(biases)), biases[0],
                                                       lambda _: torch.cat([b.detach() for b in biases])))
                    if biases[0] is not None else None)
            fused = graph.call_function(int4_cpu_linear, (
                x, _constant(gm, packed), _constant(gm, scale_zeros), group_size, bias))
            parts = graph.call_function(torch.split, (fused, sizes), {"dim": -1})
            outs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(nodes))]
        for old, new in zip(nodes, outs):
            U.copy_meta(new, old)
            old.replace_all_uses_with(new)
        U.erase_dead(graph, nodes)
        count += 1
    return count
