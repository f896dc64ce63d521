"""Triton kernels for quantized linears (CUDA): W8A16, W4A16, W8A8 (int8 x int8 -> int32) and FP8.

Only the kernels and their launchers live here; the ops (quant_linear.py) call the launchers on CUDA
tensors and hold the references every path is tested against (with numerics.py's quantize functions).
Layouts (x2d is (M, K) fp16/bf16/fp32, the output (M, N) in x's dtype):
- int8:  qweight int8 (N, K), scale (N,) in x's dtype; y = x @ (q * scale).T + bias.
- int4:  qweight uint8 (N, K // 2), byte j of row n holds k = 2j (low nibble) and k = 2j+1 (high
         nibble), values 0..15; scale, zero (N, K // G) in x's dtype; w = (q - zero) * scale.
- w8a8:  qweight int8 (N, K), w_scale (N,) fp32; x quantized per token (dynamic) or with one static
         fp32 scale; y = (xq @ q.T) * x_scale[row] * w_scale[col] + bias.
- fp8:   qweight float8_e4m3fn (N, K), w_scale (N,) fp32; x quantized per token to e4m3 (Hopper).

Numerics: weights reach tl.dot as exact small integers (int8/uint4 values are exact in fp16/bf16),
so every scale and zero point is applied to the fp32 accumulator, never rounded into a bf16 weight.
Quantizing activations rounds half to even, like torch.round and torch's fp8 cast, and divides
with `tl.div_rn` (Triton's `/` is an approximate division on the GPU), so the kernel's int8/e4m3
activations equal the reference's bit for bit.

Tile configs: a GEMV-shaped default for decode (M <= 16: many narrow N-blocks, a long K step) and a
GEMM default for prefill, compiled ahead of time (aot.py); on a GPU the W8A16/W4A16 launches pick
among a few candidates per shape by timing them (triton_tuning.py).
"""
from __future__ import annotations

import inspect

import torch
from torch import Tensor

from . import triton_tuning
from ._triton import (
    AOT_DTYPES,
    AOT_ROW_SIZES,
    HAS_TRITON,
    AotSpec,
    interpreting,
    launch,
    ptr,
    row_block,
    row_warps,
    rows_2d,
    tl,
    triton,
)

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps), the defaults. num_stages stays Triton's default (3), as in
# the AOT run.
GEMV_CONFIG = triton_tuning.GEMV_CANDIDATES[0]
GEMM_CONFIG = triton_tuning.GEMM_CANDIDATES[0]
GEMV_MAX_M = triton_tuning.GEMV_MAX_M
INT4_GROUP_SIZES = (32, 64, 128)
_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gemm_config(m: int, group_size: int | None = None) -> tuple[int, int, int, int]:
    """The default tile for M rows; int4 caps BLOCK_K at the group size so one K step is in one group."""
    return triton_tuning.default_config(m, group_size)


# ------------------------------------------------------------------------- Triton kernels ----

