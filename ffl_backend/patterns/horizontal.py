"""Horizontal fusion: linears that read the same input become one matmul, then a split.

    q, k, v = x @ Wq.T, x @ Wk.T, x @ Wv.T      ->   qkv = x @ cat(Wq, Wk, Wv).T; q, k, v = split(qkv)
    gate, up = x @ Wg.T, x @ Wu.T               ->   same

At batch 1 each linear is a GEMV dominated by fixed per-call cost, so 5 calls per layer become 2.
The concatenation is constant-folded here, once, at compile time, and attached to the graph module
as a constant. Parameters cannot be re-pointed from inside a compile (AOT autograd re-checks their
storage offsets against Dynamo's record), so a plain backend compile holds a fused copy of those
weights. `quant.weight_layout.share_fused_storage(model)` (called by `ffl_backend.optimize`) makes
the projections views of one tensor beforehand; the pass then finds that tensor and copies nothing.

Where the CPU decode kernel will take the siblings (single-row bf16 or bf16-exact fp32 linears,
decode_gemv) a copy is not made at all: the kernel reads q/k/v (or gate/up) in one call from their
own tensors as fast as from a fused copy, which would only add the weights' size to memory.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..quant.weight_layout import shared_base
from . import fx_utils as U
from .decode_gemv import kernel_reads_siblings
from .horizontal_int4 import fuse_int4_siblings

FUSED_PREFIX = "_fastflow_fused_weight"


def _candidate(node, ctx):
    """(input, weight tensor, bias tensor or None) for a linear on parameters, else None."""
    if not U.is_op(node, "linear"):
        return None
    x, w_node, b_node = node.args[0], U.arg(node, 1, "weight"), U.arg(node, 2, "bias")
    w = ctx.tensor(w_node)
    if not isinstance(w, torch.nn.Parameter) or w.dim() != 2:
        return None
    b = ctx.tensor(b_node) if b_node is not None else None
    if b_node is not None and not isinstance(b, torch.nn.Parameter):
        return None
    return x, w, b


@torch.no_grad()
def _fuse_tensors(tensors):
    """cat(tensors) along dim 0 -- or, when they already are consecutive slices of one tensor
    (see `share_fused_storage`), that tensor itself, so nothing is copied."""
    base = shared_base(tensors)
    return base if base is not None else torch.cat([t.detach() for t in tensors], dim=0)


def horizontal_pass(gm: fx.GraphModule, ctx) -> int:
    """Fuse every group of >= 2 parameter linears reading the same input (same dtype, bias-ness),
    and likewise CPU int4 linears (horizontal_int4.py)."""
    return _fuse_dense(gm, ctx) + fuse_int4_siblings(gm, ctx)


def _dense_member(node, ctx):
    found = _candidate(node, ctx)
    if found is None:
        return None
    x, w, b = found
    return (x, w.dtype, w.device, w.shape[1], b is not None), (node, w, b)


def _fuse_dense(gm: fx.GraphModule, ctx) -> int:
    graph = gm.graph
    count = 0
    for (x, *_), members in U.sibling_groups(graph, lambda node: _dense_member(node, ctx)):
        nodes, weights, biases = zip(*members)
        if len({id(w) for w in weights}) != len(weights):
            ctx.decline("horizontal", nodes[0], "the same weight appears twice")
            continue
        if shared_base(list(weights)) is None and kernel_reads_siblings(ctx, x, weights, biases):
            ctx.decline("horizontal", nodes[0], "the CPU decode kernel reads these siblings in one call; "
                        "a fused copy would only add their size in memory")
            continue
        with graph.inserting_before(nodes[0]):
            w_attr = graph.get_attr(U.attach_constant(gm, _fuse_tensors(list(weights)), FUSED_PREFIX))
            b_attr = (graph.get_attr(U.attach_constant(gm, _fuse_tensors(list(biases)), FUSED_PREFIX))
                      if biases[0] is not None else None)
            fused = graph.call_function(torch._C._nn.linear, (x, w_attr, b_attr))
        U.replace_by_slices(graph, list(nodes), fused)
        count += 1
    return count
