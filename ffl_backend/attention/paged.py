"""Decode attention over a paged KV cache:
`torch.ops.fastflow.paged_decode(q, k_pool, v_pool, block_tables, seq_lens, scale, window, softcap) -> out`.

q (B, Hq, D): one new token per sequence, its k/v already written to the pool. k_pool/v_pool
(num_blocks, block_size, Hkv, D): one layer's block pool. block_tables (B, max_blocks) int32: the
physical blocks of each sequence in order (unused entries point at the dummy block 0). seq_lens (B,)
int32: keys each sequence has, the new one included. Returns (B, Hq, D). GQA: Hq % Hkv == 0.
window > 0: the query (at position seq_len - 1) sees only its last `window` keys, and blocks wholly
before them are never read (the engine may have freed them: their table entries then point at the
dummy block). softcap > 0: logit soft-capping. Semantics: reference.py.

Shapes are fixed per batch bucket (B and max_blocks never change), so one compiled decode graph
serves every step whatever the lengths; the op is an opaque `custom_op`, the data-dependent gather
inside it is legal there and invisible to Dynamo/Inductor (no unbacked sizes, no guards).

CPU path: gather (index_select) only the blocks the longest row of this step needs, not
max_blocks, then one batched SDPA with a length mask (none when all rows have the same length):
measured faster than one SDPA per row and than advanced indexing at every batch size tried. A lone
sequence whose blocks are consecutive (what the LIFO allocator hands out when nothing interleaves)
skips the gather: the pool slice is a view.

CUDA path (Triton): one program per (sequence, kv head) holds the whole GQA group of query rows
(padded to 16 rows: tl.dot needs >= 16) and walks the sequence's block table one block at a time
with an online softmax. Blocks are loaded once per kv head for the whole group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels._triton import HAS_TRITON, AotSpec, on_triton_device, ptr, tl, triton
from .kv_quant import dequantized, triton_kv_args
from .prefill import KV_QUANT_PTRS, capped_attention, dot_precision, head_block, upcast_dot
from .reference import attention_ref

if HAS_TRITON:
    from .prefill import dot, load_kv, scores


def paged_decode_ref(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, seq_lens: Tensor,
                     scale: float, window: int = 0, softcap: float = 0.0) -> Tensor:
    """Pure-torch reference: per row, concatenate its blocks, then attention_ref (in q's dtype, at
    least fp32) for its newest token."""
    out = torch.empty(q.shape, dtype=q.dtype)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        blocks = block_tables[b, :-(-n // k_pool.shape[1])].long()
        k = k_pool[blocks].reshape(-1, *k_pool.shape[2:])[:n].transpose(0, 1)[None]  # (1, Hkv, n, D)
        v = v_pool[blocks].reshape(-1, *v_pool.shape[2:])[:n].transpose(0, 1)[None]
        out[b] = attention_ref(q[b, :, None][None], k, v, scale, window, softcap=softcap)[0, :, 0]
    return out


def paged_decode_cpu(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, seq_lens: Tensor,
                     scale: float, window: int = 0, softcap: float = 0.0) -> Tensor:
    if window > 0 or softcap > 0:
        return _paged_masked(q, k_pool, v_pool, block_tables, seq_lens, scale, window, softcap)
    bsz, width = q.shape[0], k_pool.shape[-1]  # width: head_dim, or packed_width(head_dim) (kv_quant.py)
    block = k_pool.shape[1]
    lens = seq_lens.tolist()  # CPU tensors: no device sync
    longest = max(lens)
    nb = -(-longest // block)  # blocks the longest row needs, not max_blocks
    if bsz == 1:
        first, row = int(block_tables[0, 0]), block_tables[0, :nb].tolist()
        if row == list(range(first, first + nb)):  # consecutive blocks (the allocator's usual case
            # for a lone sequence): a view of the pool, no gather at all
            k = k_pool[first:first + nb].view(1, nb * block, -1, width)[:, :longest].transpose(1, 2)
            v = v_pool[first:first + nb].view(1, nb * block, -1, width)[:, :longest].transpose(1, 2)
            k, v = dequantized(q, k, v)
            return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale,
                                                  enable_gqa=True)[:, :, 0].contiguous()
    idx = block_tables[:, :nb].reshape(-1).to(device=k_pool.device, dtype=torch.long)
    k = k_pool.index_select(0, idx).view(bsz, nb * block, -1, width).transpose(1, 2)  # (B, Hkv, S, D)
    v = v_pool.index_select(0, idx).view(bsz, nb * block, -1, width).transpose(1, 2)
    k, v = dequantized(q, k, v)
    if min(lens) == longest:  # one row, or equal lengths: slice instead of masking
        out = F.scaled_dot_product_attention(q[:, :, None], k[:, :, :longest], v[:, :, :longest], scale=scale,
                                             enable_gqa=True)
    else:
        ok = torch.arange(nb * block, device=q.device)[None, :] < seq_lens[:, None].to(q.device)
        out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=ok[:, None, None, :], scale=scale,
                                             enable_gqa=True)
    return out[:, :, 0].contiguous()



def _paged_masked(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float,
                  window: int, softcap: float) -> Tensor:
    """Windows and soft-capping: gather the blocks from the first any row's window reaches to the
    longest row's last, one boolean mask (length and window) per row."""
    bsz, width = q.shape[0], k_pool.shape[-1]
    block = k_pool.shape[1]
    lens = seq_lens.tolist()
    nb = -(-max(lens) // block)
    first = min(max(0, n - window) // block for n in lens) if window > 0 else 0
    idx = block_tables[:, first:nb].reshape(-1).to(device=k_pool.device, dtype=torch.long)
    k = k_pool.index_select(0, idx).view(bsz, -1, k_pool.shape[2], width).transpose(1, 2)  # (B, Hkv, S, D)
    v = v_pool.index_select(0, idx).view(bsz, -1, v_pool.shape[2], width).transpose(1, 2)
    k, v = dequantized(q, k, v)
    pos = torch.arange(first * block, nb * block, device=q.device)[None, :]
    n = seq_lens.to(q.device)[:, None]
    ok = pos < n
    if window > 0:
        ok = ok & (pos >= n - window)
    ok = ok[:, None, None, :]
    if softcap > 0:
        return capped_attention(q[:, :, None], k, v, scale, softcap, ok)[:, :, 0].contiguous()
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=ok, scale=scale, enable_gqa=True)
    return out[:, :, 0].contiguous()

if HAS_TRITON:

    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, len_ptr, o_ptr,
                             sq_b, sq_h, sk_blk, sk_n, sk_h, sv_blk, sv_n, sv_h, sbt_b, so_b, so_h,
                             n_kv_heads, group, head_dim, scale, window, softcap, scale_off,
                             DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, KV_QUANT: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        n = tl.load(len_ptr + b).to(tl.int32)
        rows = tl.arange(0, BLOCK_M)
        r_ok = rows < group
        heads = (kvh * group + rows).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + offs_d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        lo = 0
        if window > 0:  # the first key the window reaches; blocks before it may be freed
            lo = tl.maximum(n - window, 0)
        for j in range(lo // BLOCK_N, tl.cdiv(n, BLOCK_N)):
            blk = tl.load(bt_ptr + b * sbt_b + j).to(tl.int64)
            n_ok = (j * BLOCK_N + offs_n < n) & (j * BLOCK_N + offs_n >= lo)
            k_rows = blk * sk_blk + offs_n * sk_n + kvh * sk_h
            k, ks = load_kv(k_ptr, ks_ptr, k_rows[None, :] + offs_d[:, None], k_rows, n_ok[None, :] & d_ok[:, None],
                            n_ok, q.dtype, KV_QUANT, scale_off)
            s = scores(q, k, scale * ks, softcap, DOT_PREC, UPCAST)
            s = tl.where(n_ok[None, :] & r_ok[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_safe)
            p = tl.math.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_rows = blk * sv_blk + offs_n * sv_n + kvh * sv_h
            v, vs = load_kv(v_ptr, vs_ptr, v_rows[:, None] + offs_d[None, :], v_rows, n_ok[:, None] & d_ok[None, :],
                            n_ok, q.dtype, KV_QUANT, scale_off)
            acc = acc * alpha[:, None] + dot((p * vs).to(q.dtype), v, DOT_PREC, UPCAST)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + b * so_b + heads[:, None] * so_h + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & d_ok[None, :])


def _row_block(group: int) -> int:
    return max(16, 1 << (group - 1).bit_length())


def paged_decode_triton(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, seq_lens: Tensor,
                        scale: float, window: int = 0, softcap: float = 0.0) -> Tensor:
    """The Triton kernel on any tensor Triton can address (CUDA, or CPU under TRITON_INTERPRET).
    The pool's block size is the kernel's BLOCK_N: a power of two >= 16."""
    bsz, n_heads, head_dim = q.shape
    n_kv, block = k_pool.shape[2], k_pool.shape[1]
    if block < 16 or block & (block - 1):
        raise ValueError(f"the Triton paged decode needs a power-of-two block_size >= 16, got {block}")
    q, k_pool, v_pool = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_pool, v_pool))
    k_pool, v_pool, k_scales, v_scales, kv_quant, scale_off = triton_kv_args(q, k_pool, v_pool)
    block_tables = block_tables.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _paged_decode_kernel[(bsz, n_kv)](
        q, k_pool, v_pool, k_scales, v_scales, block_tables, seq_lens, out,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        n_kv, n_heads // n_kv, head_dim, scale, window, float(softcap), scale_off,
        DOT_PREC=dot_precision(q.dtype), UPCAST=upcast_dot(), KV_QUANT=kv_quant, BLOCK_M=_row_block(n_heads // n_kv),
        BLOCK_N=block, BLOCK_D=head_block(head_dim), num_warps=4)
    return out


@torch.library.custom_op("fastflow::paged_decode", mutates_args=())
def paged_decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, seq_lens: Tensor,
                 scale: float, window: int = 0, softcap: float = 0.0) -> Tensor:
    if on_triton_device(q):
        return paged_decode_triton(q, k_pool, v_pool, block_tables, seq_lens, scale, window, softcap)
    return paged_decode_cpu(q, k_pool, v_pool, block_tables, seq_lens, scale, window, softcap)


