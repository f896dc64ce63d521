"""`torch.ops.fastflow_cpu.int4_gemv` and `int4_widen`: the weight layout, references and fakes (the
kernels: cpu_gemv.cpp, cpu_widen.cpp); `int4_layout_pack` / `int4_layout_unpack`, which make that
layout from the portable codes and back, and `int4_layout_table`, its scale/zero half alone, for codes
saved in the layout (cpu_int4_layout.cpp).

    int4_gemv(x, packed, scale_zeros, bias or None, G) = x @ W.T + bias, W group-wise int4

The layout puts 16 rows to a vector over torch's CPU int4 grid w = (q - 8) * s + z'; the kernel
multiplies the codes as they load with AVX512-VNNI (AVX2-only CPUs: vpmaddubsw + vpmaddwd), x read
as int16 per group (cpu_gemv.cpp says why). Int4 modules hold their CPU weights in this layout and
call the kernel for every row count (kernels/quant_linear.py `int4_cpu_form`).

The layout is made once per weight, after quantizing or loading: `int4_layout_from_portable` (the C++
op, one pass; its reference `int4_layout_from_portable_ref`, torch's unpack / stack / permute, took
~10 s per billion weights), and read back for saving by `portable_codes`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..numerics import acc_dtype, pack_int4, unpack_int4
from . import cpu_lib

# int4_gemv's layout (cpu_gemv.cpp): rows in blocks of 16 (the lanes of one vector), K in chunks of 8
INT4_ROWS, INT4_CHUNK = 16, 8


def int4_layout_fits(n: int, k: int, group_size: int) -> bool:
    """Whether an (n, k) int4 matrix with this group size has an `int4_gemv` layout."""
    return n % INT4_ROWS == 0 and group_size % INT4_CHUNK == 0 and k % group_size == 0 and n > 0


def int4_scale_zero_table(scale: Tensor, zero: Tensor) -> Tensor:
    """torch's CPU int4 (K/G, N, 2) bf16 table of (s, z') for our (N, K/G) scale and zero point.
    torch's grid is w = (q - 8) * s + z'; ours is (q - zero) * s, so z' = (8 - zero) * s, in fp32."""
    s = scale.float()
    zp = (8.0 - zero.float()) * s
    return torch.stack([s.T, zp.T], dim=-1).to(torch.bfloat16).contiguous()


