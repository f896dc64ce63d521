"""Gated activations: `torch.ops.fastflow.silu_mul` (SwiGLU) and `gelu_mul` (GeGLU).

HF's gated MLP is `down_proj(act_fn(gate_proj(x)) * up_proj(x))` (LlamaMLP, MistralMLP, Qwen2MLP,
GemmaMLP; Phi-3 splits one fused `gate_up_proj` output into two halves first). The activation is a
model parameter, not a copy: one kernel with a constexpr ACT selector serves
- silu (Llama, Mistral, Qwen, Phi-3: `hidden_act="silu"`),
- gelu with erf (`hidden_act="gelu"`),
- gelu with the tanh approximation (Gemma: `gelu_pytorch_tanh`).

Cast order, mirrored by the references: torch computes the activation of a bf16/fp16 tensor in fp32
and rounds it to the input dtype (that is `act_fn(gate)`), then `* up` multiplies two bf16 tensors,
which again computes in fp32 and rounds. So the product is rounded twice, and the kernel rounds twice.

CPU path: the ops are `triton_op`s whose body on a non-CUDA tensor is the reference, so under
torch.compile Inductor traces the reference and fuses it into one loop; on CUDA the body is Triton.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..numerics import acc_dtype
from ._triton import AOT_DTYPES, AOT_ROW_SIZES, HAS_TRITON, AotSpec, launch, on_triton_device, ptr, rows_2d, tl, triton

# The constexpr ACT selector values. `approximate` strings are F.gelu's.
ACT_SILU, ACT_GELU, ACT_GELU_TANH = 0, 1, 2
_GELU_ACTS = {"none": ACT_GELU, "tanh": ACT_GELU_TANH}
_ACT_NAMES = {ACT_SILU: "silu", ACT_GELU: "gelu", ACT_GELU_TANH: "gelu_tanh"}

# Elementwise: a program covers BLOCK columns of one row. 1024 lanes x 4 warps gives each thread
# 8 contiguous elements (16-byte bf16 loads); narrower rows (tiny test models) get a smaller block
# so fewer lanes idle. Column blocks are the second grid axis, rows the first (no 65535 limit).
MIN_BLOCK, MAX_BLOCK = 128, 1024


def _opmath(t: Tensor) -> Tensor:
    """Upcast bf16/fp16 to fp32 as torch's activation kernels do internally; keep fp32/fp64 as is
    (so a float64 run of the reference stays float64 in the tests)."""
    return t.to(acc_dtype(t))


def silu_mul_ref(gate: Tensor, up: Tensor) -> Tensor:
    """`F.silu(gate) * up` in HF's cast order: activation in fp32, rounded, then the multiply."""
    return F.silu(_opmath(gate)).to(gate.dtype) * up


def gelu_mul_ref(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """`F.gelu(gate, approximate=approximate) * up` in HF's cast order (GeGLU; Gemma uses "tanh")."""
    return F.gelu(_opmath(gate), approximate=approximate).to(gate.dtype) * up


def gated_block(n: int) -> int:
    return min(MAX_BLOCK, max(MIN_BLOCK, 1 << max(0, (n - 1).bit_length())))


def gated_warps(block: int) -> int:
    return max(1, block // 256)


if HAS_TRITON:

    @triton.jit
    def _gated_act_kernel(gate_ptr, up_ptr, out_ptr, n_cols, gate_stride, up_stride, out_stride,
                          ACT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0)
        u = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0)
        x = g.to(tl.float32)
        if ACT == 0:
            # silu(x) = x * sigmoid(x) = x / (1 + e^-x). For x -> -inf, e^-x overflows to inf and the
            # quotient is -0 (no NaN); for x -> +inf it is x.
            a = x / (1.0 + tl.exp(-x))
        elif ACT == 1:
            a = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))  # 1/sqrt(2), as F.gelu
        else:
            # tanh-GELU: 0.5 x (1 + tanh(v)), v = sqrt(2/pi) (x + 0.044715 x^3). Triton has no tanh
            # outside libdevice; the identity 1 + tanh(v) = 2 sigmoid(2v) turns it into
            # x / (1 + e^{-2v}), which also avoids the cancellation of 1 + tanh(v) for x << 0
            # (torch's fp32 kernel returns -0.0 at x = -5.1 where the exact value is -1e-7).
            v = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            a = x / (1.0 + tl.exp(-2.0 * v))
        # HF rounds act_fn(gate) to the storage dtype before the multiply (a no-op in fp32).
        a = a.to(g.dtype).to(tl.float32)
        out = a * u.to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)



def _launch(gate: Tensor, up: Tensor, act: int) -> Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    n = gate.shape[-1]
    g2, u2 = rows_2d(gate), rows_2d(up)
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if out.numel() == 0:
        return out
    o2 = out.view(-1, n)
    block = gated_block(n)
    launch(_gated_act_kernel, (g2.shape[0], triton.cdiv(n, block)), g2, u2, o2, n, g2.stride(0),
           u2.stride(0), o2.stride(0), ACT=act, BLOCK=block, num_warps=gated_warps(block))
    return out


def _gelu_act(approximate: str) -> int:
    if approximate not in _GELU_ACTS:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return _GELU_ACTS[approximate]


def silu_mul_triton(gate: Tensor, up: Tensor) -> Tensor:
    """The Triton kernel on any tensor Triton can address (CUDA, or CPU under TRITON_INTERPRET)."""
    return _launch(gate, up, ACT_SILU)


def gelu_mul_triton(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    return _launch(gate, up, _gelu_act(approximate))


@torch.library.triton_op("fastflow::silu_mul", mutates_args=())
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    if on_triton_device(gate):
        return silu_mul_triton(gate, up)
    return silu_mul_ref(gate, up)


@torch.library.triton_op("fastflow::gelu_mul", mutates_args=())
def gelu_mul(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    if on_triton_device(gate):
        return gelu_mul_triton(gate, up, approximate)
    return gelu_mul_ref(gate, up, approximate)


def aot_specs() -> list[AotSpec]:
    """Every (dtype, activation, block size) the launcher can pick: gated_block maps any width to
    a power of two in [MIN_BLOCK, MAX_BLOCK], so all of those are compiled, not only the blocks of
    AOT_ROW_SIZES (which all land on MAX_BLOCK but 64)."""
    blocks = sorted({gated_block(n) for n in (*AOT_ROW_SIZES, MIN_BLOCK, MIN_BLOCK * 2, MAX_BLOCK // 2)})
    specs = []
    for dt in AOT_DTYPES:
        for act, act_name in _ACT_NAMES.items():
            for block in blocks:
                sig = {"gate_ptr": ptr(dt), "up_ptr": ptr(dt), "out_ptr": ptr(dt), "n_cols": "i32",
                       "gate_stride": "i64", "up_stride": "i64", "out_stride": "i64",
                       "ACT": "constexpr", "BLOCK": "constexpr"}
                specs.append(AotSpec(f"gated_act[{dt},{act_name},B{block}]", _gated_act_kernel, sig,
                                     {"ACT": act, "BLOCK": block}, num_warps=gated_warps(block)))
    return specs
