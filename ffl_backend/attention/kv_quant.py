"""The quantized KV-cache format every attention op reads: int8 or fp8 (e4m3) rows with their scale.

One cached row = one token of one KV head (D values). Quantized, it is stored as a single byte row

    [ D quantized values | zero pad to a multiple of 4 | fp32 scale (4 bytes) ]   width = packed_width(D)

in a tensor of the storage dtype (torch.int8 or torch.float8_e4m3fn) shaped like the float cache
with the last dim D -> packed_width(D). The value is `stored * scale`, scale = the row's max |x|
over the format's largest value (127 for int8, 448 for e4m3), so every row uses the format's
whole range (per-token, per-head scales: vLLM's and llama.cpp's q8_0 granularity is finer, per 32;
a row of 64-256 values costs 4 bytes of scale, 2-6% of the row).

Why one tensor with the scale inside: transformers hands the attention function exactly what the
cache layer returns (keys, values), so a quantized cache must travel as one tensor per K and V; the
dtype says how to read it (`is_quantized`), the head dim comes from the query. Kernels find a row's
scale at byte `scale_offset(D)` of the row (4-byte aligned: the row width is a multiple of 4).

`dequantize_kv` is the definition the attention ops' tests compare against (with reference.py on the
dequantized values); `quantize_kv` is what the cache layers write.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import cpu_lib

# Names users pass as kv_cache_dtype -> storage dtype.
KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "float8_e4m3fn": torch.float8_e4m3fn}
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
_LARGEST = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_BYTES = 4


def storage_dtype(kv_cache_dtype) -> torch.dtype | None:
    """The storage dtype for a user's `kv_cache_dtype` ("int8", "fp8", a torch dtype, or None = the
    model's own dtype, returned as None)."""
    if kv_cache_dtype is None or kv_cache_dtype in QUANTIZED_DTYPES:
        return kv_cache_dtype
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype.lower() in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[kv_cache_dtype.lower()]
    raise ValueError(f"kv_cache_dtype must be None, 'int8' or 'fp8' (e4m3), got {kv_cache_dtype!r}")


def is_quantized(t: Tensor) -> bool:
    return t.dtype in QUANTIZED_DTYPES


def scale_offset(head_dim: int) -> int:
    """Byte offset of the fp32 scale in a packed row: the values, padded to a multiple of 4."""
    return -(-head_dim // SCALE_BYTES) * SCALE_BYTES


def packed_width(head_dim: int) -> int:
    return scale_offset(head_dim) + SCALE_BYTES


def row_bytes(head_dim: int, dtype) -> int:
    """Bytes one cached token of one KV head takes in a cache of `dtype` (storage or float dtype, or
    its name: "int8", "fp8", "bfloat16", ...)."""
    if isinstance(dtype, str):
        dtype = KV_CACHE_DTYPES.get(dtype.lower()) or getattr(torch, dtype)
    if dtype in QUANTIZED_DTYPES:
        return packed_width(head_dim)
    return head_dim * torch.empty((), dtype=dtype).element_size()


@cpu_lib.fake("quantize_kv")
def _fake_quantize_kv(x: Tensor, fp8: bool) -> Tensor:
    return x.new_empty((*x.shape[:-1], -(-x.shape[-1] // 4) * 4 + 4), dtype=torch.int8)


def quantize_kv_bytes(x: Tensor, dtype: torch.dtype) -> Tensor:
    """(..., D) float -> (..., packed_width(D)) int8 bytes of the packed rows (module docstring).
    Byte rows let callers write into a cache through an int8 view: CPU torch has no index_copy_ for fp8.
    Eager CPU calls (a prompt's writes) take the one-pass C++ op `fastflow_cpu::quantize_kv`, bitwise
    equal to `quantize_kv_ref`; traced calls (compiled decode steps) the torch code, which Inductor fuses."""
    if x.device.type == "cpu" and not torch.compiler.is_compiling() and cpu_lib.load():
        return torch.ops.fastflow_cpu.quantize_kv(x, dtype == torch.float8_e4m3fn)
    return quantize_kv_ref(x, dtype)


def quantize_kv_ref(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The pure-torch definition of quantize_kv_bytes."""
    largest = _LARGEST[dtype]
    xf = x.to(torch.float32)
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / largest, torch.ones_like(amax))  # a zero row stays exact
    y = (xf / scale).clamp(-largest, largest)
    values = y.round().to(torch.int8) if dtype == torch.int8 else y.to(dtype).view(torch.int8)
    pad = scale_offset(x.shape[-1]) - x.shape[-1]
    parts = [values] + ([values.new_zeros((*x.shape[:-1], pad))] if pad else []) + [scale.view(torch.int8)]
    return torch.cat(parts, -1)


def quantize_kv(x: Tensor, dtype: torch.dtype) -> Tensor:
    """(..., D) float -> packed rows in the storage dtype."""
    return quantize_kv_bytes(x, dtype).view(dtype)


def row_scales(packed: Tensor, head_dim: int) -> Tensor:
    """(..., 1) fp32 scales of packed rows (a view when the rows are)."""
    off = scale_offset(head_dim) // SCALE_BYTES
    return packed.view(torch.int8).view(torch.float32)[..., off:off + 1]


def dequantize_kv(packed: Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """(..., packed_width(D)) packed rows -> (..., D) values in `dtype` (computed in fp32, or float64
    when asked: the stored values and scales are exact in both)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return (packed[..., :head_dim].to(acc) * row_scales(packed, head_dim).to(acc)).to(dtype)


def check_packed(q: Tensor, k: Tensor, v: Tensor) -> None:
    """K and V must both be packed in one format whose width matches q's head dim."""
    width = packed_width(q.shape[-1])
    if k.dtype != v.dtype or k.shape[-1] != width or v.shape[-1] != width:
        raise ValueError(f"quantized K/V must share a dtype and have rows of packed_width({q.shape[-1]}) = "
                         f"{width} bytes; got {k.dtype}/{v.dtype} of widths {k.shape[-1]}/{v.shape[-1]}")


def dequantized(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """K and V as q's dtype: themselves when float, dequantized when packed (the ops' CPU paths)."""
    if not is_quantized(k):
        return k, v
    check_packed(q, k, v)
    return dequantize_kv(k, q.shape[-1], q.dtype), dequantize_kv(v, q.shape[-1], q.dtype)


def triton_kv_args(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """What the Triton kernels take for K and V: (k data, v data, k scales, v scales, KV_QUANT,
    SCALE_OFF). Float caches: themselves (the scale pointers unused), KV_QUANT 0. Quantized: the
    bytes (fp8 as uint8: the kernels decode e4m3 bit by bit, which every GPU and the interpreter
    can), the same storage seen as fp32 for the scales (row r's scale at fp32 index
    (byte offset of r + SCALE_OFF) / 4), KV_QUANT 1 (int8) or 2 (fp8)."""
    if not is_quantized(k):
        return k, v, k, v, 0, 0
    check_packed(q, k, v)
    code = 1 if k.dtype == torch.int8 else 2
    data = (k, v) if code == 1 else (k.view(torch.uint8), v.view(torch.uint8))
    return (*data, k.view(torch.float32), v.view(torch.float32), code, k.shape[-1] - SCALE_BYTES)
