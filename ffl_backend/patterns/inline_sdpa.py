"""The inline_sdpa family (called decode_attention before 2026-12-06): single-query CPU SDPA becomes
dot products + softmax in Inductor C++.

At batch 1 a decode step's attention is tiny (one query row against the filled cache), yet each
`scaled_dot_product_attention` call is an opaque ATen kernel with its own allocations, transposes
and thread fork/join, a fixed cost per layer larger than the arithmetic. Written as math -- scores = (q * k).sum(-1),
softmax, (p * v).sum -- Inductor compiles it into the layer's fused C++ kernel instead.

Matched only on CPU, for one query row, static shapes, no dropout, not `is_causal` (with one query
torch aligns the causal mask top-left: key 0 only), and the same number of query and key heads
(HF's `repeat_kv` has already expanded grouped heads on this path). Numerics: scores, softmax and
the weighted sum in fp32 (as torch's CPU flash kernel accumulates), one rounding to q's dtype.
A bool mask keeps True positions; a float mask is added to the scores, as SDPA does.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from ..numerics import acc_dtype
from . import fx_utils as U

SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)


def attention_single_query(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
    """SDPA for q (..., H, 1, D) over k, v (..., H, L, D), in fp32; q's dtype out."""
    acc = acc_dtype(q)
    # as_strided makes Inductor store the query once instead of recomputing its producer (rotary)
    # for every key row (see decode_gemv._row_dot).
    qf = q.to(acc)
    qf = torch.as_strided(qf, qf.shape, qf.stride())
    scores = ((qf * k.to(acc)).sum(-1) * scale).unsqueeze(-2)  # (..., H, 1, L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(acc)
    p = torch.softmax(scores, dim=-1)
    return (p.transpose(-1, -2) * v.to(acc)).sum(-2, keepdim=True).to(q.dtype)


def _kwarg(node: fx.Node, index: int, name: str, default):
    return U.arg(node, index, name, default)


def _matches(node: fx.Node) -> bool:
    q, k, v = (U.value(a) for a in node.args[:3]) if len(node.args) >= 3 else (None, None, None)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return False
    if q.device.type != "cpu" or q.dim() != 4 or q.shape[-2] != 1 or k.shape[1] != q.shape[1]:
        return False
    if any(not isinstance(s, int) for t in (q, k, v) for s in t.shape):
        return False
    if _kwarg(node, 4, "dropout_p", 0.0) != 0.0 or _kwarg(node, 5, "is_causal", False) is not False:
        return False
    if node.kwargs.get("enable_gqa", False) is not False:
        return False
    mask = U.value(_kwarg(node, 3, "attn_mask", None))
    return mask is None or (isinstance(mask, torch.Tensor) and mask.dim() <= 4)


def inline_sdpa_pass(gm: fx.GraphModule, ctx) -> int:
    if not ctx.options.inductor:  # eager would materialize the (H, L, D) products
        return 0
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS or not _matches(node):
            continue
        q = U.value(node.args[0])
        scale = _kwarg(node, 6, "scale", None)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        args = (*node.args[:3], _kwarg(node, 3, "attn_mask", None), scale)
        new = U.copy_meta(U.call_op(gm.graph, attention_single_query, args, node), node)
        node.replace_all_uses_with(new)
        U.erase_dead(gm.graph, [node])
        count += 1
    return count
