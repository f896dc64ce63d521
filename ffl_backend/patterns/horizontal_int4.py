"""Horizontal fusion for int4 linears on CPU: siblings reading one input become one packed GEMM.

An int4 model's decode step calls its CPU int4 kernel (fastflow's `int4_gemv`, or torch's
`_weight_int4pack_mm_for_cpu` where that is not built) once per linear: 7 per Llama layer. At batch 1
each call's fixed cost (the wrapper's call, the dispatcher, a thread fork/join) is a sizeable share
of its work, so q/k/v and gate/up -- linears that read the same activation -- are fused into one
call each, as `horizontal` does for dense linears: 7 calls per layer become 4.
int8 linears are left alone: decode_gemv reads their siblings in one call of the CPU GEMV kernel
with no fused copy.

fastflow's layout blocks rows in 16s, so its forms always concatenate (codes and scale tables);
torch's CPU packing blocks rows in 64s, so concatenating its packs is right only when every member
but the last has a multiple of 64 rows (tests/patterns/test_horizontal_int4.py). Where it is,
`quant.weight_layout.share_sibling_packs` (run by quantize() and the loaders) already made the members'
forms consecutive slices of one tensor, and the fusion uses that tensor: no copy (SmolLM2: q/k/v 576+192+192 rows,
gate/up 1536+1536, all shareable). Elsewhere the fused weight is packed afresh from the
concatenated portable form (codes, scales, zeros), a compile-time constant made once per set of
weights (weight_cache), like the dense fused weights: changing weights after compiling needs
`torch._dynamo.reset()`.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor

from ..kernels import weight_cache
from ..kernels.quant_linear import int4_cpu_codes, int4_cpu_form, int4_cpu_linear
from ..quant.modules import is_stand_in
from ..quant.weight_layout import shared_base
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
            or ctx.tensor(U.arg(node, 6, "cpu_packed")) is None or ctx.tensor(U.arg(node, 7, "cpu_scale_zeros")) is None
            or portable[0].device.type != "cpu"):
        return None
    return node.args[0], group_size, portable, bias


def _keyed_member(node: fx.Node, ctx):
    found = _member(node, ctx)
    if found is None:
        return None
    x, group_size, portable, bias = found
    return (x, group_size, portable[0].shape[1], bias is not None), (node, portable, bias)


def _key(kind: str, tensors: list) -> str:
    """A weight_cache kind naming every member beyond the first (the entry is keyed on that one)."""
    return kind + ":" + ",".join(f"{t.data_ptr()}/{t._version}" for t in tensors[1:])


def _fused_pack(portables: list, packs: list, scale_zeros: list, group_size: int):
    """The CPU form (packed, scale_zeros) of the row-concatenated weights, or (None, None): the
    members' own packs when they already are consecutive slices of one tensor, else a new form."""
    base = shared_base(packs)
    if base is not None:
        fastflow_layout = packs[0].dim() == 3  # its tables run over rows in dim 0, torch's in dim 1
        if fastflow_layout and shared_base(scale_zeros) is not None:
            return base, shared_base(scale_zeros)
        return base, weight_cache.derived(_key("int4_scale_zeros", scale_zeros), scale_zeros[0],
                                          lambda _: torch.cat(scale_zeros, dim=0 if fastflow_layout else 1))

    def make(_):
        codes = [_codes(p[0], pack) for p, pack in zip(portables, packs)]
        q, s, z = torch.cat(codes), *(torch.cat([p[i] for p in portables]) for i in (1, 2))
        return int4_cpu_form(q, s, z, group_size)
    return weight_cache.derived(_key("int4_siblings", [p[0] for p in portables]), portables[0][0], make)


def _codes(qweight: Tensor, pack: Tensor) -> Tensor:
    """A member's portable codes: its `qweight`, or rebuilt from its pack where only that is kept."""
    return int4_cpu_codes(pack, qweight.shape[0], qweight.shape[1] * 2) if is_stand_in(qweight) else qweight


def _constant(gm: fx.GraphModule, tensor: Tensor) -> fx.Node:
    return gm.graph.get_attr(U.attach_constant(gm, tensor, FUSED_PREFIX))


def fuse_int4_siblings(gm: fx.GraphModule, ctx) -> int:
    """Fuse every group of >= 2 CPU int4 linears with the same input, group size and bias-ness."""
    graph = gm.graph
    count = 0
    for (x, group_size, *_), members in U.sibling_groups(graph, lambda node: _keyed_member(node, ctx)):
        nodes, portables, biases = zip(*members)
        if len({p[0].data_ptr() for p in portables}) != len(portables):
            ctx.decline("horizontal", nodes[0], "the same int4 weight appears twice")
            continue
        packed, scale_zeros = _fused_pack(list(portables), [ctx.tensor(U.arg(n, 6, "cpu_packed")) for n in nodes],
                                          [ctx.tensor(U.arg(n, 7, "cpu_scale_zeros")) for n in nodes], group_size)
        if packed is None:
            ctx.decline("horizontal", nodes[0], "torch's CPU int4 pack refuses the fused shape")
            continue
        with graph.inserting_before(nodes[0]):
            bias = (_constant(gm, weight_cache.derived(_key("int4_bias", list(biases)), biases[0],
                                                       lambda _: torch.cat([b.detach() for b in biases])))
                    if biases[0] is not None else None)
            fused = graph.call_function(int4_cpu_linear, (
                x, _constant(gm, packed), _constant(gm, scale_zeros), group_size, bias))
        U.replace_by_slices(graph, list(nodes), fused)
        count += 1
    return count
