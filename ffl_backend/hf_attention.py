"""The transformers side: the "fastflow" attention implementation, its mask function, and the
per-model switch (install / uninstall) that `ffl_backend.optimize` and `restore` use.

transformers hands an attention function (module, q, k, v, mask, scaling, **kwargs) with q
(B, Hq, Lq, D) and k/v (B, Hkv, Lkv, D) as the cache returned them: with a static cache that is the
whole cache, Lkv = max_cache_len, and only the 4-D boolean mask tells which slots are written and
which are left padding. So:
- mask present (static cache, padding, decode): `attention_decode`, with `filled` = one past the
  last slot the newest query may see, computed from the mask as a tensor (no guard, no recompile);
  the op then reads only those slots and ANDs the mask in (left padding stays exact per row).
- no mask (HF skips it for plain causal attention without padding): `attention_prefill` over the
  given keys, or over the first Lq slots when a prompt fills an empty static cache.

The mask function is transformers' own `sdpa_mask` (boolean, padding folded in). It must be
registered under the same name: without one, `_preprocess_mask_arguments` returns no mask at all
and decode would attend to every slot of the cache, written or not. One case it is told about
(`prompt_into_empty_cache`): the decode loop's prompt without padding, written from slot 0 of a cache
it has just emptied. transformers skips that mask only when it can read the cache's offset, which a
compiled prompt cannot (masking_utils._ignore_causal_mask_sdpa: a traced offset is never read), so
a compiled prompt would build a (B, 1, L, max_seq_len) mask and take the masked path; told, the mask
function returns None and the prompt runs `attention_prefill` (windows applied by the op) as eager does.

Sliding-window layers: transformers' StaticSlidingWindowLayer rolls the cache, but tracks its length
in a Python int that Dynamo guards on, so compiled decode recompiles at every token until it hits the
recompile limit (measured: 8 graphs for 20 tokens on a tiny Mistral). fastflow's decode loop gives
such layers a `RollingWindowLayer` (window_cache.py: window slots, a tensor position); decode then
sees a key buffer exactly `window` long against a full-length mask, and `rolled_mask` maps the mask
onto the slots. transformers' own loop (requests the decode loop hands back) gets a plain StaticLayer
of the full length (`install`), the window applied by the op and the sliding mask.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch import Tensor

from .attention import decode as _decode  # registers torch.ops.fastflow.attention_decode
from .attention import prefill as _prefill  # noqa: F401  (registers torch.ops.fastflow.attention_prefill)
from .attention.kv_quant import dequantized
from .attention.reference import visible
from .kernels import cpu_lib

NAME = "fastflow"  # no "flash" in it: transformers would switch on its own FlashAttention paths


def filled_length(mask: Tensor) -> Tensor:
    """One past the last key slot any batch row's newest query may see, as an int64 0-d tensor."""
    last = mask[:, 0, -1, :].any(0)
    slots = torch.arange(1, last.shape[-1] + 1, device=mask.device)
    return (last * slots).amax()


def rolled_mask(mask: Tensor, newest: Tensor, window: int) -> Tensor:
    """(B, 1, 1, window) bool: whether slot s of a RollingWindowLayer (window_cache.py) holds a
    visible key, from the full-length decode mask (B, 1, 1, max_seq_len) and the newest position p."""
    slots = torch.arange(window, device=mask.device)
    positions = newest - torch.remainder(newest - slots, window)
    gathered = mask.gather(-1, positions.clamp(min=0).expand(*mask.shape[:-1], window))
    return gathered & (positions >= 0)


def _bool_mask(mask: Tensor) -> Tensor:
    """HF float masks hold 0 where attending and the dtype's minimum elsewhere."""
    return mask if mask.dtype == torch.bool else mask == 0


