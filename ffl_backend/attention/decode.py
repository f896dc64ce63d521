"""Decode attention over a static KV cache:
`torch.ops.fastflow.attention_decode(q, k_cache, v_cache, filled, scale, window, mask=None, softcap=0.0)`.

q (B, Hq, Lq, D): the newest Lq tokens, already written to the cache; k_cache/v_cache (B, Hkv, S, D):
the whole static cache; `filled`: int64 tensor (one element) = cache slots written so far. It is a
tensor, not an int, so one compiled decode graph serves every step and every prompt length: an int
would be a guard and a recompile per token. Only the first `filled` slots are read. `mask`: optional
boolean HF mask (B or 1, 1, Lq, >= filled), ANDed with causal + window (reference.py). `softcap` > 0:
Gemma 2's logit soft-capping (reference.py).

CPU path, chosen by measurement (benchmarks/attention_cpu_paths.py): slicing the cache to the
filled length and calling SDPA with GQA beats a masked SDPA over the whole cache, eager or compiled
(HF's sdpa + static cache path), because it reads only the filled slots. So the op is an opaque
`custom_op` (the data-dependent slice is legal inside it; Inductor could not trace it without an
unbacked size). Its CPU body runs the C++ kernel `fastflow_cpu::attention_decode`
(kernels/cpu_attention.cpp) for up to CPU_KERNEL_MAX_ROWS query rows per KV head -- it reads only the
filled slots with no slice, mask copy or SDPA call -- and slices + SDPA with `enable_gqa` beyond that.
Soft-capped calls (no C++ or SDPA support) take prefill.capped_attention over the filled slots.

CUDA path, flash-decoding: `_split_kernel` gives each (batch, kv head, split) program all `group * Lq`
query rows of that kv head (GQA: each K/V block is loaded once for the whole group, as a tl.dot
operand of >= 16 rows) and a 1/n_splits share of the filled keys; the share is computed in the
kernel from `filled`, so work stays balanced as the cache fills without a host sync. `_reduce_kernel`
merges the per-split (max, sum, acc) partials. More query rows than `decode_tile` allows (64 for
bf16 up to D=256) go to the prefill kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import cpu_lib
from ..kernels._triton import HAS_TRITON, AotSpec, on_triton_device, ptr, tl, triton
from .kv_quant import dequantized, triton_kv_args
from .prefill import (
    AOT_BLOCK_DS,
    AOT_DTYPES,
    KV_QUANT_PTRS,
    capped_attention,
    causal_cpu,
    dot_precision,
    flash_launch,
    head_block,
    row_cost,
    upcast_dot,
)
from .reference import visible

MAX_SPLITS = 64
MIN_SPLIT = 128  # keys per split at least: fewer and merging partials costs more than it saves


def split_count(programs: int, cache_len: int) -> int:
    """Splits per (batch, kv head): enough programs to fill a large GPU (~1024 in flight)."""
    return max(1, min(MAX_SPLITS, triton.cdiv(cache_len, MIN_SPLIT), triton.cdiv(1024, programs)))


def row_block(rows: int) -> int:
    return max(16, 1 << (rows - 1).bit_length())


def decode_tile(head_dim: int, dtype_bytes: int) -> tuple[int, int]:
    """(most query rows per program, BLOCK_N), budgeted like prefill.tile: beyond the row limit the
    prefill kernel tiles the queries instead."""
    cost = row_cost(head_dim, dtype_bytes)
    if cost <= 256:
        return 64, 64
    return (64, 32) if cost <= 512 else (32, 16)


if HAS_TRITON:
    from .prefill import dot, load_kv, scores

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, filled_ptr, mask_ptr, acc_ptr, ml_ptr,
                      sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_m,
                      n_kv_heads, group, q_len, head_dim, n_splits, scale, window, softcap, scale_off,
                      HAS_MASK: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, KV_QUANT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        bkv = tl.program_id(0)
        split = tl.program_id(1)
        b = (bkv // n_kv_heads).to(tl.int64)
        kvh = bkv % n_kv_heads
        filled = tl.load(filled_ptr).to(tl.int32)
        rows = tl.arange(0, BLOCK_M)
        r_ok = rows < group * q_len
        r_head = kvh * group + rows // q_len
        r_q = rows % q_len
        pos = filled - q_len + r_q
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        q = tl.load(q_ptr + b * sq_b + r_head[:, None].to(tl.int64) * sq_h + r_q[:, None] * sq_m
                    + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        split_len = tl.cdiv(tl.cdiv(filled, n_splits), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, filled)
        if window > 0:  # the earliest key the oldest query can see
            lo = tl.maximum(lo, filled - q_len - window + 1)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        base_k = b * sk_b + kvh.to(tl.int64) * sk_h
        base_v = b * sv_b + kvh.to(tl.int64) * sv_h
        for start in range(lo, hi, BLOCK_N):
            cols = start + offs_n
            n_ok = cols < hi
            k_rows = base_k + cols * sk_n
            k, ks = load_kv(k_ptr, ks_ptr, k_rows[None, :] + offs_d[:, None], k_rows, n_ok[None, :] & d_ok[:, None],
                            n_ok, q.dtype, KV_QUANT, scale_off)
            s = scores(q, k, scale * ks, softcap, DOT_PREC, UPCAST)
            ok = (cols[None, :] <= pos[:, None]) & n_ok[None, :] & r_ok[:, None]
            if window > 0:
                ok = ok & (pos[:, None] - cols[None, :] < window)
            if HAS_MASK:
                hf = tl.load(mask_ptr + b * sm_b + r_q[:, None] * sm_m + cols[None, :],
                             mask=r_ok[:, None] & n_ok[None, :], other=0)
                ok = ok & (hf != 0)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_safe)
            p = tl.math.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_rows = base_v + cols * sv_n
            v, vs = load_kv(v_ptr, vs_ptr, v_rows[:, None] + offs_d[None, :], v_rows, n_ok[:, None] & d_ok[None, :],
                            n_ok, q.dtype, KV_QUANT, scale_off)
            acc = acc * alpha[:, None] + dot((p * vs).to(q.dtype), v, DOT_PREC, UPCAST)
            m_i = m_new
        # Partials in (B, Hq, Lq, n_splits) row order; an empty split writes (-inf, 0, 0).
        idx = ((b * n_kv_heads * group + r_head) * q_len + r_q) * n_splits + split
        tl.store(acc_ptr + idx[:, None] * head_dim + offs_d[None, :], acc, mask=r_ok[:, None] & d_ok[None, :])
        tl.store(ml_ptr + idx * 2, m_i, mask=r_ok)
        tl.store(ml_ptr + idx * 2 + 1, l_i, mask=r_ok)

    @triton.jit
    def _reduce_kernel(acc_ptr, ml_ptr, o_ptr, so_b, so_h, so_m, n_heads, q_len, head_dim, n_splits,
                       BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # (b * Hq + h) * Lq + i
        i = row % q_len
        h = (row // q_len) % n_heads
        b = row // q_len // n_heads
        s = tl.arange(0, BLOCK_S)
        s_ok = s < n_splits
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        m = tl.load(ml_ptr + (row * n_splits + s) * 2, mask=s_ok, other=float("-inf"))
        denom = tl.load(ml_ptr + (row * n_splits + s) * 2 + 1, mask=s_ok, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
        total = tl.sum(denom * w, 0)
        acc = tl.load(acc_ptr + (row * n_splits + s)[:, None] * head_dim + offs_d[None, :],
                      mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(o_ptr + b * so_b + h * so_h + i * so_m + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def _direct(kernel, grid, *args, **kwargs):
    """A plain launch: the op is opaque, so nothing traces these kernels."""
    return kernel[grid](*args, **kwargs)


def attention_decode_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, filled: Tensor, scale: float,
                            window: int = 0, mask: Tensor | None = None, softcap: float = 0.0) -> Tensor:
    """The Triton path on any tensor Triton can address (CUDA, or CPU under TRITON_INTERPRET)."""
    bsz, n_heads, q_len, head_dim = q.shape
    n_kv = k_cache.shape[1]
    group = n_heads // n_kv
    filled = filled.to(device=q.device, dtype=torch.int64).reshape(())
    max_rows, block_n = decode_tile(head_dim, q.element_size())
    if group * q_len > max_rows:
        return flash_launch(q, k_cache, v_cache, scale, window, softcap, filled=filled, mask=mask, run=_direct)
    q, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache))
    k_cache, v_cache, k_scales, v_scales, kv_quant, scale_off = triton_kv_args(q, k_cache, v_cache)
    if mask is not None:
        mask = mask.to(torch.bool).expand(bsz, 1, q_len, mask.shape[-1])
        mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    n_splits = split_count(bsz * n_kv, k_cache.shape[2])
    acc = torch.empty((bsz, n_heads, q_len, n_splits, head_dim), dtype=torch.float32, device=q.device)
    ml = torch.empty((bsz, n_heads, q_len, n_splits, 2), dtype=torch.float32, device=q.device)
    block_d = head_block(head_dim)
    _split_kernel[(bsz * n_kv, n_splits)](
        q, k_cache, v_cache, k_scales, v_scales, filled, mask if mask is not None else q, acc, ml,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        mask.stride(0) if mask is not None else 0, mask.stride(2) if mask is not None else 0,
        n_kv, group, q_len, head_dim, n_splits, scale, window, float(softcap), scale_off,
        HAS_MASK=mask is not None, DOT_PREC=dot_precision(q.dtype), UPCAST=upcast_dot(), KV_QUANT=kv_quant,
        BLOCK_M=row_block(group * q_len), BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _reduce_kernel[(bsz * n_heads * q_len,)](acc, ml, out, out.stride(0), out.stride(1), out.stride(2),
                                              n_heads, q_len, head_dim, n_splits,
                                              BLOCK_S=MAX_SPLITS, BLOCK_D=block_d, num_warps=4)
    return out


@cpu_lib.fake("attention_decode")
def _fake_attention_decode_cpu_kernel(q: Tensor, k_cache, v_cache, filled, scale, window, mask) -> Tensor:
    # (B, Lq, Hq, D) memory seen as (B, Hq, Lq, D), as the kernel returns it
    b, hq, lq, d = q.shape
    return q.new_empty((b, lq, hq, d)).transpose(1, 2)


# Query rows per KV head up to which the C++ kernel (fastflow_cpu::attention_decode) serves a CPU
# call; longer blocks (prompts) go to SDPA, whose tiled kernels are faster there.
CPU_KERNEL_MAX_ROWS = 64


def cpu_kernel_fits(q: Tensor, k_cache: Tensor) -> bool:
    """Whether the C++ decode-attention kernel suits this call (CPU, a few query rows per KV head);
    callers also need the library built (`cpu_lib.load()`)."""
    return q.device.type == "cpu" and q.shape[1] // max(1, k_cache.shape[1]) * q.shape[2] <= CPU_KERNEL_MAX_ROWS


def attention_decode_cpu(q: Tensor, k_cache: Tensor, v_cache: Tensor, filled: Tensor, scale: float,
                         window: int = 0, mask: Tensor | None = None, softcap: float = 0.0) -> Tensor:
    """A few query rows: the C++ kernel. Else: slice the cache to the filled length, then SDPA (no K/V
    repeat: enable_gqa)."""
    if softcap > 0:
        n = int(filled)
        ok = visible(q.shape[2], n, window, q.device)
        ok = ok if mask is None else ok & mask[..., :n].to(torch.bool)
        return capped_attention(q, *dequantized(q, k_cache[:, :, :n], v_cache[:, :, :n]), scale, softcap, ok)
    if cpu_kernel_fits(q, k_cache) and cpu_lib.load():
        return torch.ops.fastflow_cpu.attention_decode(q, k_cache, v_cache, filled, scale, window, mask).contiguous()
    n = int(filled)  # a CPU tensor: no device sync
    q_len = q.shape[2]
    k, v = dequantized(q, k_cache[:, :, :n], v_cache[:, :, :n])  # only the filled slots are widened
    ok = mask[..., :n].to(torch.bool) if mask is not None else None
    if q_len > 1 or window > 0:  # one query at the newest position sees every key: no causal mask
        causal = visible(q_len, n, window, q.device)
        if ok is None or bool((ok | ~causal).all()):
            # No padding: the mask adds nothing to causality, and the causal paths (SDPA's is_causal,
            # fastflow's tiles) are faster than a boolean mask (benchmarks/attention_cpu_paths.py).
            return causal_cpu(q, k, v, scale, window).contiguous()
        ok = causal if ok is None else ok & causal
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=ok, scale=scale, enable_gqa=True)
    return out.contiguous()


@torch.library.custom_op("fastflow::attention_decode", mutates_args=())
def attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, filled: Tensor, scale: float,
                     window: int = 0, mask: Tensor | None = None, softcap: float = 0.0) -> Tensor:
    if on_triton_device(q):
        return attention_decode_triton(q, k_cache, v_cache, filled, scale, window, mask, softcap)
    return attention_decode_cpu(q, k_cache, v_cache, filled, scale, window, mask, softcap)


@attention_decode.register_fake
def _attention_decode_fake(q, k_cache, v_cache, filled, scale, window=0, mask=None, softcap=0.0):
    return q.new_empty(q.shape)


def aot_specs() -> list[AotSpec]:
    """The split kernel at its largest row block (the most registers) for every (dtype, head
    block), and at 16 rows (batch-1 GQA decode, the common launch) for bf16; masks on (the superset
    of code). The reduce kernel for every (dtype, head block). fp16 = bf16, as in prefill.aot_specs."""
    specs = []
    strides = ("sq_b", "sq_h", "sq_m", "sk_b", "sk_h", "sk_n", "sv_b", "sv_h", "sv_n", "sm_b", "sm_m")
    variants = [(dt, d, decode_tile(d, 4 if dt == "fp32" else 2), 0) for dt in AOT_DTYPES for d in AOT_BLOCK_DS]
    variants += [("bf16", 64, (16, 64), 0), ("bf16", 128, (16, 64), 0)]
    variants += [("bf16", 128, (16, 64), code) for code in KV_QUANT_PTRS]  # int8 / fp8 caches
    for dt, block_d, (block_m, block_n), kv_quant in variants:
        kv_ptr = KV_QUANT_PTRS.get(kv_quant, ptr(dt))
        sig = {"q_ptr": ptr(dt), "k_ptr": kv_ptr, "v_ptr": kv_ptr, "ks_ptr": "*fp32", "vs_ptr": "*fp32",
               "filled_ptr": "*i64", "mask_ptr": "*i1", "acc_ptr": "*fp32", "ml_ptr": "*fp32"}
        sig.update({n: "i64" for n in strides})
        sig.update({n: "i32" for n in ("n_kv_heads", "group", "q_len", "head_dim", "n_splits")})
        sig.update({"scale": "fp32", "window": "i32", "softcap": "fp32", "scale_off": "i32"})
        const = {"HAS_MASK": True, "DOT_PREC": "ieee" if dt == "fp32" else "tf32", "UPCAST": False,
                 "KV_QUANT": kv_quant, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d}
        sig.update({n: "constexpr" for n in const})
        kv = f",kv={kv_ptr[1:]}" if kv_quant else ""
        specs.append(AotSpec(f"attention_decode_split[{dt},D{block_d},M{block_m}{kv}]", _split_kernel, sig, const))
    for dt in AOT_DTYPES:
        for block_d in AOT_BLOCK_DS:
            sig = {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "o_ptr": ptr(dt), "so_b": "i64", "so_h": "i64",
                   "so_m": "i64", "n_heads": "i32", "q_len": "i32", "head_dim": "i32", "n_splits": "i32",
                   "BLOCK_S": "constexpr", "BLOCK_D": "constexpr"}
            specs.append(AotSpec(f"attention_decode_reduce[{dt},D{block_d}]", _reduce_kernel, sig,
                                 {"BLOCK_S": MAX_SPLITS, "BLOCK_D": block_d}))
    return specs