def int4_layout(codes: Tensor, scale_zeros: Tensor, group_size: int) -> tuple:
    """(packed, scale_zeros) for `int4_gemv` from (N, K) codes 0..15 and torch's CPU int4 scale/zero
    table ((K/G, N, 2) bf16, w = (q - 8) * s + z'): the same values, laid out 16 rows to a vector."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).reshape(n // INT4_ROWS, INT4_ROWS, k // INT4_CHUNK, 2, INT4_CHUNK // 2)
    packed = (blocks[:, :, :, 0] | (blocks[:, :, :, 1] << 4)).permute(0, 2, 1, 3)
    return packed.reshape(n // INT4_ROWS, k // INT4_CHUNK, 4 * INT4_ROWS).contiguous(), _table_layout(scale_zeros, n)


def _table_layout(scale_zeros: Tensor, n: int) -> Tensor:
    """torch's (K/G, N, 2) table laid out as `int4_gemv` reads it: (N/16, K/G, 2, 16) bf16."""
    groups = scale_zeros.reshape(scale_zeros.shape[0], n // INT4_ROWS, INT4_ROWS, 2).permute(1, 0, 3, 2)
    return groups.to(torch.bfloat16).contiguous()


def int4_layout_codes(packed: Tensor) -> Tensor:
    """The (N, K) codes of an `int4_gemv` packed tensor (the inverse of `int4_layout`'s first half)."""
    nb, chunks, _ = packed.shape
    b = packed.reshape(nb, chunks, INT4_ROWS, INT4_CHUNK // 2).permute(0, 2, 1, 3)
    return torch.stack([b & 0xF, b >> 4], dim=3).reshape(nb * INT4_ROWS, chunks * INT4_CHUNK)


def int4_layout_from_portable_ref(qweight: Tensor, scale: Tensor, zero: Tensor, group_size: int) -> tuple:
    """(packed, scale_zeros) for `int4_gemv` from the portable (N, K/2) codes (numerics.pack_int4) and
    (N, K/G) scale and zero point: the reference of `int4_layout_pack`."""
    return int4_layout(unpack_int4(qweight), int4_scale_zero_table(scale, zero), group_size)


def _op_applies(t: Tensor) -> bool:
    return t.device.type == "cpu" and cpu_lib.load()


def int4_layout_from_portable(qweight: Tensor, scale: Tensor, zero: Tensor, group_size: int) -> tuple:
    """`int4_layout_from_portable_ref`, by the C++ op where the library is built (bit-equal)."""
    return int4_layout_from_portables([qweight], [scale], [zero], group_size)


def int4_layout_from_portables(qweights: list, scales: list, zeros: list, group_size: int) -> tuple:
    """The layout of the row concatenation of several weights of one K (sibling projections: each
    one's rows a multiple of 16, so its part is a slice of blocks), made in one pass without
    concatenating anything first: equal to `int4_layout_from_portable_ref` of the concatenation."""
    if _op_applies(qweights[0]):
        return torch.ops.fastflow_cpu.int4_layout_pack(list(qweights), list(scales), list(zeros), group_size)
    cat = (torch.cat(list(parts)) if len(parts) > 1 else parts[0] for parts in (qweights, scales, zeros))
    return int4_layout_from_portable_ref(*cat, group_size)


def int4_layout_tables(scales: list, zeros: list, group_size: int) -> Tensor:
    """The scale/zero half of `int4_layout_from_portables`: for codes already in the layout (saved so)."""
    if _op_applies(scales[0]):
        return torch.ops.fastflow_cpu.int4_layout_table(list(scales), list(zeros), group_size)
    scale, zero = (torch.cat(list(parts)) if len(parts) > 1 else parts[0] for parts in (scales, zeros))
    return _table_layout(int4_scale_zero_table(scale, zero), scale.shape[0])


def portable_codes(packed: Tensor) -> Tensor:
    """The portable (N, K/2) codes of an `int4_gemv` packed tensor (pack_int4 of `int4_layout_codes`)."""
    if _op_applies(packed):
        return torch.ops.fastflow_cpu.int4_layout_unpack(packed)
    return pack_int4(int4_layout_codes(packed))


def int4_layout_weight(packed: Tensor, scale_zeros: Tensor, group_size: int) -> Tensor:
    """The (N, K) weight (q - 8) * s + z' in fp32 that an `int4_gemv` layout holds."""
    codes = int4_layout_codes(packed).float()
    sz = scale_zeros.float().permute(0, 3, 1, 2).reshape(codes.shape[0], -1, 2)  # (N, K/G, 2)
    s, zp = (sz[..., i].repeat_interleave(group_size, dim=1) for i in (0, 1))
    return (codes - 8) * s + zp


def int4_gemv_ref(x: Tensor, packed: Tensor, scale_zeros: Tensor, bias: Optional[Tensor], group_size: int) -> Tensor:
    """Pure-torch reference of `int4_gemv`: the dequantized weight in fp32, x @ w.T (+ bias) in fp32,
    x's dtype out. (The kernel reads x as int16 per group: relative error ~1e-5.)"""
    acc = acc_dtype(x)
    y = x.to(acc) @ int4_layout_weight(packed, scale_zeros, group_size).to(acc).T
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def int4_widen_ref(packed: Tensor, scale_zeros: Tensor, group_size: int) -> Tensor:
    """Pure-torch reference of `int4_widen` (cpu_widen.cpp): the weight rounded once to bf16."""
    return int4_layout_weight(packed, scale_zeros, group_size).to(torch.bfloat16)


@cpu_lib.fake("int4_gemv")
def _fake_int4_gemv(x: Tensor, packed, scale_zeros, bias, group_size: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0] * INT4_ROWS))


@cpu_lib.fake("int4_layout_pack")
def _fake_int4_layout_pack(qweights: list, scales: list, zeros: list, group_size: int) -> tuple:
    n, k = sum(q.shape[0] for q in qweights), qweights[0].shape[1] * 2
    return (qweights[0].new_empty((n // INT4_ROWS, k // INT4_CHUNK, 4 * INT4_ROWS)),
            qweights[0].new_empty((n // INT4_ROWS, k // group_size, 2, INT4_ROWS), dtype=torch.bfloat16))


@cpu_lib.fake("int4_layout_table")
def _fake_int4_layout_table(scales: list, zeros: list, group_size: int) -> Tensor:
    n = sum(s.shape[0] for s in scales)
    return scales[0].new_empty((n // INT4_ROWS, scales[0].shape[1], 2, INT4_ROWS), dtype=torch.bfloat16)


@cpu_lib.fake("int4_layout_unpack")
def _fake_int4_layout_unpack(packed: Tensor) -> Tensor:
    return packed.new_empty((packed.shape[0] * INT4_ROWS, packed.shape[1] * INT4_CHUNK // 2))


@cpu_lib.fake("int4_widen")
def _fake_int4_widen(packed: Tensor, scale_zeros, group_size: int) -> Tensor:
    return packed.new_empty((packed.shape[0] * INT4_ROWS, packed.shape[1] * 8), dtype=torch.bfloat16)
