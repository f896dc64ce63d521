"""Quantized linears: `torch.ops.fastflow.int8_linear`, `int4_linear`, `w8a8_linear`, `fp8_linear`.

Each op has a pure-torch reference (`*_ref`, built on ffl_backend.numerics: the one every path is
tested against), a CPU path and, for CUDA tensors, a Triton launcher from triton_quant.py. Layouts:
see numerics.py.

CPU paths (the choices' measurements: docs/quantization.md and benchmarks/results/cpu_gemv_layers.json):
- int8: `torch._weight_int8pack_mm` with bf16 activations and bf16 scales (with fp32 activations the
  same kernel is slower than an fp32 F.linear, so fp32 x is cast to bf16 and the result back: x and
  the scales rounded to bf16, far below the int8 weight error). Eager single-row calls (batch-1
  decode without torch.compile) take fastflow's C++ GEMV instead (kernels/cpu_gemv.py; fp32 math).
- int4: fastflow's `int4_gemv` (kernels/int4_layout.py, cpu_gemv.cpp) wherever the C++ library is
  built and N is a multiple of 16: the codes multiplied as they load, x read as int16 per group
  (error <= 2^-16 of the group's largest |x|, finer than a bf16 rounding), several rows per pass
  over the codes. The layout is made once by `int4_cpu_form`. Elsewhere torch's
  `_weight_int4pack_mm_for_cpu` (bf16 x, the same cast), which needs torch's own packed weight and a
  (K/G, N, 2) scale/zero table (w = (q - 8) * s + z', the grid both kernels use); N a multiple of
  16 and G in {32, 64, 128, 256}, else the reference path runs.
- w8a8: `torch._int_mm` (int8 x int8 -> int32, exact).
- fp8: emulation -- activations and weights go through the e4m3 grid, the product runs in fp32.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .. import numerics as P
from . import autotune, cpu_gemm, cpu_gemv, int4_layout, triton_quant
from ._triton import on_triton_device, rows_2d

# torch's CPU int4 kernel accepts only these group sizes, and N in multiples of 16.
INT4_CPU_GROUPS = (32, 64, 128, 256)
INT4_CPU_N_MULTIPLE = 16
# torch 2.13's CPU int8 kernel (`_weight_int8pack_mm`) reads K in blocks: with K not a multiple of 16
# it segfaults for M > 1 (and for M = 1 unless K % 4 == 0). Such layers take the reference path.
INT8_CPU_K_MULTIPLE = 16



def _finish(y2d: Tensor, x: Tensor, bias: Optional[Tensor]) -> Tensor:
    """Add the bias in the accumulation dtype, round once to x's dtype, restore x's leading dims."""
    if bias is not None:
        y2d = y2d + bias.to(y2d.dtype)
    return y2d.to(x.dtype).reshape(*x.shape[:-1], y2d.shape[-1])


# --- references -----------------------------------------------------------------------------------

def smoothed_rows(x: Tensor, smooth: Optional[Tensor]) -> Tensor:
    """x as (M, K) rows, times SmoothQuant's `smooth` (K,) in the accumulation dtype: the one order of
    operations of the reference and of every device path. Multiplying in bf16 instead rounds x * smooth
    to 8 bits before quantization, which moves int8 codes (up to 127) by one and more."""
    x2d = x.reshape(-1, x.shape[-1])
    if smooth is None:
        return x2d
    return x2d.to(P.acc_dtype(x)) * smooth.to(P.acc_dtype(x))


def int8_linear_ref(x: Tensor, qweight: Tensor, scale: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    acc = P.acc_dtype(x)
    w = P.dequantize_int8(qweight, scale, acc)
    return _finish(x.reshape(-1, x.shape[-1]).to(acc) @ w.T, x, bias)


def int4_linear_ref(x: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor, group_size: int,
                    bias: Optional[Tensor] = None) -> Tensor:
    acc = P.acc_dtype(x)
    w = P.dequantize_int4(qweight, scale, zero, group_size, acc)
    return _finish(x.reshape(-1, x.shape[-1]).to(acc) @ w.T, x, bias)


def w8a8_linear_ref(x: Tensor, qweight: Tensor, w_scale: Tensor, x_scale: Optional[Tensor] = None,
                    bias: Optional[Tensor] = None, smooth: Optional[Tensor] = None) -> Tensor:
    """`smooth` (K,) multiplies x before quantization (SmoothQuant's 1/s when it could not be folded
    into the previous norm); `x_scale` None = dynamic per-token scales."""
    qx, xs = P.quantize_act_int8(smoothed_rows(x, smooth), x_scale)
    acc = qx.to(torch.float64) @ qweight.to(torch.float64).T  # exact, like the int32 accumulator
    return _finish(acc.to(P.acc_dtype(x)) * xs.to(P.acc_dtype(x)) * w_scale.to(P.acc_dtype(x)), x, bias)


def fp8_linear_ref(x: Tensor, qweight: Tensor, w_scale: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    acc = P.acc_dtype(x)
    qx, xs = P.quantize_act_fp8(x.reshape(-1, x.shape[-1]))
    y = (qx.to(acc) @ qweight.to(acc).T) * xs.to(acc) * w_scale.to(acc)
    return _finish(y, x, bias)


# --- CPU paths ------------------------------------------------------------------------------------

# Rows from which a bf16 int8/int4 linear on a CPU with native bf16 matrix instructions (AMX or
# AVX-512-BF16) widens its weight to bf16 and runs one oneDNN GEMM instead of the row kernels: a
# prompt's linears (benchmarks/prefill_linear_paths.py; benchmarks/results/prefill_linear_paths_cpu_xeon.json).
# Widening costs one pass over the weight, which enough rows repay; how many is searched per machine
# and weight shape (autotune.py), WIDEN_MIN_ROWS where the search is off. Numerics: the weight
# rounded once to bf16 (q * s for int8, (q - 8) * s + z' for int4), products in fp32.
# Below that, and on CPUs without those instructions, fastflow's GEMM (cpu_gemm.py: AMX tiles over
# blocks widened in L1, else fp32 tiles) takes over from the row kernels at a row count searched the same way.
WIDEN_MIN_ROWS = 32
WIDEN_ROW_CHOICES = (WIDEN_MIN_ROWS, 8, 16, 64, 128, 256, 1 << 30)  # the last: never widen
# the prompt sizes a threshold is judged on: 512 too, where the AMX GEMM below can win every smaller size
# and still lose a long prompt to widening (docs/performance.md#prompts-on-amx)
_TUNING_ROWS = (8, 16, 32, 64, 128, 512)


def _widens(x: Tensor, kind: str, n: int, k: int) -> bool:
    """Whether a quantized linear of `x` takes the widen-then-oneDNN path (see WIDEN_MIN_ROWS)."""
    rows = x.numel() // x.shape[-1]
    return (x.dtype == torch.bfloat16 and rows >= min(WIDEN_ROW_CHOICES) and cpu_gemm.native_bf16_matmul()
            and rows >= widen_min_rows(kind, n, k))


def widen_min_rows(kind: str, n: int, k: int) -> int:
    """The row count from which `kind` ("int8" or "int4") widens an (n, k) weight on this machine
    (autotune.row_threshold over a random weight: widening against what runs below its threshold --
    fastflow's GEMM from its own threshold, else the row kernel)."""
    # the GEMM's own threshold first: a search inside another would wait on autotune's lock
    gemm_from = cpu_gemm.prompt_gemm_min_rows(kind, n, k, _gemm_paths(kind, n, k)) if cpu_gemm.available() else None

    def make() -> dict:
        row_kernel, widen, gemm = _candidate_paths(kind, n, k)

        def below(x):
            rows = x.numel() // x.shape[-1]
            return (gemm if gemm_from is not None and rows >= gemm_from else row_kernel)(x)

        return {False: below, True: widen}

    return autotune.row_threshold(f"widen_min_rows:{kind}", (n, k), WIDEN_ROW_CHOICES, _TUNING_ROWS, make)


def _gemm_paths(kind: str, n: int, k: int):
    """For cpu_gemm's threshold search: a maker of {False: the row kernel, True: fastflow's GEMM} of an
    int8 / int4 linear with a random (n, k) weight."""
    def make() -> dict:
        row_kernel, _, gemm = _candidate_paths(kind, n, k)
        return {False: row_kernel, True: gemm}

    return make


def _candidate_paths(kind: str, n: int, k: int) -> tuple:
    """The paths a threshold search times: (row kernel, widen then oneDNN GEMM, fastflow GEMM) for a
    `kind` linear of random (n, k) codes. Codes and scales are drawn as they are stored, never from a
    float weight: the kernels' speed does not depend on the values, and a 128k-vocabulary head's float
    weight and its rounding temporaries would be a transient gigabyte, at the peak of quantizing a model."""
    if kind == "int8":
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        s = (torch.rand(n) / 127 / k**0.5).to(torch.bfloat16)
        return (lambda x: torch._weight_int8pack_mm(x, q, s),
                lambda x: torch.nn.functional.linear(x, q.to(torch.bfloat16) * s[:, None]),
                lambda x: torch.ops.fastflow_cpu.gemm(x, q, s, None))
    group = INT4_CPU_GROUPS[0]
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    s = (torch.rand(n, k // group) / 8 / k**0.5).to(torch.bfloat16)
    z = (torch.rand(n, k // group) * 15).to(torch.bfloat16)
    packed, sz = int4_cpu_form(P.pack_int4(q), s, z, group)
    return (lambda x: int4_cpu_linear(x, packed, sz, group, None, path="rows"),
            lambda x: int4_cpu_linear(x, packed, sz, group, None, path="widen"),
            lambda x: int4_cpu_linear(x, packed, sz, group, None, path="gemm"))


def int4_cpu_form(qweight: Tensor, scale: Tensor, zero: Tensor, group_size: int):
    """The CPU kernels' form of an int4 weight, made once at quantize or load time: fastflow's
    `int4_gemv` layout ((N/16, K/8, 64) codes, (N/16, K/G, 2, 16) scale/zero) where that kernel is
    built and takes the shape (faster than torch's at batch 1, docs/performance.md#cpu-decode-gemvs;
    and it reads x in fp32), else torch's pack (`int4_cpu_pack`), else (None, None): the reference."""
    if int4_layout_applies(qweight, group_size):
        return int4_layout.int4_layout_from_portable(qweight, scale, zero, group_size)
    return int4_cpu_pack(qweight, scale, zero, group_size)


def int4_layout_applies(qweight: Tensor, group_size: int) -> bool:
    """Whether the CPU form of this (N, K/2) int4 weight is fastflow's `int4_gemv` layout: a CPU weight
    whose shape it takes, the kernel built."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    return qweight.device.type == "cpu" and int4_layout.int4_layout_fits(n, k, group_size) and cpu_gemv.ready()


def int4_cpu_form_fused(qweights: list, scales: list, zeros: list, group_size: int):
    """The CPU form of sibling int4 weights' row concatenation (one K and group size), made in one
    pass (`int4_layout_pack`) where fastflow's layout takes every member: (packed, scale_zeros), each
    member's form the slice of its blocks of 16 rows. None where it does not: each member then makes
    its own form (`int4_cpu_form`)."""
    k = qweights[0].shape[1] * 2
    if not all(q.shape[1] * 2 == k and int4_layout_applies(q, group_size) for q in qweights):
        return None
    return int4_layout.int4_layout_from_portables(qweights, scales, zeros, group_size)


def int4_cpu_codes(packed: Tensor, n: int, k: int) -> Optional[Tensor]:
    """The portable (n, k/2) codes back from either CPU form, or None where that is not known here."""
    if packed.dim() == 3:
        return int4_layout.portable_codes(packed)
    return int4_cpu_unpack(packed, n, k)


def int4_cpu_pack(qweight: Tensor, scale: Tensor, zero: Tensor, group_size: int):
    """(torch-packed weight, (K/G, N, 2) bf16 scale-and-zero) for `_weight_int4pack_mm_for_cpu`,
    or (None, None) where that kernel does not apply.
    torch's grid is w = (q - 8) * s + z'; ours is (q - zero) * s, so z' = (8 - zero) * s."""
    n = qweight.shape[0]
    if group_size not in INT4_CPU_GROUPS or n % INT4_CPU_N_MULTIPLE or qweight.device.type != "cpu":
        return None, None
    codes = P.unpack_int4(qweight).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    return packed, int4_cpu_scale_zeros(scale, zero)


int4_cpu_scale_zeros = int4_layout.int4_scale_zero_table  # torch's (K/G, N, 2) table, both kernels' grid


# torch's CPU int4 packing (`_convert_weight_to_int4pack_for_cpu`, torch 2.13) of N rows a multiple of
# 64: per block of B rows, K x B/2 bytes whose low nibble is row j and high nibble row B/2 + j of the
# block. B depends on the CPU torch runs on (64 with AVX-512, 32 with AVX2 only), so it is found once
# by packing a probe. Other N are laid out otherwise; they keep their portable codes (see Int4Linear).
INT4_CPU_UNPACK_ROWS = 64


def _unpack_blocks(packed: Tensor, n: int, k: int, block: int) -> Tensor:
    blocks = packed.reshape(n // block, k, block // 2)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=2).transpose(1, 2).reshape(n, k)


@functools.cache
def torch_pack_block_rows() -> Optional[int]:
    """The row block B of torch's CPU int4 pack on this CPU (None: a layout not known here)."""
    codes = torch.randint(0, 16, (INT4_CPU_UNPACK_ROWS, 16), generator=torch.Generator().manual_seed(0))
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    for block in (64, 32, 16):
        if torch.equal(_unpack_blocks(packed, *codes.shape, block), codes.to(packed.dtype)):
            return block
    return None


def int4_cpu_unpack(packed: Tensor, n: int, k: int) -> Optional[Tensor]:
    """The portable (n, k/2) codes back from torch's CPU pack of them, or None where that layout is not
    known here (n not a multiple of 64). Callers compare the round trip before relying on it."""
    if n % INT4_CPU_UNPACK_ROWS or tuple(packed.shape) != (n, k // 2) or packed.dtype != torch.uint8:
        return None
    block = torch_pack_block_rows()
    return None if block is None else P.pack_int4(_unpack_blocks(packed, n, k, block))


def _single_row_kernel_applies(x: Tensor, qweight: Tensor, scale: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether an eager single-row int8 call can take the C++ decode GEMV (`cpu_gemv`). Never while
    compiling: there the decode_gemv family decides, and plain Inductor keeps torch's kernel."""
    return not torch.compiler.is_compiling() and cpu_gemv.takes(x, qweight, scale, bias) and cpu_gemv.ready()


def _int8_cpu(x: Tensor, qweight: Tensor, scale: Tensor, bias: Optional[Tensor],
              cpu_scale: Optional[Tensor]) -> Tensor:
    # batch-1 eager decode: fp32 math, faster than torch's int8 kernel (docs/performance.md#cpu-decode-gemvs)
    if _single_row_kernel_applies(x, qweight, scale, bias):
        return torch.ops.fastflow_cpu.gemv(x, [qweight], [scale], [] if bias is None else [bias])
    # The bf16 scale must be a real buffer: Inductor's int8pack_mm lowering (torch 2.13) does not
    # realize its scale argument and fails on an in-graph cast, so fp32 models keep a bf16 copy.
    if scale.dtype == torch.bfloat16:
        cpu_scale = scale
    elif cpu_scale is None:  # direct eager calls only; quantized modules always pass cpu_scale
        cpu_scale = scale.to(torch.bfloat16)
    if _widens(x, "int8", *qweight.shape):
        return torch.nn.functional.linear(x, qweight.to(torch.bfloat16) * cpu_scale[:, None], bias)
    if cpu_gemm.use_gemm(x, "int8", *qweight.shape, _gemm_paths("int8", *qweight.shape)):  # a prompt, no native bf16
        return torch.ops.fastflow_cpu.gemm(x, qweight, scale, bias)
    if qweight.shape[1] % INT8_CPU_K_MULTIPLE:
        return int8_linear_ref(x, qweight, scale, bias)
    x2d = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    return _finish(torch._weight_int8pack_mm(x2d, qweight, cpu_scale), x, bias)


def int4_cpu_linear(x: Tensor, packed: Tensor, scale_zeros: Tensor, group_size: int,
                    bias: Optional[Tensor], path: Optional[str] = None) -> Tensor:
    """An int4 linear on either CPU form (`int4_cpu_form`). `path` forces one ("rows": the row kernel,
    "widen": widen to bf16 then oneDNN, "gemm": fastflow's fp32 GEMM; needs fastflow's layout);
    None: decided by the rows and the machine (WIDEN_MIN_ROWS, cpu_gemm.py)."""
    fastflow_layout = packed.dim() == 3
    if path is None and fastflow_layout:
        n, k = packed.shape[0] * 16, packed.shape[1] * 8
        gemm = cpu_gemm.use_gemm(x, "int4", n, k, _gemm_paths("int4", n, k))
        path = "widen" if _widens(x, "int4", n, k) else "gemm" if gemm else "rows"
    if path == "widen":
        weight = torch.ops.fastflow_cpu.int4_widen(packed, scale_zeros, group_size)
        return torch.nn.functional.linear(x, weight, bias)
    if path == "gemm":
        return torch.ops.fastflow_cpu.int4_gemm(x, packed, scale_zeros, bias, group_size)
    if fastflow_layout:  # the kernel takes fp32/bf16/fp16 rows and returns x's dtype
        if x.dtype in cpu_gemv.ACTIVATION_DTYPES:
            return torch.ops.fastflow_cpu.int4_gemv(x, packed, scale_zeros, bias, group_size)
        return torch.ops.fastflow_cpu.int4_gemv(x.float(), packed, scale_zeros, bias, group_size).to(x.dtype)
    x2d = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    y = torch._weight_int4pack_mm_for_cpu(x2d, packed, group_size, scale_zeros.to(torch.bfloat16))
    return _finish(y, x, bias)


@functools.cache
def int_mm_is_exact() -> bool:
    """Whether `torch._int_mm` sums int8 products exactly on this CPU. oneDNN's int8 GEMM without VNNI
    (AVX2 CPUs, or ONEDNN_MAX_CPU_ISA=AVX2) multiplies with vpmaddubsw, whose 16-bit pair sums
    saturate: on a worst-case probe it was off by ~4e4 of ~1e6, and on SmolLM2's activations it cost
    W8A8 about a point of perplexity. Asked of torch itself, once."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # first asked while Inductor traces the op: real tensors, please
        a = torch.full((8, 64), 127, dtype=torch.int8)  # u8 * s8 pairs of 255 * 127: past int16
        b = torch.full((64, 8), 127, dtype=torch.int8)
        b[:, 1::2] = -128
        return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())


def _w8a8_cpu(x: Tensor, qweight: Tensor, w_scale: Tensor, x_scale: Optional[Tensor],
              bias: Optional[Tensor], smooth: Optional[Tensor]) -> Tensor:
    qx, xs = P.quantize_act_int8(smoothed_rows(x, smooth).float(), x_scale)
    if int_mm_is_exact():
        acc = torch._int_mm(qx, qweight.T).float()  # (K, N) view of the row-major weight: no copy
    elif cpu_gemm.available():  # the codes as fp32 through fastflow's GEMM: each product exact, sums in fp32
        acc = torch.ops.fastflow_cpu.gemm(qx.float(), qweight, None, None)
    else:
        acc = qx.float() @ qweight.float().T
    return _finish(acc * xs * w_scale.float(), x, bias)


# --- ops ------------------------------------------------------------------------------------------

def calls_cpu_body(x: Tensor) -> bool:
    """Whether a quantized module may call its op's CPU body directly (`int8_linear_cpu`,
    `int4_linear_cpu`): eager CPU inference. The dispatcher's trip into a triton_op's Python body costs
    tens of microseconds a call, a large share of a short prompt's linears
    (docs/performance.md#decode-attention-packed-linears-and-prompts); traced calls keep the op (the
    pattern families match it), and so do calls that need gradients (the op refuses them)."""
    return x.device.type == "cpu" and not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def int8_linear_cpu(x: Tensor, qweight: Tensor, scale: Tensor, bias: Optional[Tensor] = None,
                    cpu_scale: Optional[Tensor] = None) -> Tensor:
    """`int8_linear`'s CPU body (see `calls_cpu_body`)."""
    return _int8_cpu(x, qweight, scale, bias, cpu_scale)


def w8a8_triton(x: Tensor, qweight: Tensor, w_scale: Tensor, x_scale: Optional[Tensor] = None,
                bias: Optional[Tensor] = None, smooth: Optional[Tensor] = None) -> Tensor:
    """The CUDA path of `w8a8_linear` (also runs on CPU tensors under TRITON_INTERPRET, for tests).
    With `smooth` the kernels get the fp32 product `smoothed_rows` makes and return fp32, rounded
    once to x's dtype here: the reference's single rounding after the bias add."""
    x2d = rows_2d(x) if smooth is None else smoothed_rows(x, smooth)
    y = triton_quant.w8a8_linear_triton(x2d, qweight, w_scale, x_scale, bias).to(x.dtype)
    return y.reshape(*x.shape[:-1], qweight.shape[0])


@torch.library.triton_op("fastflow::int8_linear", mutates_args=())
def int8_linear(x: Tensor, qweight: Tensor, scale: Tensor, bias: Optional[Tensor] = None,
                cpu_scale: Optional[Tensor] = None) -> Tensor:
    """`cpu_scale`: `scale` in bf16 for the CPU kernel, when `scale` is not bf16 already."""
    if on_triton_device(x):
        y = triton_quant.int8_linear_triton(rows_2d(x), qweight, scale, bias)
        return y.reshape(*x.shape[:-1], qweight.shape[0])
    return _int8_cpu(x, qweight, scale, bias, cpu_scale)


@torch.library.triton_op("fastflow::int4_linear", mutates_args=())
def int4_linear(x: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor, group_size: int,
                bias: Optional[Tensor] = None, cpu_packed: Optional[Tensor] = None,
                cpu_scale_zeros: Optional[Tensor] = None) -> Tensor:
    """`cpu_packed`/`cpu_scale_zeros`: a CPU form from `int4_cpu_form` (None -> reference)."""
    if on_triton_device(x):
        y = triton_quant.int4_linear_triton(rows_2d(x), qweight, scale, zero, group_size, bias)
        return y.reshape(*x.shape[:-1], qweight.shape[0])
    return int4_linear_cpu(x, qweight, scale, zero, group_size, bias, cpu_packed, cpu_scale_zeros)


def int4_linear_cpu(x: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor, group_size: int,
                    bias: Optional[Tensor] = None, cpu_packed: Optional[Tensor] = None,
                    cpu_scale_zeros: Optional[Tensor] = None) -> Tensor:
    """`int4_linear`'s CPU body (see `calls_cpu_body`)."""
    if cpu_packed is not None and cpu_scale_zeros is not None:
        return int4_cpu_linear(x, cpu_packed, cpu_scale_zeros, group_size, bias)
    return int4_linear_ref(x, qweight, scale, zero, group_size, bias)


@torch.library.triton_op("fastflow::w8a8_linear", mutates_args=())
def w8a8_linear(x: Tensor, qweight: Tensor, w_scale: Tensor, x_scale: Optional[Tensor] = None,
                bias: Optional[Tensor] = None, smooth: Optional[Tensor] = None) -> Tensor:
    if on_triton_device(x):
        return w8a8_triton(x, qweight, w_scale, x_scale, bias, smooth)
    return _w8a8_cpu(x, qweight, w_scale, x_scale, bias, smooth)


@torch.library.triton_op("fastflow::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, qweight: Tensor, w_scale: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    if on_triton_device(x):
        y = triton_quant.fp8_linear_triton(rows_2d(x), qweight, w_scale, bias)
        return y.reshape(*x.shape[:-1], qweight.shape[0])
    return fp8_linear_ref(x, qweight, w_scale, bias)  # the emulation is the reference


def _fake_linear(x: Tensor, qweight: Tensor, *args, **kwargs) -> Tensor:
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


for _op in (int8_linear, int4_linear, w8a8_linear, fp8_linear):
    _op.register_fake(_fake_linear)