@paged_decode.register_fake
def _paged_decode_fake(q, k_pool, v_pool, block_tables, seq_lens, scale, window=0, softcap=0.0):
    return q.new_empty(q.shape)


AOT_BLOCKS = (16, 32)
AOT_HEAD_DIMS = (64, 128)
AOT_GROUPS = (1, 8, 32)  # row blocks 16, 16, 32


def aot_specs() -> list[AotSpec]:
    """Every (dtype, head block, row block, block size) the launcher picks for common models, and the
    int8 / fp8 cache variants at bf16 D128 with 16-token blocks."""
    specs = []
    strides = ("sq_b", "sq_h", "sk_blk", "sk_n", "sk_h", "sv_blk", "sv_n", "sv_h", "sbt_b", "so_b", "so_h")
    variants = [(dt, d, m, n, 0) for dt in ("fp32", "bf16") for d in AOT_HEAD_DIMS
                for m in sorted({_row_block(g) for g in AOT_GROUPS}) for n in AOT_BLOCKS]
    variants += [("bf16", 128, 16, 16, code) for code in KV_QUANT_PTRS]
    for dt, d, block_m, block_n, kv_quant in variants:
        kv_ptr = KV_QUANT_PTRS.get(kv_quant, ptr(dt))
        sig = {"q_ptr": ptr(dt), "k_ptr": kv_ptr, "v_ptr": kv_ptr, "ks_ptr": "*fp32", "vs_ptr": "*fp32",
               "bt_ptr": "*i32", "len_ptr": "*i32", "o_ptr": ptr(dt)}
        sig.update({s: "i64" for s in strides})
        sig.update({"n_kv_heads": "i32", "group": "i32", "head_dim": "i32", "scale": "fp32",
                    "window": "i32", "softcap": "fp32", "scale_off": "i32"})
        const = {"DOT_PREC": dot_precision(torch.float32 if dt == "fp32" else torch.bfloat16),
                 "UPCAST": False, "KV_QUANT": kv_quant, "BLOCK_M": block_m, "BLOCK_N": block_n,
                 "BLOCK_D": head_block(d)}
        sig.update({c: "constexpr" for c in const})
        kv = f",kv={kv_ptr[1:]}" if kv_quant else ""
        specs.append(AotSpec(f"paged_decode[{dt},D{d},M{block_m},N{block_n}{kv}]", _paged_decode_kernel, sig, const))
    return specs
