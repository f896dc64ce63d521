"""Rotary embedding family: HF's `apply_rotary_pos_emb` (rotate_half layout), full or partial.

    modeling_llama.py:  cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
                        q_embed = (q * cos) + (rotate_half(q) * sin)      (same for k)
    rotate_half(x):     cat((-x[..., d/2:], x[..., :d/2]), dim=-1)
    partial (Phi-3, GPT-NeoX): q_rot, q_pass = q[..., :rd], q[..., rd:]
                        q_embed = cat([rotary(q_rot), q_pass], dim=-1)

q and k share one cos/sin pair, so they are matched one by one and then paired on it.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx

from . import fx_utils as U

OPS = torch.ops.fastflow


def _last_dim_slice(node, x):
    """(start, stop) when `node` is `x[..., start:stop]`, else None."""
    if not U.is_op(node, "getitem") or node.args[0] is not x:
        return None
    idx = node.args[1]
    if not (isinstance(idx, tuple) and len(idx) == 2 and idx[0] is Ellipsis and isinstance(idx[1], slice)):
        return None
    s = idx[1]
    return (s.start or 0, s.stop) if s.step in (None, 1) else None


def _match_rotate_half(cat: fx.Node):
    """`cat((-x[..., h:], x[..., :h]), -1)` -> (x, h, nodes), else None."""
    if U.arg(cat, 1, "dim") != -1 or len(cat.args[0]) != 2:
        return None
    neg, x1 = cat.args[0]
    if not U.is_op(neg, "neg") or not U.is_op(neg.args[0], "getitem"):
        return None
    x = neg.args[0].args[0]
    hi, lo = _last_dim_slice(neg.args[0], x), _last_dim_slice(x1, x)
    xv = U.value(x)
    if hi is None or lo is None or xv is None:
        return None
    half = xv.shape[-1] // 2
    if lo != (0, half) or hi[0] != half or hi[1] not in (None, xv.shape[-1]) or xv.shape[-1] % 2:
        return None
    return x, [cat, neg, neg.args[0], x1]


def _match_apply(cat: fx.Node):
    """One `(x * cos) + (rotate_half(x) * sin)`, optionally re-joined with a pass-through part.

    Returns (source tensor, cos, sin, rotary_dim, end node, nodes) or None."""
    half = _match_rotate_half(cat)
    mul_sin = U.single_user(cat)
    if half is None or not U.is_op(mul_sin, "mul"):
        return None
    x, nodes = half
    sin_u = U.other_operand(mul_sin, cat)
    add = U.single_user(mul_sin)
    mul_cos = U.other_operand(add, mul_sin) if U.is_op(add, "add") else None
    if not U.is_op(mul_cos, "mul") or x not in mul_cos.args:
        return None
    cos_u = U.other_operand(mul_cos, x)
    if not (U.is_op(cos_u, "unsqueeze") and U.is_op(sin_u, "unsqueeze")):
        return None
    if U.arg(cos_u, 1, "dim") != 1 or U.arg(sin_u, 1, "dim") != 1:
        return None
    nodes += [mul_sin, mul_cos, add]
    rotary_dim = U.value(x).shape[-1]
    source, end = x, add
    rot = _last_dim_slice(x, x.args[0]) if U.is_op(x, "getitem") else None
    if rot is not None and rot[0] == 0:  # partial rotary: x = full[..., :rd]
        full = x.args[0]
        joined = U.single_user(add)
        rest = joined.args[0][1] if U.is_op(joined, "cat") and len(joined.args[0]) == 2 else None
        if rest is None or joined.args[0][0] is not add or _last_dim_slice(rest, full) != (rotary_dim, None):
            return None
        if U.arg(joined, 1, "dim") != -1:
            return None
        source, end = full, joined
        nodes += [joined, x, rest]
    return source, cos_u, sin_u, rotary_dim, end, nodes


def rotary_pass(gm: fx.GraphModule, ctx) -> int:
    """Pair the q and k rotary applications sharing cos/sin -> `fastflow.rotary` (counts pairs)."""
    graph = gm.graph
    groups = defaultdict(list)
    for cat in [n for n in graph.nodes if U.is_op(n, "cat")]:
        found = _match_apply(cat)
        if found is not None:
            groups[(found[1], found[2])].append(found)
    count = 0
    for (cos_u, sin_u), applies in groups.items():
        if len(applies) != 2:
            ctx.decline("rotary", cos_u, f"{len(applies)} rotary applications share one cos/sin, expected q and k")
            continue
        (q, _, _, rd_q, q_end, q_nodes), (k, _, _, rd_k, k_end, k_nodes) = applies
        qv, kv, cv = U.value(q), U.value(k), U.value(cos_u.args[0])
        if rd_q != rd_k or qv.dim() != 4 or kv.dim() != 4 or cv is None or cv.dim() != 3:
            ctx.decline("rotary", cos_u, "unexpected rank or rotary width")
            continue
        if q_end.meta.get("example_value") is None or qv.dtype != kv.dtype or U.dtype_of(q_end) != qv.dtype:
            ctx.decline("rotary", cos_u, "mixed dtypes between q, k and cos/sin")
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min((q_end, k_end), key=order.__getitem__)
        args = (q, k, cos_u.args[0], sin_u.args[0], rd_q)
        if max(order[a] for a in args[:4]) > order[first]:
            ctx.decline("rotary", cos_u, "k is computed after q's rotary is used")
            continue
        _, (q_out, k_out) = U.call_op(graph, OPS.rotary.default, args, first, 2)
        U.copy_meta(q_out, q_end)
        U.copy_meta(k_out, k_end)
        q_end.replace_all_uses_with(q_out)
        k_end.replace_all_uses_with(k_out)
        U.erase_dead(graph, q_nodes + k_nodes + [cos_u, sin_u])
        count += 1
    return count
