"""Normalisation families: RMSNorm (Llama and Gemma cast orders), residual add + RMSNorm, LayerNorm.

The RMSNorm matcher anchors on `rsqrt` and reads the surrounding HF code back out of the graph:

    LlamaRMSNorm (modeling_llama.py):  h = x.to(f32); v = h.pow(2).mean(-1, keepdim=True)
                                       h = h * rsqrt(v + eps); return w * h.to(x.dtype)
    GemmaRMSNorm (modeling_gemma.py):  h = x.float(); h = h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
                                       return (h * (1.0 + w.float())).type_as(x)

The two differ only in where the weight multiply happens and the `1 +` offset, which become the
op's `weight_in_fp32` and `offset` parameters.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from . import fx_utils as U

OPS = torch.ops.fastflow


def _variance_input(var: fx.Node):
    """`mean(pow(h, 2) | h * h, -1, keepdim=True)` -> h, else None."""
    if not U.is_op(var, "mean"):
        return None
    dim, keepdim = U.arg(var, 1, "dim"), U.arg(var, 2, "keepdim", False)
    if dim not in (-1, [-1], (-1,)) or keepdim is not True:
        return None
    sq = var.args[0]
    if U.is_op(sq, "pow") and U.arg(sq, 1, "exponent") == 2:
        return sq.args[0]
    if U.is_op(sq, "mul") and sq.args[0] is sq.args[1]:
        return sq.args[0]
    return None


def _match_rms_core(rsqrt: fx.Node):
    """From `rsqrt`: (h32, normed, eps, matched nodes) for `h32 * rsqrt(mean(h32^2) + eps)`."""
    add = rsqrt.args[0]
    if not U.is_op(add, "add") or len(add.users) != 1:
        return None
    eps = next((U.scalar(a) for a in add.args if U.scalar(a) is not None), None)
    var = next((a for a in add.args if isinstance(a, fx.Node)), None)
    h32 = _variance_input(var) if eps is not None and var is not None else None
    normed = U.single_user(rsqrt)
    if h32 is None or normed is None or not U.is_op(normed, "mul") or U.other_operand(normed, rsqrt) is not h32:
        return None
    if U.dtype_of(h32) != torch.float32:
        return None
    return h32, normed, float(eps), [add, var, var.args[0], rsqrt, normed]


def _match_weight(normed: fx.Node, ctx):
    """The weight step after `normed`: (end node, weight node, offset, weight_in_fp32, nodes)."""
    user = U.single_user(normed)
    if user is None:
        return None
    if U.is_op(user, "cast"):  # Llama: w * normed.to(input_dtype)
        mul = U.single_user(user)
        if U.is_op(mul, "mul"):
            w = U.other_operand(mul, user)
            if ctx.is_vector_param(w):
                return mul, w, 0.0, False, [user, mul]
        return None
    if U.is_op(user, "mul"):  # Gemma: (normed * (1.0 + w.float())).type_as(x)
        scale = U.other_operand(user, normed)
        nodes = [user]
        offset = 0.0
        if U.is_op(scale, "add") and len(scale.users) == 1:
            offset = next((U.scalar(a) for a in scale.args if U.scalar(a) is not None), None)
            nodes.append(scale)
            scale = next((a for a in scale.args if isinstance(a, fx.Node)), None)
        if offset is None:
            return None
        w = U.strip_casts(scale)
        if not ctx.is_vector_param(w):
            return None
        nodes.extend(n for n in _cast_chain(scale, w))
        end = U.single_user(user)
        if U.is_op(end, "cast"):
            nodes.append(end)
        else:
            end = user
        return end, w, float(offset), True, nodes
    return None


def _cast_chain(top, bottom):
    """The cast nodes between `top` and `bottom` (inclusive of top, exclusive of bottom)."""
    node, chain = top, []
    while node is not bottom and U.is_op(node, "cast"):
        if len(node.users) != 1:
            return []
        chain.append(node)
        node = node.args[0]
    return chain


def rms_norm_pass(gm: fx.GraphModule, ctx) -> int:
    """Replace every HF RMSNorm subgraph with `fastflow.rms_norm`."""
    graph, count = gm.graph, 0
    for rsqrt in [n for n in graph.nodes if U.is_op(n, "rsqrt")]:
        core = _match_rms_core(rsqrt)
        if core is None:
            ctx.decline("rms_norm", rsqrt, "rsqrt not in an RMSNorm shape")
            continue
        h32, normed, eps, nodes = core
        weighted = _match_weight(normed, ctx)
        if weighted is None:
            ctx.decline("rms_norm", rsqrt, "no weight multiply after the normalisation")
            continue
        end, w, offset, w32, more = weighted
        x = h32.args[0] if U.is_op(h32, "cast") and U.arg(h32, 0) is not None else h32
        if not isinstance(x, fx.Node) or U.dtype_of(end) != _expected_dtype(x, w, w32):
            ctx.decline("rms_norm", rsqrt, "output dtype differs from the op's cast order")
            continue
        new = U.copy_meta(U.call_op(graph, OPS.rms_norm.default, (x, w, eps, offset, w32), end), end)
        end.replace_all_uses_with(new)
        U.erase_dead(graph, [end, *more, *nodes, h32])
        count += 1
    return count


def _expected_dtype(x: fx.Node, w: fx.Node, weight_in_fp32: bool):
    xd, wd = U.dtype_of(x), U.dtype_of(w)
    if xd is None or wd is None:
        return None
    return xd if weight_in_fp32 else torch.promote_types(xd, wd)


def add_rms_norm_pass(gm: fx.GraphModule, ctx) -> int:
    """Fold the residual add that feeds a `fastflow.rms_norm` into `fastflow.add_rms_norm`.

    The sum stays live (it is the residual stream for the next block), so the op returns both.
    """
    graph, count = gm.graph, 0
    for norm in [n for n in graph.nodes if n.target is OPS.rms_norm.default]:
        add = norm.args[0]
        if not U.is_op(add, "add") or len(add.args) != 2 or not all(isinstance(a, fx.Node) for a in add.args):
            continue
        residual, x = add.args
        values = [U.value(n) for n in (add, residual, x) if U.value(n) is not None]
        dtypes = {U.dtype_of(n) for n in (add, residual, x)}
        if not values or not U.same_shape(*values) or len(dtypes) != 1 or add.kwargs:
            ctx.decline("add_rms_norm", add, "residual add broadcasts or mixes dtypes")
            continue
        _, (out, hidden) = U.call_op(graph, OPS.add_rms_norm.default, (x, residual, *norm.args[1:]), add, 2)
        U.copy_meta(out, norm)
        U.copy_meta(hidden, add)
        norm.replace_all_uses_with(out)
        add.replace_all_uses_with(hidden)
        U.erase_dead(graph, [norm, add])
        count += 1
    return count


def layer_norm_pass(gm: fx.GraphModule, ctx) -> int:
    """`F.layer_norm(x, (N,), w, b, eps)` over the last dim -> `fastflow.layer_norm`."""
    graph, count = gm.graph, 0
    for ln in [n for n in graph.nodes if U.is_op(n, "layer_norm")]:
        x = ln.args[0]
        shape = U.arg(ln, 1, "normalized_shape")
        w, b = U.arg(ln, 2, "weight"), U.arg(ln, 3, "bias")
        eps = U.arg(ln, 4, "eps", 1e-5)
        xv = U.value(x)
        if xv is None or tuple(shape) != (xv.shape[-1],) or U.scalar(eps) is None:
            ctx.decline("layer_norm", ln, "not a last-dim LayerNorm with a literal eps")
            continue
        new = U.copy_meta(U.call_op(graph, OPS.layer_norm.default, (x, w, b, float(eps)), ln), ln)
        ln.replace_all_uses_with(new)
        U.erase_dead(graph, [ln])
        count += 1
    return count
