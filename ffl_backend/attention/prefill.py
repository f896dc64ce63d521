"""Causal prefill attention: `torch.ops.fastflow.attention_prefill(q, k, v, scale, window, softcap)`.

q (B, Hq, Lq, D), k/v (B, Hkv, Lkv, D) with Hq % Hkv == 0 (MHA, GQA, MQA), output (B, Hq, Lq, D) in
q's dtype; semantics in reference.py (bottom-right causal, optional sliding window, window <= 0 =
none; optional logit soft-capping, softcap <= 0 = none). transformers uses it when it hands over no
mask (plain causal, no padding, no static cache); everything with a mask goes through
attention_decode, which takes the mask and the filled length.

CUDA: one FlashAttention-2 style Triton kernel. A program owns BLOCK_M queries of one q head and
streams K/V blocks of the matching kv head (`h // group`: repeated K/V heads are never materialised),
keeping the softmax online in fp32. Only blocks the causal bound and the window can reach are read.
The same kernel serves attention_decode's long-query case (`HAS_FILLED`: the key count is read from
a device tensor, so no host sync) and can AND in a boolean HF mask (`HAS_MASK`).

CPU: on CPUs without bf16 matrix instructions fastflow's C++ tiles (`causal_cpu`,
kernels/cpu_prefill_attention.cpp: faster than SDPA on AVX2,
docs/performance.md#decode-attention-packed-linears-and-prompts); elsewhere SDPA with
`enable_gqa` (no K/V repeat) and `is_causal` when the mask is the plain square causal one, else an
explicit boolean mask; under torch.compile Inductor traces it.
SDPA has no soft-capping: capped scores take `capped_attention` (explicit scores, fp32 softmax).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import cpu_gemm, cpu_lib
from ..kernels._triton import HAS_TRITON, AotSpec, interpreting, launch, on_triton_device, ptr, tl, triton
from .kv_quant import dequantized, triton_kv_args
from .reference import visible

# Head dims of the supported families (64 SmolLM2, 80 Phi-2, 96 Phi-3, 128 Llama/Mistral, 256 Gemma)
# map to these head blocks; the AOT suite compiles each.
AOT_BLOCK_DS = (64, 128, 256)
AOT_DTYPES = ("fp32", "bf16")  # fp16 tiles are bf16's (see aot_specs)


def head_block(head_dim: int) -> int:
    """Power-of-two block of the head dim; tl.dot needs every dimension >= 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


