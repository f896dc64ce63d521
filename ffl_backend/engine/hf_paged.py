"""The transformers side of the engine: an attention implementation that reads the paged cache.

Registered under NAME with `AttentionInterface.register` and selected per model instance
(`model.set_attn_implementation`), restored by `uninstall`. Deliberately *no* mask function is
registered for it: transformers then takes its documented early exit for custom attention without
an equivalent mask ("For TGI/vLLM backends ... we don't need a mask", masking_utils
_preprocess_mask_arguments) and builds nothing. The paged op masks by `seq_lens` itself, and a
prefill here is always one whole sequence from position 0, so plain causal attention is exact.
(DESIGN.md section 3's "register a mask function" is about static caches, where the mask is the
only record of which slots are written; here the block tables are.)

Two cases, told apart by the keyword arguments the engine passes to the model's forward:
- decode (`block_tables` given): q (B, Hq, 1, D) -> `fastflow::paged_decode` over the pools;
- prefill (no block tables): q/k/v of one sequence -> `fastflow::attention_prefill` (causal).
Both take the layer's `sliding_window` and `softcap` (Gemma 2/3, Mistral) as the model passes them.
"""
from __future__ import annotations

import torch

from ..attention import paged as _paged  # noqa: F401  (registers torch.ops.fastflow.paged_decode)

NAME = "fastflow_paged"  # no "flash" in it: transformers would switch on its own FlashAttention paths


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, block_tables=None,
                    seq_lens=None, sliding_window=None, softcap=None, **kwargs):
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window, cap = int(sliding_window or 0), float(softcap or 0.0)
    if block_tables is not None:
        out = torch.ops.fastflow.paged_decode(query[:, :, 0], key, value, block_tables, seq_lens, scale, window, cap)
        return out[:, None], None  # (B, 1, Hq, D)
    from ..attention import prefill  # noqa: F401  (registers torch.ops.fastflow.attention_prefill)

    out = torch.ops.fastflow.attention_prefill(query, key, value, scale, window, cap)
    return out.transpose(1, 2), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, paged_attention)


def install(model) -> str:
    """Select the paged attention for this model; returns the previous implementation."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    return previous


def uninstall(model, previous: str | None) -> None:
    if previous is not None and model.config._attn_implementation == NAME:
        model.set_attn_implementation(previous)
