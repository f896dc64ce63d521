"""Static cache layers that store K and V quantized (int8 or fp8 e4m3, one fp32 scale per token and
KV head), for `optimize(model, kv_cache_dtype=...)`.

The rows are attention/kv_quant.py's packed format: quantized on write, here, and dequantized only
inside the attention ops, which read the packed tensors the layer returns. Any transformers static
layer (StaticLayer, window_cache.RollingWindowLayer, ...) gets the behaviour by a mixin over its own
`update`: the layer stores and copies byte rows (int8 storage: CPU torch has no index_copy_ for fp8)
and hands out views of them in the storage dtype, which tells the ops the format.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from .attention.kv_quant import quantize_kv_bytes


class QuantizedWrites:
    """Mixin: quantize the new states, let the layer's own update write the bytes, and return its
    keys/values (or the prompt's states) viewed as the storage dtype."""

    kv_dtype: torch.dtype

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        keys, values = super().update(quantize_kv_bytes(key_states, self.kv_dtype),
                                      quantize_kv_bytes(value_states, self.kv_dtype), *args, **kwargs)
        return keys.view(self.kv_dtype), values.view(self.kv_dtype)


@functools.cache
def _quantized_class(layer_class: type) -> type:
    return type(f"Quantized{layer_class.__name__}", (QuantizedWrites, layer_class), {})


def quantize_layers(cache, kv_dtype: torch.dtype | None):
    """Make every layer of a static cache store `kv_dtype` rows (None: leave the cache as it is);
    returns the cache. Each layer is replaced by an instance of its quantizing subclass carrying the
    same settings; one that already held float tensors re-allocates them at its next update."""
    if kv_dtype is None:
        return cache
    layers = getattr(cache, "self_attention_cache", cache).layers
    for i, layer in enumerate(layers):
        if getattr(layer, "kv_dtype", None) == kv_dtype:
            continue
        if not getattr(layer, "is_compileable", False):
            raise ValueError(f"a quantized KV cache needs static cache layers, got {type(layer).__name__}")
        base = type(layer).__bases__[-1] if isinstance(layer, QuantizedWrites) else type(layer)
        quantized = object.__new__(_quantized_class(base))
        quantized.__dict__.update(layer.__dict__, kv_dtype=kv_dtype, is_initialized=False)
        layers[i] = quantized
    return cache
