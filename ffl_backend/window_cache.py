"""A static cache layer that holds only a sliding window, for `optimize()`'s decode loop.

transformers' StaticSlidingWindowLayer rolls its buffer with a Python-int length that Dynamo guards
on (one recompile per token). `RollingWindowLayer` keeps `window` slots and writes the token at
cache position c into slot c % window, counting positions in a tensor, so every decode step is the
same graph; memory is the window, not max_seq_len.

Which slot holds which position follows from the newest position p alone: slot s holds
c(s) = p - ((p - s) mod window), the only position in (p - window, p] congruent to s; c(s) < 0 means
the slot is not written yet. A query at p sees exactly the keys p - window + 1 .. p (reference.py),
all of which are in the buffer, so decode attends to the whole buffer with the padding mask gathered
at c(s) (hf_attention.rolled_mask): the order of keys in a softmax does not matter (RoPE is already applied).

The first `update` after `reset` is the prompt, from position 0: it writes the prompt's last `window`
tokens and returns the whole prompt's keys, so the prompt attends to everything its window covers.
Every later update must be one token (the decode loop's steps).
"""
from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import StaticLayer


class RollingWindowLayer(StaticLayer):
    """`window` slots per sequence; masks are still built over the full `max_seq_len` (get_mask_sizes)."""

    def __init__(self, window: int, max_seq_len: int):
        super().__init__(max_cache_len=window)
        self.window, self.max_seq_len = window, max_seq_len
        self._prompt_written = False  # only read outside the compiled step (the prompt's update)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = key_states.shape[-2]
        if not self._prompt_written:
            self._prompt_written = True
            keep = min(length, self.window)
            slots = torch.arange(length - keep, length, device=self.device) % self.window
            self.keys.index_copy_(2, slots, key_states[:, :, length - keep:])
            self.values.index_copy_(2, slots, value_states[:, :, length - keep:])
            self.cumulative_length.fill_(length)
            return key_states, value_states
        if length != 1:
            raise RuntimeError("a rolling window cache takes the prompt once, then one token per step")
        slot = self.cumulative_length.reshape(1) % self.window
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        self.cumulative_length.add_(1)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_seq_len, 0  # prompt masks as for a full-length static layer

    def get_max_length(self) -> int:
        return self.max_seq_len

    def reset(self) -> None:
        super().reset()
        self._prompt_written = False


def use_rolling_windows(cache, max_seq_len: int):
    """Swap a StaticCache's sliding layers for RollingWindowLayers (full-length StaticLayers where
    the window is not shorter than max_seq_len); returns the cache."""
    from transformers.cache_utils import StaticSlidingWindowLayer

    layers = getattr(cache, "self_attention_cache", cache).layers
    for i, layer in enumerate(layers):
        if isinstance(layer, StaticSlidingWindowLayer):
            window = layer.max_cache_len  # min(sliding_window, max_cache_len)
            layers[i] = (RollingWindowLayer(window, max_seq_len) if window < max_seq_len
                         else StaticLayer(max_cache_len=max_seq_len))
    return cache

