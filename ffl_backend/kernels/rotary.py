"""Rotary position embedding on q and k: `torch.ops.fastflow.rotary(q, k, cos, sin, rotary_dim)`.

Mirrors HF's `apply_rotary_pos_emb` with the rotate_half layout (features i and i + r/2 form a pair),
`unsqueeze_dim=1`: q (B, Hq, L, D), k (B, Hk, L, D) (Hk < Hq under GQA), cos/sin (B, L, r) in the
model dtype, with B of cos/sin 1 or B (HF builds position_ids of batch 1 when none are given).
Partial rotary is a parameter, not a copy: `rotary_dim = r < D` (GPT-NeoX, Phi, Phi-3 style) rotates
the first r features of each head and passes the remaining D - r through unchanged; r == D is Llama.

Cast order: HF computes `(q * cos) + (rotate_half(q) * sin)` in the model dtype, so in bf16 each
product is rounded to bf16 and then the sum is rounded again. The kernel rounds at the same places.

Layouts: q and k arrive as `proj(x).view(B, L, H, D).transpose(1, 2)`, i.e. non-contiguous, so the
kernel takes all four strides of each; the outputs are contiguous (B, H, L, D), what SDPA and the
KV cache want. One launch covers q and k: a program rotates a tile of HEADS heads at one (b, l),
i.e. neighbouring memory of the (B, L, H, D) projection output, with one load of the cos/sin row.

CPU path: the op is a `triton_op` whose body on a non-CUDA tensor is the reference, so under
torch.compile Inductor traces (and fuses) the reference; on CUDA the body is the Triton kernel.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._triton import AOT_DTYPES, HAS_TRITON, AotSpec, launch, on_triton_device, ptr, tl, triton

# Head dims of the supported families (64: SmolLM2/Pythia, 80: Phi-2, 96: Phi-3-mini,
# 128: Llama/Mistral/Qwen, 256: Gemma); each maps to a power-of-two block of the head dim.
AOT_HEAD_DIMS = (64, 80, 96, 128, 256)


def _rotate_half(x: Tensor) -> Tensor:
    """HF's rotate_half: cat(-x2, x1) over the two halves of the last dim."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotary_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> tuple[Tensor, Tensor]:
    """HF's apply_rotary_pos_emb (llama for rotary_dim == D; gpt_neox / phi3 for rotary_dim < D)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def embed(x: Tensor) -> Tensor:
        if rotary_dim == x.shape[-1]:
            return (x * cos) + (_rotate_half(x) * sin)
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat([(x_rot * cos) + (_rotate_half(x_rot) * sin), x_pass], dim=-1)

    return embed(q), embed(k)


def head_block(head_dim: int) -> int:
    return 1 << max(1, (head_dim - 1).bit_length())


def heads_per_program(block: int) -> int:
    """Heads in one program's tile: HEADS x BLOCK_D = 512 elements, so a program moves a few KiB
    (one row of 64-256 features is too little work for a program) and reuses its cos/sin row."""
    return max(1, 512 // block)


ROTARY_WARPS = 2  # each [HEADS, BLOCK_D / 2] half-tile is 256 elements: 4 per lane over 64 lanes


if HAS_TRITON:

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, n_q, n_k, seq_len,
                       head_dim, half, q_sb, q_sh, q_sl, q_sd, k_sb, k_sh, k_sl, k_sd, cs_sb, cs_sl,
                       BLOCK_D: tl.constexpr, HEADS: tl.constexpr, PARTIAL: tl.constexpr):
        # Grid: (B * L, cdiv(Hq, HEADS) + cdiv(Hk, HEADS)). Axis 0 has no 65535 limit (long
        # prefill); on axis 1 the first blocks are q's heads, the rest k's, so one launch does both.
        bl = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        b = bl // seq_len
        pos = bl % seq_len
        n_qb = tl.cdiv(n_q, HEADS)
        if hb < n_qb:
            h0 = hb * HEADS
            n_h = n_q
            x_row = q_ptr + b * q_sb + pos * q_sl
            x_sh = q_sh
            x_sd = q_sd
            o_row = qo_ptr + (b * n_q * seq_len + pos) * head_dim
        else:
            h0 = (hb - n_qb) * HEADS
            n_h = n_k
            x_row = k_ptr + b * k_sb + pos * k_sl
            x_sh = k_sh
            x_sd = k_sd
            o_row = ko_ptr + (b * n_k * seq_len + pos) * head_dim
        h = (h0 + tl.arange(0, HEADS))[:, None]
        x_head = x_row + h * x_sh  # [HEADS, 1] row starts in the strided input
        o_head = o_row + h * (seq_len * head_dim)  # contiguous (B, H, L, D) output
        cs_row = b * cs_sb + pos * cs_sl

        # Pairs (i, i + half) for i < half = rotary_dim / 2 (may be < BLOCK_D / 2: masked). cos/sin
        # are loaded once per program and broadcast over its heads.
        i = tl.arange(0, BLOCK_D // 2)[None, :]
        mi = i < half
        m = (h < n_h) & mi
        x1 = tl.load(x_head + i * x_sd, mask=m, other=0.0)
        x2 = tl.load(x_head + (i + half) * x_sd, mask=m, other=0.0)
        c1 = tl.load(cos_ptr + cs_row + i, mask=mi, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + cs_row + half + i, mask=mi, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cs_row + i, mask=mi, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + cs_row + half + i, mask=mi, other=0.0).to(tl.float32)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        # rotate_half(x) = (-x2, x1). Each product is rounded to the result dtype before the add,
        # as HF's `(x * cos) + (rotate_half(x) * sin)` in bf16 does (no-ops in fp32). Negation is
        # exact and round-to-nearest is symmetric, so x1*c1 - x2*s1 rounds as x1*c1 + (-x2)*s1.
        out_ty = qo_ptr.dtype.element_ty
        a1 = (x1f * c1).to(out_ty).to(tl.float32)
        b1 = (x2f * s1).to(out_ty).to(tl.float32)
        a2 = (x2f * c2).to(out_ty).to(tl.float32)
        b2 = (x1f * s2).to(out_ty).to(tl.float32)
        tl.store(o_head + i, (a1 - b1).to(out_ty), mask=m)
        tl.store(o_head + half + i, (a2 + b2).to(out_ty), mask=m)
        if PARTIAL:
            # Features rotary_dim .. head_dim pass through (GPT-NeoX's `q_pass`).
            d = tl.arange(0, BLOCK_D)[None, :]
            mp = (h < n_h) & (d >= 2 * half) & (d < head_dim)
            xp = tl.load(x_head + d * x_sd, mask=mp, other=0.0)
            tl.store(o_head + d, xp.to(out_ty), mask=mp)


def _cos_sin(t: Tensor, batch: int, seq_len: int, rotary_dim: int) -> Tensor:
    """(B or 1, L, r) -> (B, L, r) with unit last stride; a batch-1 table broadcasts (stride 0)."""
    if t.dim() != 3 or t.shape[1] != seq_len or t.shape[2] != rotary_dim or t.shape[0] not in (1, batch):
        raise ValueError(f"cos/sin must be (B or 1, {seq_len}, {rotary_dim}), got {tuple(t.shape)}")
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.expand(batch, seq_len, rotary_dim)


def rotary_triton(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> tuple[Tensor, Tensor]:
    """The Triton kernel on any tensor Triton can address (CUDA, or CPU under TRITON_INTERPRET)."""
    bsz, n_q, seq_len, head_dim = q.shape
    n_k = k.shape[1]
    if k.shape[0] != bsz or k.shape[2:] != q.shape[2:] or k.dtype != q.dtype:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must differ "
                         "only in the head count")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {rotary_dim}")
    cos = _cos_sin(cos, bsz, seq_len, rotary_dim)
    sin = _cos_sin(sin, bsz, seq_len, rotary_dim)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    # The result dtype is torch's promotion of q and cos (both the model dtype in HF).
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    q_out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=out_dtype, device=k.device)
    if q_out.numel() == 0:
        return q_out, k_out
    block = head_block(head_dim)
    heads = heads_per_program(block)
    grid = (bsz * seq_len, triton.cdiv(n_q, heads) + triton.cdiv(n_k, heads))
    launch(_rotary_kernel, grid, q, k, cos, sin, q_out, k_out, n_q, n_k, seq_len, head_dim,
           rotary_dim // 2, *q.stride(), *k.stride(), cos.stride(0), cos.stride(1),
           BLOCK_D=block, HEADS=heads, PARTIAL=rotary_dim < head_dim, num_warps=ROTARY_WARPS)
    return q_out, k_out


@torch.library.triton_op("fastflow::rotary", mutates_args=())
def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> tuple[Tensor, Tensor]:
    if on_triton_device(q):
        return rotary_triton(q, k, cos, sin, rotary_dim)
    return rotary_ref(q, k, cos, sin, rotary_dim)


def aot_specs() -> list[AotSpec]:
    """Every (dtype, head-dim block, partial rotary) the launcher can pick for AOT_HEAD_DIMS."""
    specs = []
    for dt in AOT_DTYPES:
        for block in sorted({head_block(d) for d in AOT_HEAD_DIMS}):
            for partial in (False, True):
                sig = {"q_ptr": ptr(dt), "k_ptr": ptr(dt), "cos_ptr": ptr(dt), "sin_ptr": ptr(dt),
                       "qo_ptr": ptr(dt), "ko_ptr": ptr(dt), "n_q": "i32", "n_k": "i32",
                       "seq_len": "i32", "head_dim": "i32", "half": "i32",
                       **{f"{t}_s{a}": "i64" for t in "qk" for a in "bhld"},
                       "cs_sb": "i64", "cs_sl": "i64", "BLOCK_D": "constexpr", "HEADS": "constexpr",
                       "PARTIAL": "constexpr"}
                specs.append(AotSpec(f"rotary[{dt},D{block},partial={partial}]", _rotary_kernel, sig,
                                     {"BLOCK_D": block, "HEADS": heads_per_program(block),
                                      "PARTIAL": partial}, num_warps=ROTARY_WARPS))
    return specs
