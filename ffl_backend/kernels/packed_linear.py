"""`torch.ops.fastflow.packed_linear`: a CPU linear over a weight pre-packed once for oneDNN.

Why: at batch 1 a bf16/fp16 `F.linear` on CPU re-lays the weight out for oneDNN on every call and
runs compute-bound, while the same GEMV on a pre-packed weight is several times faster with
bit-identical results (tests/kernels/test_packed_linear.py checks the results). Inductor only pre-packs
under freezing, which it decides at Dynamo trace time and which also folds HF's static KV cache
(marked static) into constants: wrong tokens. So fastflow packs the weights itself.

The op is opaque to Inductor on purpose (a `custom_op`, not a `triton_op`): the packed tensor is an
oneDNN-layout tensor that cannot live in a traced graph. It receives the ordinary weight and finds
its packed form in a cache filled at compile time. A cache entry is valid only while the weight it
was packed from is alive and unmodified (same storage, same version counter), so an in-place
weight update (`load_state_dict`, `copy_`) is re-packed on the next call, never served stale.
On other devices, and for dtypes without a packed path, the op is plain `F.linear`.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from . import weight_cache

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16, torch.float16)


def can_pack(w: Tensor) -> bool:
    return (w.device.type == "cpu" and w.dtype in PACKED_DTYPES and w.dim() == 2
            and torch.backends.mkldnn.is_available() and cpu_packs(w.dtype))


@functools.cache
def cpu_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU. Its bf16 path needs AVX-512 (BW/VL/DQ) or
    AVX-NE-CONVERT, fp16 AVX512-FP16 or AVX-NE-CONVERT (torch 2.13); an AVX2-only CPU (AMD Zen 3) has
    neither and `_reorder_linear_weight` raises. Asked once per dtype with a tiny weight, so the check
    is oneDNN's own rather than a copy of its CPU rules."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
        return True
    except RuntimeError as exc:
        logger.info("fastflow: oneDNN cannot pack %s weights on this CPU (%s); packed_linear stays F.linear",
                    dtype, exc)
        return False


@torch.no_grad()
def prepack(w: Tensor, batch_hint: int = 1) -> Tensor:
    """The oneDNN-packed form of `w` (N, K), made once and cached while `w` lives unchanged."""
    return weight_cache.derived(
        "onednn", w, lambda w: torch.ops.mkldnn._reorder_linear_weight(w.detach(), max(1, int(batch_hint))))


def packed_linear_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return F.linear(x, weight, bias)


@torch.library.custom_op("fastflow::packed_linear", mutates_args=())
def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    if not (can_pack(weight) and x.dtype == weight.dtype and x.numel() > 0):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(x2, prepack(weight, x2.shape[0]), bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


@packed_linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.promote_types(x.dtype, weight.dtype))
