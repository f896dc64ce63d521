"""The definition of fastflow attention in pure torch, and the masks both ops share.

Positions: a query block of length Lq attends to keys [0, kv_len) and is aligned bottom-right, i.e.
query i sits at absolute position `kv_len - Lq + i` (flash-attn's causal convention). For prefill
kv_len is the number of keys given; for decode it is `filled`, the number of cache slots written so
far (the new tokens included), so the queries are the last Lq written tokens.

Key j is visible to query position p when  j <= p  (causal),  p - j < window  (window > 0 only; HF's
`sliding_window_causal_mask_function`), and  mask[b, 0, i, j]  (optional boolean HF mask: padding).
Soft-capping (Gemma 2's attn_logit_softcapping, softcap > 0 only) bounds each scaled score before
the masks: s -> softcap * tanh(s / softcap). A query with no visible key outputs zeros, as torch's
SDPA does for a fully masked row; left-padded batches produce such rows at pad positions and a NaN
there would leak into the cache.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..numerics import acc_dtype


def visible(q_len: int, kv_len: int, window: int, device, q_start: int | None = None) -> Tensor:
    """(Lq, kv_len) bool: causal (bottom-right aligned) and, when window > 0, within the window."""
    if q_start is None:
        q_start = kv_len - q_len
    pos = torch.arange(q_len, device=device)[:, None] + q_start
    key = torch.arange(kv_len, device=device)[None, :]
    ok = key <= pos
    if window > 0:
        ok = ok & (pos - key < window)
    return ok


def softcapped(scores: Tensor, softcap: float) -> Tensor:
    return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


def attention_ref(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int = 0,
                  filled: int | None = None, mask: Tensor | None = None, softcap: float = 0.0) -> Tensor:
    """softmax(q k^T * scale + masks) v, GQA by repeating K/V heads, in at least fp32 (so a float64
    run is a true high-precision reference), rounded once to q's dtype.

    q (B, Hq, Lq, D); k, v (B, Hkv, S, D) with Hq % Hkv == 0; `filled` (default S) keys are valid;
    mask (B or 1, 1, Lq, >= filled) bool."""
    kv_len = k.shape[2] if filled is None else int(filled)
    acc = acc_dtype(q)
    group = q.shape[1] // k.shape[1]
    kf = k[:, :, :kv_len].to(acc).repeat_interleave(group, dim=1)
    vf = v[:, :, :kv_len].to(acc).repeat_interleave(group, dim=1)
    scores = softcapped((q.to(acc) @ kf.transpose(-1, -2)) * scale, softcap)
    ok = visible(q.shape[2], kv_len, window, q.device)
    if mask is not None:
        ok = ok & mask[..., :kv_len].to(torch.bool)
    scores = scores.masked_fill(~ok, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked row: 0/0 -> 0
    return (probs @ vf).to(q.dtype)