def row_cost(head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one K or V row in a tile, the unit tile sizes are budgeted in."""
    return head_block(head_dim) * dtype_bytes


def tile(head_dim: int, dtype_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) within Ampere's 163 KiB of shared memory. fp32 "ieee" dots take
    ~4x the shared memory of bf16 ones (measured by the AOT suite: fp32 D128 at 64x64 needs 176 KiB,
    fp32 D256 at 32x32 164 KiB), so the tile shrinks as a row costs more bytes."""
    cost = row_cost(head_dim, dtype_bytes)
    if cost <= 256:
        return 64, 64, 4
    return (32, 32, 4) if cost <= 512 else (16, 16, 4)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep fp32 products ("ieee"); tf32 would cost ~1e-3 relative error vs eager."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dot() -> bool:
    """The Triton interpreter multiplies bf16 operands of tl.dot as their raw uint16 bit patterns
    (triton/runtime/interpreter.py, create_dot), so interpreted kernels upcast them to fp32 first:
    exact for bf16/fp16 products, as the tensor cores' fp32 accumulation is."""
    return interpreting()


if HAS_TRITON:

    @triton.jit
    def dot(a, b, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b, input_precision=DOT_PREC)

    @triton.jit
    def stored_values(x, KV_QUANT: tl.constexpr):
        """A tile of stored K/V as fp32 before its row scales (kv_quant.py): int8 as is; fp8 e4m3
        bytes decoded from their bits (2^(e-7) (1 + m/8), subnormals m 2^-9; the cache never
        holds NaN), so no fp8 type support is needed on the GPU or in the interpreter."""
        if KV_QUANT == 2:
            b = x.to(tl.int32) & 0xFF
            e = (b >> 3) & 15
            m = b & 7
            normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
            mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
            return tl.where(b >= 128, -mag, mag)
        return x.to(tl.float32)

    @triton.jit
    def load_kv(ptr, scale_ptr, offs, row_offs, ok, row_ok, dtype, KV_QUANT: tl.constexpr, SCALE_OFF):
        """A K or V tile in `dtype` (q's) and its per-row scales (1.0 for a float cache). Stored values are
        exact in bf16 (int8, and e4m3's 3 mantissa bits), so the tensor-core dots stay exact; the scales
        multiply the scores (K) or the probabilities (V) in fp32."""
        x = tl.load(ptr + offs, mask=ok, other=0)
        rs = 1.0
        if KV_QUANT > 0:  # one return: Triton may type-check both branches' returns against each other
            rs = tl.load(scale_ptr + (row_offs + SCALE_OFF) // 4, mask=row_ok, other=0.0)
            x = stored_values(x, KV_QUANT).to(dtype)
        return x, rs

    @triton.jit
    def scores(q, k, scale, softcap, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
        """Scaled (and, softcap > 0, soft-capped) scores in the exp2 domain. tanh(x) = 1 - 2 / (e^2x + 1):
        saturates cleanly at both ends, and the interpreter and every Triton version have exp. 2x is
        capped at 60 (tanh is 1 in fp32 long before) so exp never overflows."""
        s = dot(q, k, DOT_PREC, UPCAST) * scale
        if softcap > 0:
            s = softcap * (1.0 - 2.0 / (tl.exp(tl.minimum(2.0 * s / softcap, 60.0)) + 1.0))
        return s * 1.4426950408889634

    @triton.jit
    def _flash_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, filled_ptr, mask_ptr,
                      sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_m,
                      sm_b, sm_m, n_heads, group, q_len, kv_len, head_dim, scale, window, softcap, scale_off,
                      HAS_FILLED: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                      KV_QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // n_heads).to(tl.int64)
        h = bh % n_heads
        kvh = (h // group).to(tl.int64)
        if HAS_FILLED:
            kv_len = tl.load(filled_ptr).to(tl.int32)
        q_start = kv_len - q_len  # absolute position of query 0
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        m_ok = offs_m < q_len
        q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_m + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        pos = q_start + offs_m
        # The causal bound of the block's last query, and (with a window) its first query's reach.
        hi = tl.minimum(kv_len, q_start + (pid_m + 1) * BLOCK_M)
        lo = 0
        if window > 0:
            lo = tl.maximum(0, q_start + pid_m * BLOCK_M - window + 1)
            lo = (lo // BLOCK_N) * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            cols = start + offs_n
            n_ok = cols < hi
            k_rows = b * sk_b + kvh * sk_h + cols * sk_n
            k, ks = load_kv(k_ptr, ks_ptr, k_rows[None, :] + offs_d[:, None], k_rows, n_ok[None, :] & d_ok[:, None],
                            n_ok, q.dtype, KV_QUANT, scale_off)
            s = scores(q, k, scale * ks, softcap, DOT_PREC, UPCAST)
            ok = (cols[None, :] <= pos[:, None]) & n_ok[None, :] & m_ok[:, None]
            if window > 0:
                ok = ok & (pos[:, None] - cols[None, :] < window)
            if HAS_MASK:
                hf = tl.load(mask_ptr + b * sm_b + offs_m[:, None] * sm_m + cols[None, :],
                             mask=m_ok[:, None] & n_ok[None, :], other=0)
                ok = ok & (hf != 0)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: no NaN
            alpha = tl.math.exp2(m_i - m_safe)
            p = tl.math.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_rows = b * sv_b + kvh * sv_h + cols * sv_n
            v, vs = load_kv(v_ptr, vs_ptr, v_rows[:, None] + offs_d[None, :], v_rows, n_ok[:, None] & d_ok[None, :],
                            n_ok, q.dtype, KV_QUANT, scale_off)
            acc = acc * alpha[:, None] + dot((p * vs).to(q.dtype), v, DOT_PREC, UPCAST)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + b * so_b + h * so_h + offs_m[:, None] * so_m + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def flash_launch(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int, softcap: float = 0.0,
                 filled: Tensor | None = None, mask: Tensor | None = None, run=launch) -> Tensor:
    """Launch `_flash_kernel`; `run` is `launch` (wrap_triton, traceable) or a direct call."""
    bsz, n_heads, q_len, head_dim = q.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    k, v, k_scales, v_scales, kv_quant, scale_off = triton_kv_args(q, k, v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_m, block_n, warps = tile(head_dim, q.element_size())
    if mask is not None:
        mask = mask.to(torch.bool).expand(bsz, 1, q_len, mask.shape[-1])
        mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    grid = (triton.cdiv(q_len, block_m), bsz * n_heads)
    run(_flash_kernel, grid, q, k, v, k_scales, v_scales, out, filled if filled is not None else out,
        mask if mask is not None else out, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        mask.stride(0) if mask is not None else 0, mask.stride(2) if mask is not None else 0,
        n_heads, n_heads // k.shape[1], q_len, k.shape[2], head_dim, scale, window, float(softcap), scale_off,
        HAS_FILLED=filled is not None, HAS_MASK=mask is not None, DOT_PREC=dot_precision(q.dtype), UPCAST=upcast_dot(),
        KV_QUANT=kv_quant, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=head_block(head_dim), num_warps=warps)
    return out


def attention_prefill_triton(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int = 0,
                             softcap: float = 0.0) -> Tensor:
    """The Triton kernel on any tensor Triton can address (CUDA, or CPU under TRITON_INTERPRET)."""
    return flash_launch(q, k, v, scale, window, softcap)


def capped_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float, ok: Tensor | None) -> Tensor:
    """Soft-capped attention on CPU: explicit fp32 scores (q's dtype if wider), `ok` (broadcastable
    to (B, Hq, Lq, Lkv)) masks, a fully masked row gives zeros (reference.py)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    bsz, n_heads, q_len, head_dim = q.shape
    n_kv = k.shape[1]
    qg = q.to(acc).reshape(bsz, n_kv, n_heads // n_kv * q_len, head_dim)  # GQA without repeating K/V
    s = (qg @ k.to(acc).transpose(-1, -2)).view(bsz, n_heads, q_len, -1) * scale
    s = softcap * torch.tanh(s / softcap)
    if ok is not None:
        s = s.masked_fill(~ok, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0).view(bsz, n_kv, n_heads // n_kv * q_len, -1)
    return (p @ v.to(acc)).view(q.shape).to(q.dtype)


@cpu_lib.fake("prefill_attention")
def _fake_prefill_attention(q: Tensor, k, v, scale: float, window: int) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def tiles_on_cpu(q: Tensor, k: Tensor) -> bool:
    """Whether a causal prompt takes `fastflow_cpu::prefill_attention` (kernels/cpu_prefill_attention.cpp):
    float q/k/v with a head dim the tiles take, on a CPU without bf16 matrix instructions (elsewhere
    SDPA's own kernel uses them; the same split as the prompt GEMMs, kernels/cpu_gemm.py)."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and k.dtype == q.dtype and q.shape[-1] % 16 == 0 and q.shape[-1] <= 256
            and cpu_gemm.replaces_bf16_matmul())


def causal_cpu(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int) -> Tensor:
    """Causal (bottom-right, optional window) attention of float q/k/v on CPU, no mask: fastflow's tiles
    where `tiles_on_cpu`, else SDPA (is_causal when it is the plain square case)."""
    if tiles_on_cpu(q, k):
        return torch.ops.fastflow_cpu.prefill_attention(q, k, v, scale, window)
    if window <= 0 and q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    ok = visible(q.shape[2], k.shape[2], window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ok, scale=scale, enable_gqa=True)


def attention_prefill_cpu(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int = 0,
                          softcap: float = 0.0) -> Tensor:
    q_len, kv_len = q.shape[2], k.shape[2]
    k, v = dequantized(q, k, v)
    if softcap > 0:
        return capped_attention(q, k, v, scale, softcap, visible(q_len, kv_len, window, q.device))
    return causal_cpu(q, k, v, scale, window)


@torch.library.triton_op("fastflow::attention_prefill", mutates_args=())
def attention_prefill(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int = 0,
                      softcap: float = 0.0) -> Tensor:
    if on_triton_device(q):
        return flash_launch(q, k, v, scale, window, softcap)
    return attention_prefill_cpu(q, k, v, scale, window, softcap).contiguous()


# Stored K/V pointer types of the quantized caches the kernels read (kv_quant.triton_kv_args).
KV_QUANT_PTRS = {1: "*i8", 2: "*u8"}


def aot_specs() -> list[AotSpec]:
    """Every (dtype, head block) tile the launcher can pick, with the HAS_FILLED/HAS_MASK branches on
    (their superset of code), plus the plain prefill variant once, and the int8 / fp8 cache variants
    at bf16 D128. fp16 compiles to the same tile shapes, shared memory and registers as bf16, so bf16
    stands for both: each compile takes seconds (docs/performance.md#gpu-kernels), and the suite has to
    stay affordable."""
    specs = []
    variants = [(dt, d, True, 0) for dt in AOT_DTYPES for d in AOT_BLOCK_DS] + [("bf16", 128, False, 0)]
    variants += [("bf16", 128, True, code) for code in KV_QUANT_PTRS]
    for dt, block_d, flags, kv_quant in variants:
        block_m, block_n, warps = tile(block_d, 4 if dt == "fp32" else 2)
        kv_ptr = KV_QUANT_PTRS.get(kv_quant, ptr(dt))
        sig = {"q_ptr": ptr(dt), "k_ptr": kv_ptr, "v_ptr": kv_ptr, "ks_ptr": "*fp32", "vs_ptr": "*fp32",
               "o_ptr": ptr(dt), "filled_ptr": "*i64" if flags else ptr(dt), "mask_ptr": "*i1" if flags else ptr(dt)}
        sig.update({n: "i64" for n in ("sq_b", "sq_h", "sq_m", "sk_b", "sk_h", "sk_n", "sv_b",
                                       "sv_h", "sv_n", "so_b", "so_h", "so_m", "sm_b", "sm_m")})
        sig.update({n: "i32" for n in ("n_heads", "group", "q_len", "kv_len", "head_dim")})
        sig.update({"scale": "fp32", "window": "i32", "softcap": "fp32", "scale_off": "i32"})
        const = {"HAS_FILLED": flags, "HAS_MASK": flags, "DOT_PREC": "ieee" if dt == "fp32" else "tf32",
                 "UPCAST": False, "KV_QUANT": kv_quant, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d}
        sig.update({n: "constexpr" for n in const})
        kv = f",kv={kv_ptr[1:]}" if kv_quant else ""
        specs.append(AotSpec(f"attention_flash[{dt},D{block_d},filled_mask={flags}{kv}]",
                             _flash_kernel, sig, const, num_warps=warps))
    return specs