if HAS_TRITON:

    @triton.jit
    def _rint(y):
        # Round half to even for |y| < 2**22 (torch.round's mode): after adding 1.5 * 2**23 no
        # fraction bits are left, so the fp32 add (round-to-nearest-even) does the rounding.
        # libdevice.rint would do the same on the GPU, but the interpreter has no libdevice.
        return (y + 12582912.0) - 12582912.0

    @triton.jit
    def _round_e4m3(y):
        # Round |y| <= 448 to the nearest e4m3 value (half to even, subnormals below 2**-6) in fp32,
        # so the cast to fp8 afterwards is exact. On the GPU cvt.rn would round identically; the
        # interpreter's fp32->fp8 cast does not (no carry into the exponent, subnormals truncated).
        e = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        ulp = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3): 3 mantissa bits
        inv_ulp = ((130 - e) << 23).to(tl.float32, bitcast=True)
        return _rint(y * inv_ulp) * ulp  # powers of two: both products are exact

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, n_cols, x_stride, q_stride,
                           FP8: tl.constexpr, BLOCK: tl.constexpr):
        # One program per token: pass 1 takes the absmax, pass 2 re-reads the row (L2) and stores
        # the rounded, clamped quotient. scale = absmax / qmax; a zero row divides by 1.
        qmax: tl.constexpr = 448.0 if FP8 else 127.0
        row = tl.program_id(0).to(tl.int64)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * x_stride + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.div_rn(tl.max(amax, axis=0), qmax)
        tl.store(s_ptr + row, scale)
        div = tl.where(scale > 0, scale, 1.0)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.minimum(tl.maximum(tl.div_rn(x, div), -qmax), qmax)
            if FP8:
                q = _round_e4m3(y).to(tl.float8e4nv)
            else:
                q = _rint(y).to(tl.int8)
            tl.store(q_ptr + row * q_stride + cols, q, mask=mask)

    @triton.jit
    def _dot_int_weights(a, q, acc, DOT_F32: tl.constexpr):
        # q holds small integers (int8, or 0..15), exact in every float type. int -> fp32 -> x dtype:
        # the interpreter's direct int -> bf16 cast is wrong (it stores the integer as bf16 bits),
        # and so is its bf16 tl.dot (it multiplies the raw uint16 bits), so under the interpreter
        # bf16 runs set DOT_F32: fp32 operands hold bf16 exactly and the products are exact either
        # way, so only the GPU's accumulation order differs. GPU launches never set it.
        # "ieee" keeps fp32 activations off TF32 (16-bit operands ignore it).
        if DOT_F32:
            out = tl.dot(a.to(tl.float32), q.to(tl.float32), acc, input_precision="ieee")
        else:
            out = tl.dot(a, q.to(tl.float32).to(a.dtype), acc, input_precision="ieee")
        return out

    @triton.jit
    def _tile_ptrs(a_ptr, b_ptr, M, N, stride_am, stride_bn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am      # (BM, 1): add k[None, :]
        b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn      # (1, BN): add k[:, None]
        return rm, rn, a_rows, b_cols

    @triton.jit
    def _epilogue(acc, rm, rn, M, N, bias_ptr, out_ptr, stride_om, HAS_BIAS: tl.constexpr):
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _w8a16_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                      HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, PARTIAL_SUMS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # PARTIAL_SUMS (fp32 outputs): each K block's dot starts from zero and is scaled into the
        # total, so no fp32 FMA chain is longer than BLOCK_K; one chain over all of K had an order of
        # magnitude more error than cuBLAS at large K (docs/performance.md#gpu-kernels). The multiply
        # between the dot and the add keeps Triton from folding the add back into the dot's accumulator.
        rm, rn, x_rows, w_cols = _tile_ptrs(x_ptr, w_ptr, M, N, stride_xm, stride_wn, BLOCK_M, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        col_scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            a = tl.load(x_rows + k[None, :], mask=(rm < M)[:, None] & (k < K)[None, :], other=0.0)
            q = tl.load(w_cols + k[:, None], mask=(k < K)[:, None] & (rn < N)[None, :], other=0)
            if PARTIAL_SUMS:
                acc += _dot_int_weights(a, q, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_F32) * col_scale
            else:
                acc = _dot_int_weights(a, q, acc, DOT_F32)
        if not PARTIAL_SUMS:
            acc *= col_scale
        _epilogue(acc, rm, rn, M, N, bias_ptr, out_ptr, stride_om, HAS_BIAS)

    @triton.jit
    def _w4a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, group_size,
                      stride_xm, stride_wn, stride_sn, stride_om, HAS_BIAS: tl.constexpr,
                      DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        # BLOCK_K divides the group size, so one K step has one (scale, zero) per column and
        #   sum_k x_k (q_k - z) s = s * (x . q - z * sum_k x_k)
        # applies both to the fp32 partial product: the dot sees exact 0..15 integers.
        rm, rn, x_rows, w_cols = _tile_ptrs(x_ptr, w_ptr, M, N, stride_xm, stride_wn, BLOCK_M, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        shift = ((rk % 2) * 4)[:, None]  # even k: low nibble, odd k: high nibble
        n_mask = rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            a = tl.load(x_rows + k[None, :], mask=(rm < M)[:, None] & (k < K)[None, :], other=0.0)
            # each byte is loaded for two k (same cache line) instead of an interleave/reshape
            packed = tl.load(w_cols + (k // 2)[:, None], mask=(k < K)[:, None] & n_mask[None, :], other=0)
            q = (packed.to(tl.int32) >> shift) & 0xF
            part = _dot_int_weights(a, q, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_F32)
            g = k0 // group_size
            s = tl.load(s_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
            a_sum = tl.sum(a.to(tl.float32), axis=1)
            acc += (part - a_sum[:, None] * z[None, :]) * s[None, :]
        _epilogue(acc, rm, rn, M, N, bias_ptr, out_ptr, stride_om, HAS_BIAS)

    @triton.jit
    def _scaled_mm_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K,
                          stride_am, stride_wn, stride_om, A_STATIC: tl.constexpr, FP8: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
        # W8A8 (int8 x int8 -> exact int32) and FP8 (e4m3 x e4m3 -> fp32). A is pre-quantized per
        # token with a per-row scale, or (A_STATIC, int8) the float x quantized here with one
        # static scale: the rounding is _quant_rows_kernel's, so both paths share the reference.
        rm, rn, a_rows, w_cols = _tile_ptrs(a_ptr, w_ptr, M, N, stride_am, stride_wn, BLOCK_M, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        if A_STATIC:
            a_scale = tl.load(a_scale_ptr)
        if FP8:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            a = tl.load(a_rows + k[None, :], mask=(rm < M)[:, None] & (k < K)[None, :], other=0.0)
            if A_STATIC:
                a = tl.minimum(tl.maximum(tl.div_rn(a.to(tl.float32), a_scale), -127.0), 127.0)
                a = _rint(a).to(tl.int8)
            w = tl.load(w_cols + k[:, None], mask=(k < K)[:, None] & (rn < N)[None, :], other=0.0)
            # out_dtype named: triton 3.6 defaults it to fp32 and rejects the int32 accumulator
            # FP8: sm_90's tensor cores accumulate fp8 products in ~14 bits, and Triton's default
            # there (max_num_imprecise_acc 2**30) never moves them to fp32, and the error grows with K
            # (docs/performance.md#gpu-kernels). 32 (one wgmma's K) adds every instruction's sum into
            # the fp32 accumulator.
            acc = tl.dot(a, w, acc, out_dtype=acc.dtype, max_num_imprecise_acc=32 if FP8 else None)
        if A_STATIC:
            row_scale = a_scale
        else:
            row_scale = tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)[:, None]
        out = acc.to(tl.float32) * row_scale * tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
        _epilogue(out, rm, rn, M, N, bias_ptr, out_ptr, stride_om, HAS_BIAS)


# ------------------------------------------------------------------------------ launchers ----

def _check(x2d: Tensor, qweight: Tensor, k_per_col: int = 1):
    if x2d.dim() != 2 or x2d.dtype not in _X_DTYPES:
        raise ValueError(f"x2d must be a 2-D fp16/bf16/fp32 tensor, got {tuple(x2d.shape)} {x2d.dtype}")
    x2d, qweight = rows_2d(x2d), qweight.contiguous()
    if qweight.dim() != 2 or qweight.shape[1] * k_per_col != x2d.shape[1]:
        raise ValueError(f"qweight {tuple(qweight.shape)} does not match K={x2d.shape[1]}")
    out = torch.empty((x2d.shape[0], qweight.shape[0]), dtype=x2d.dtype, device=x2d.device)
    return x2d, qweight, out


def _gemm(kernel, x2d, out, bias, head, tail, group_size=None, **flags):
    """Launch over (M-blocks, N-blocks) the kernel(*head, bias, out, M, N, K, *tail, stride_om)."""
    (m, k), n = x2d.shape, out.shape[1]
    if m == 0:
        return out

    def run(config):
        bm, bn, bk, warps = config
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        launch(kernel, grid, *head, bias if bias is not None else out, out, m, n, k, *tail, out.stride(0),
               HAS_BIAS=bias is not None, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)

    name = kernel.fn.__name__ + "".join(f",{key}={value}" for key, value in sorted(flags.items()))
    run(triton_tuning.launch_config(name, x2d, n, group_size, run))
    return out


def _dot_f32(x2d: Tensor) -> bool:
    """Only the interpreter's bf16 runs take the fp32-operand dot (see _dot_int_weights)."""
    return interpreting() and x2d.dtype == torch.bfloat16


def int8_linear_triton(x2d: Tensor, qweight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """W8A16: y = x @ (qweight * scale[:, None]).T + bias, in x's dtype."""
    x2d, qweight, out = _check(x2d, qweight)
    return _gemm(_w8a16_kernel, x2d, out, bias, (x2d, qweight, scale.contiguous()),
                 (x2d.stride(0), qweight.stride(0)), DOT_F32=_dot_f32(x2d),
                 PARTIAL_SUMS=x2d.dtype == torch.float32)


def int4_linear_triton(x2d: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor, group_size: int,
                       bias: Tensor | None = None) -> Tensor:
    """W4A16, group-wise with zero points: w = (nibble - zero) * scale, both (N, K // group_size)."""
    x2d, qweight, out = _check(x2d, qweight, k_per_col=2)
    n, k = out.shape[1], x2d.shape[1]
    if group_size not in INT4_GROUP_SIZES or k % group_size:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES} and divide K={k}, got {group_size}")
    scale, zero = scale.contiguous(), zero.contiguous()
    if scale.shape != (n, k // group_size) or zero.shape != scale.shape:
        raise ValueError(f"scale and zero must be {(n, k // group_size)}, got {tuple(scale.shape)}, "
                         f"{tuple(zero.shape)}")
    return _gemm(_w4a16_kernel, x2d, out, bias, (x2d, qweight, scale, zero),
                 (group_size, x2d.stride(0), qweight.stride(0), scale.stride(0)), group_size,
                 DOT_F32=_dot_f32(x2d))


def _quantize_rows(x2d: Tensor, fp8: bool) -> tuple[Tensor, Tensor]:
    x2d = rows_2d(x2d)
    m, k = x2d.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=x2d.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x2d.device)
    if m:
        block = row_block(k)
        launch(_quant_rows_kernel, (m,), x2d, q, scale, k, x2d.stride(0), q.stride(0), FP8=fp8, BLOCK=block,
               num_warps=row_warps(block))
    return q, scale


def quantize_per_token_triton(x2d: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token int8: (x_q int8 (M, K), x_scale fp32 (M,)), equal to numerics.quantize_act_int8."""
    return _quantize_rows(x2d, fp8=False)


def quantize_per_token_fp8_triton(x2d: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token e4m3: (x_q float8_e4m3fn (M, K), x_scale fp32 (M,)), equal to numerics.quantize_act_fp8."""
    return _quantize_rows(x2d, fp8=True)


def _scaled_mm(x2d, out, a, a_scale, qweight, w_scale, bias, a_static, fp8):
    return _gemm(_scaled_mm_kernel, x2d, out, bias, (a, qweight, a_scale, w_scale.float().contiguous()),
                 (a.stride(0), qweight.stride(0)), A_STATIC=a_static, FP8=fp8)


def w8a8_linear_triton(x2d: Tensor, qweight: Tensor, w_scale: Tensor, x_scale: Tensor | None = None,
                       bias: Tensor | None = None) -> Tensor:
    """int8 x int8 GEMM, int32 accumulate. x_scale None: dynamic per-token quantization (one small
    kernel first); else one per-tensor fp32 scale (a tensor: no host sync), applied in the A loads."""
    x2d, qweight, out = _check(x2d, qweight)
    if x_scale is None:
        xq, xs = quantize_per_token_triton(x2d)
        return _scaled_mm(x2d, out, xq, xs, qweight, w_scale, bias, False, False)
    if x_scale.numel() != 1:
        raise ValueError(f"a static x_scale is one per-tensor scale, got shape {tuple(x_scale.shape)}")
    return _scaled_mm(x2d, out, x2d, x_scale.reshape(()).float(), qweight, w_scale, bias, True, False)


def fp8_linear_triton(x2d: Tensor, qweight: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """e4m3 x e4m3 GEMM (sm_90), activations quantized per token first (absmax / 448)."""
    x2d, qweight, out = _check(x2d, qweight)
    xq, xs = quantize_per_token_fp8_triton(x2d)
    return _scaled_mm(x2d, out, xq, xs, qweight, w_scale, bias, False, True)


# -------------------------------------------------------------------------- AOT specs ----

def _signature(kernel, ptrs: dict) -> dict:
    """Pointers as given, `tl.constexpr` parameters constexpr, other scalars i32 (sizes, strides)."""
    params = inspect.signature(kernel.fn).parameters.values()  # .fn: jitted or interpreted alike
    return {p.name: ptrs.get(p.name, "constexpr" if "constexpr" in str(p.annotation) else "i32")
            for p in params}


def aot_specs() -> list[AotSpec]:
    """Every (dtype, config, flags) the launchers can pick; FP8 only for sm_90."""
    specs = []
    for dt in AOT_DTYPES:
        p = ptr(dt)
        for fp8 in (False, True):
            sig = _signature(_quant_rows_kernel, {"x_ptr": p, "q_ptr": "*fp8e4nv" if fp8 else "*i8",
                                                  "s_ptr": "*fp32"})
            for block in sorted({row_block(n) for n in AOT_ROW_SIZES}):
                specs.append(AotSpec(f"quant_rows{'_fp8' if fp8 else ''}[{dt},B{block}]", _quant_rows_kernel,
                                     sig, {"FP8": fp8, "BLOCK": block}, num_warps=row_warps(block),
                                     min_arch=90 if fp8 else 80))
        w8_sig = _signature(_w8a16_kernel, {"x_ptr": p, "w_ptr": "*i8", "s_ptr": p, "bias_ptr": p,
                                            "out_ptr": p})
        w4_sig = _signature(_w4a16_kernel, {"x_ptr": p, "w_ptr": "*u8", "s_ptr": p, "z_ptr": p, "bias_ptr": p,
                                            "out_ptr": p})
        for tag, (bm, bn, bk, warps) in (("gemv", GEMV_CONFIG), ("gemm", GEMM_CONFIG)):
            for bias in (False, True):
                const = {"HAS_BIAS": bias, "BLOCK_M": bm, "BLOCK_N": bn}
                specs.append(AotSpec(f"w8a16[{dt},{tag},bias={bias}]", _w8a16_kernel, w8_sig,
                                     {**const, "DOT_F32": False, "BLOCK_K": bk}, num_warps=warps))
                for gbk in sorted({min(bk, g) for g in INT4_GROUP_SIZES}):
                    specs.append(AotSpec(f"w4a16[{dt},{tag},K{gbk},bias={bias}]", _w4a16_kernel, w4_sig,
                                         {**const, "DOT_F32": False, "BLOCK_K": gbk}, num_warps=warps))
                for mode, a_ty, w_ty in (("dynamic", "*i8", "*i8"), ("static", p, "*i8"),
                                         ("fp8", "*fp8e4nv", "*fp8e4nv")):
                    sig = _signature(_scaled_mm_kernel, {"a_ptr": a_ty, "w_ptr": w_ty, "a_scale_ptr": "*fp32",
                                                         "w_scale_ptr": "*fp32", "bias_ptr": p, "out_ptr": p})
                    name = "fp8_linear" if mode == "fp8" else "w8a8"
                    flags = {"BLOCK_K": bk, "A_STATIC": mode == "static", "FP8": mode == "fp8"}
                    specs.append(AotSpec(f"{name}[{dt},{tag},{mode},bias={bias}]", _scaled_mm_kernel, sig,
                                         {**const, **flags}, warps, min_arch=90 if mode == "fp8" else 80))
    return specs
