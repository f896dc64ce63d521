"""Derived forms of weights (a oneDNN-packed layout, a compact bf16 copy), made once per weight.

A derived tensor is valid only while the weight it came from is alive and unmodified: entries are
keyed by the weight's storage and view, checked against its version counter (an in-place update
such as `load_state_dict` or `copy_` bumps it), and dropped when the weight is freed. So repeated
compiles of one model (new cache lengths, batch buckets) share one copy instead of making one each.
"""
from __future__ import annotations

import threading
import weakref

from torch import Tensor

_lock = threading.Lock()
_cache: dict = {}  # (kind, weight key) -> (weakref to the weight, its version, derived tensor)


def _key(kind: str, w: Tensor):
    return (kind, w.data_ptr(), w.storage_offset(), tuple(w.shape), tuple(w.stride()), w.dtype)


def derived(kind: str, w: Tensor, make) -> Tensor:
    """`make(w)`, cached under `kind` while `w` lives unchanged."""
    key = _key(kind, w)
    with _lock:
        entry = _cache.get(key)
        if entry is not None and entry[0]() is not None and entry[1] == w._version:
            return entry[2]
    value = make(w)
    with _lock:
        _cache[key] = (weakref.ref(w), w._version, value)
        weakref.finalize(w, _cache.pop, key, None)
    return value