def _eager_fallback(module, query, key, value, attention_mask, sliding_window=None, **kwargs):
    """The model's own eager attention, for what the ops do not cover (dropout in training).
    A sliding window is ANDed into the mask here, as the ops apply it themselves: the decode loop
    hands every layer one full-causal mask (decode_loop.py)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    key, value = dequantized(query, key, value)  # a quantized cache's packed rows (kv_quant.py)
    if sliding_window and attention_mask is not None and attention_mask.dim() == 4:
        mask = _bool_mask(attention_mask)
        q_len = query.shape[2]
        window = visible(q_len, mask.shape[-1], int(sliding_window), mask.device,
                         q_start=filled_length(mask) - q_len)
        attention_mask = mask & window
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        attention_mask = torch.where(attention_mask, zero, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, attention_mask, **kwargs)


def fastflow_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                       scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                       softcap: float | None = None, **kwargs):
    if dropout and module.training:
        return _eager_fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                               sliding_window=sliding_window, softcap=softcap, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window, cap = int(sliding_window) if sliding_window else 0, float(softcap or 0.0)
    if attention_mask is None:
        if 1 < query.shape[2] < key.shape[2]:
            # HF skipped the mask for a prompt written from slot 0 of an empty static cache (its
            # `is_causal` is top-left aligned there): the prompt's keys are the first Lq slots.
            key, value = key[:, :, :query.shape[2]], value[:, :, :query.shape[2]]
        out = torch.ops.fastflow.attention_prefill(query, key, value, scale, window, cap)
    else:
        mask = _bool_mask(attention_mask)
        if window and query.shape[2] == 1 and key.shape[2] == window < mask.shape[-1]:
            # a RollingWindowLayer's buffer (window_cache.py): every written slot is in the window
            newest = filled_length(mask) - 1
            mask, window = rolled_mask(mask, newest, key.shape[2]), 0
            filled = torch.clamp(newest + 1, max=key.shape[2])
        else:
            filled = filled_length(mask)
        # On CPU the C++ kernel is called directly, not through the Python op around it: one
        # dispatcher call per layer in the compiled decode step (under cpp_wrapper a C++ call).
        if not cap and _cpu_kernel["built"] and _decode.cpu_kernel_fits(query, key):
            out = torch.ops.fastflow_cpu.attention_decode(query, key, value, filled, scale, window, mask)
        else:
            out = torch.ops.fastflow.attention_decode(query, key, value, filled, scale, window, mask, cap)
    return out.transpose(1, 2), None


# Whether the fastflow_cpu library is built, read by the traced attention function (a plain value
# Dynamo can guard on: `cpu_lib.load()` itself takes a lock, which a trace must not enter).
_cpu_kernel = {"built": False}


# Read by the traced mask function (a plain dict entry Dynamo guards on); set only around the decode
# loop's own prompt call, never inside a compiled region.
_prompt = {"into_empty_cache": False}


@contextlib.contextmanager
def prompt_into_empty_cache():
    """The calls in this block are prompts without padding written from slot 0 of an emptied cache
    (module docstring): their causal masks are skipped, as transformers skips them in eager mode."""
    _prompt["into_empty_cache"] = True
    try:
        yield
    finally:
        _prompt["into_empty_cache"] = False


def fastflow_mask(*args, **kwargs):
    """transformers' `sdpa_mask`, but no mask for a prompt inside `prompt_into_empty_cache` that HF
    would let skip it (no padding mask; no or/and mask functions: those clear allow_is_causal_skip)."""
    from transformers.masking_utils import sdpa_mask

    if (_prompt["into_empty_cache"] and not args and kwargs.get("attention_mask") is None
            and kwargs.get("allow_is_causal_skip", True)):
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Make "fastflow" a transformers attention implementation (idempotent, global by name only:
    no model uses it until it is selected for that model)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, fastflow_attention)
    AttentionMaskInterface.register(NAME, fastflow_mask)


def has_sliding_layers(config) -> bool:
    from transformers.cache_utils import get_layer_types_and_kwargs

    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return "sliding_attention" in layer_types


def unroll_sliding_layers(cache, max_cache_len: int):
    """Give the sliding-window layers of a static cache full-length StaticLayers (module docstring)."""
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    layers = getattr(cache, "self_attention_cache", cache).layers
    for i, layer in enumerate(layers):
        if isinstance(layer, StaticSlidingWindowLayer):
            layers[i] = StaticLayer(max_cache_len=max_cache_len)
    return cache


def _fastflow_static_cache(model, kv_dtype):
    """A per-instance `_prepare_static_cache` whose sliding layers are full-length StaticLayers and
    whose layers store `kv_dtype` rows (kv_cache.py) when one is given."""
    from .kv_cache import quantize_layers

    original = model._prepare_static_cache

    def prepare(*args, **kwargs):
        cache = unroll_sliding_layers(original(*args, **kwargs), model._previous_max_cache_length)
        return quantize_layers(cache, kv_dtype)

    return prepare


def install(model, attention: str | None = NAME, kv_dtype: torch.dtype | None = None) -> dict:
    """Select `attention` for this model (unroll sliding caches, quantize the cache when `kv_dtype`
    is a quantized format: only "fastflow" attention reads it, which optimize() checks up front);
    returns what `uninstall` needs."""
    state = {"attn": model.config._attn_implementation, "cache_patch": False}
    if attention is None:
        return state
    if attention == NAME:
        register()
        if model.device.type == "cpu":
            _cpu_kernel["built"] = cpu_lib.load()
    model.set_attn_implementation(attention)
    if attention == NAME and (has_sliding_layers(model.config) or kv_dtype is not None):
        model._prepare_static_cache = _fastflow_static_cache(model, kv_dtype)
        state["cache_patch"] = True
    return state


def uninstall(model, state: dict) -> None:
    if state["cache_patch"]:
        del model._prepare_static_cache
    if state["attn"] is not None and model.config._attn_implementation != state["attn"]:
        model.set_attn_implementation(state["attn"])
