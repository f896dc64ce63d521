"""fastflow's int8/int4 linears as ONNX Runtime's `com.microsoft.MatMulNBits`, written from the
model's own codes, scales and zero points (no re-quantization).

MatMulNBits computes x @ W.T with W[n, k] = (B[n, k] - zero[n, k // block]) * scale[n, k // block],
B packed along k (two 4-bit codes per byte, even k in the low nibble, as numerics.pack_int4).
ONNX Runtime's CPU kernels are fast only with uint8 zero points and `accuracy_level` 4 (activations
quantized to int8 per block, as llama.cpp does for Q4_0/Q8_0); float zero points, and 8-bit weights
at levels 0/1, dequantize the whole matrix on every call (docs/onnx.md, benchmarks/onnx_matmul_nbits.py).
So:
- int8: codes + 128 with zero point 128, the row's scale repeated over its blocks;
- int4: fastflow's fractional zero point z splits into its nearest integer (the uint8 zero point)
  and a residual r = z - round(z); W = (q - round(z)) * s - r * s, and the residual part is
  x's per-group sums times (r * s), one small float matmul beside MatMulNBits.
Both dequantize to exactly fastflow's weights. The torch reference below also models level 4's
activation rounding, so the export check compares like with like.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from ..numerics import pack_int4, unpack_int4
from ..quant.modules import Fp8Linear, Int4Linear, Int8Linear, W8A8Linear

BLOCK_SIZES = (128, 64, 32, 16)  # MatMulNBits: a power of two >= 16
INT8_BLOCK = 32  # int8 rows have one scale: the block only sets level 4's activation blocks (llama.cpp's 32)
INT8_ACTIVATIONS = 4  # accuracy_level that quantizes activations to int8


@torch.library.custom_op("fastflow_onnx::matmul_nbits", mutates_args=())
def matmul_nbits(x: Tensor, b: Tensor, scales: Tensor, zeros: Tensor, bias: Tensor | None, k: int, n: int,
                 bits: int, block_size: int, accuracy_level: int) -> Tensor:
    """Reference of MatMulNBits (torch side of the export; ONNX Runtime runs its own kernel)."""
    w = dequantize(b, scales, zeros, k, n, bits, block_size)
    xf = x.float()
    if accuracy_level == INT8_ACTIVATIONS:
        xf = round_activations(xf, block_size)
    return torch.nn.functional.linear(xf, w, None if bias is None else bias.float()).to(x.dtype)


@matmul_nbits.register_fake
def _(x, b, scales, zeros, bias, k, n, bits, block_size, accuracy_level):
    return x.new_empty(*x.shape[:-1], n)


def round_activations(x: Tensor, block_size: int) -> Tensor:
    """x as level 4 sees it: symmetric int8 per block of `block_size` inputs, scale = absmax / 127."""
    k = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, -k % block_size))
    blocks = padded.reshape(*x.shape[:-1], -1, block_size)
    scale = blocks.abs().amax(-1, keepdim=True) / 127.0
    codes = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1.0)), 0.0)
    return (codes * scale).reshape(padded.shape)[..., :k]


def dequantize(b: Tensor, scales: Tensor, zeros: Tensor, k: int, n: int, bits: int, block_size: int) -> Tensor:
    """(N, K) fp32 weights from MatMulNBits' inputs (uint8 zero points: packed like B)."""
    blocks = scales.numel() // n
    codes = unpack_int4(b.reshape(n, -1)) if bits == 4 else b.reshape(n, -1)
    z = unpack_int4(zeros.reshape(n, -1))[:, :blocks] if bits == 4 else zeros.reshape(n, blocks)
    shape = (n, blocks, 1)
    w = (codes.float().reshape(n, blocks, block_size) - z.float().reshape(shape)) * scales.float().reshape(shape)
    return w.reshape(n, -1)[:, :k]


def block_size_for(in_features: int) -> int:
    return next((b for b in BLOCK_SIZES if in_features % b == 0), BLOCK_SIZES[-1])


def int4_inputs(m: Int4Linear) -> dict | None:
    """MatMulNBits inputs of an int4 layer and its zero-point residual (None where none is left),
    or None where its group is no valid block size."""
    g = m.group_size
    if g < 16 or g & (g - 1):
        return None
    n, k = m.out_features, m.in_features
    zero = m.zero.float()
    whole = torch.round(zero).clamp(0, 15)
    residual = (zero - whole) * m.scale.float()
    packed_zero = pack_int4(torch.nn.functional.pad(whole, (0, (k // g) % 2)).to(torch.uint8))
    return dict(b=m.portable_qweight().reshape(n, k // g, g // 2).contiguous(),
                scales=m.scale.float().contiguous(), zeros=packed_zero.contiguous(), bits=4, block_size=g,
                residual=residual.t().contiguous() if residual.any() else None)


def int8_inputs(m: Int8Linear) -> dict:
    n, k = m.out_features, m.in_features
    blocks = -(-k // INT8_BLOCK)
    codes = torch.zeros(n, blocks * INT8_BLOCK, dtype=torch.uint8)
    codes[:, :k] = (m.qweight.to(torch.int16) + 128).to(torch.uint8)
    return dict(b=codes.reshape(n, blocks, INT8_BLOCK), scales=m.scale.float()[:, None].expand(n, blocks).contiguous(),
                zeros=torch.full((n, blocks), 128, dtype=torch.uint8), bits=8, block_size=INT8_BLOCK, residual=None)


class NBitsLinear(nn.Module):
    """A quantized linear as one MatMulNBits node (its inputs become the graph's initializers)."""

    def __init__(self, source: nn.Module, inputs: dict, accuracy_level: int):
        super().__init__()
        self.k, self.n = source.in_features, source.out_features
        self.bits, self.block_size, self.accuracy_level = inputs["bits"], inputs["block_size"], accuracy_level
        for name in ("b", "scales", "zeros", "residual"):
            self.register_buffer(name, inputs[name])
        bias = source.bias
        self.register_buffer("bias", None if bias is None else bias.float())

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = matmul_nbits(xf, self.b, self.scales, self.zeros, self.bias, self.k, self.n, self.bits,
                         self.block_size, self.accuracy_level)
        if self.residual is not None:  # the zero points' fractional part: x's group sums @ (r * s)
            groups = self.residual.shape[0]
            y = y - xf.reshape(*xf.shape[:-1], groups, self.k // groups).sum(-1) @ self.residual
        return y.to(x.dtype)


def unexportable_layers(model: nn.Module) -> list[str]:
    """Names of quantized layers ONNX Runtime has no weight format for (W8A8, FP8)."""
    return [name for name, m in model.named_modules() if isinstance(m, (W8A8Linear, Fp8Linear))]


def nbits_module(m: nn.Module, accuracy_level: int) -> nn.Module | None:
    if isinstance(m, Int8Linear):
        return NBitsLinear(m, int8_inputs(m), accuracy_level)
    if isinstance(m, Int4Linear):
        inputs = int4_inputs(m)
        return _dequantized_linear(m) if inputs is None else NBitsLinear(m, inputs, accuracy_level)
    return None


@contextlib.contextmanager
def as_matmul_nbits(model: nn.Module, accuracy_level: int = INT8_ACTIVATIONS):
    """Within the block, `model`'s int8/int4 linears are NBitsLinear modules; restored after."""
    swapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            replacement = nbits_module(child, accuracy_level)
            if replacement is not None:
                setattr(parent, name, replacement)
                swapped.append((parent, name, child))
    try:
        yield len(swapped)
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)


def _dequantized_linear(m: Int4Linear) -> nn.Linear:
    """An int4 layer whose group MatMulNBits cannot take, as a float linear of the same weights."""
    linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
    linear.weight = nn.Parameter(m.dequantized_weight().to(m.dtype), requires_grad=False)
    if m.bias is not None:
        linear.bias = nn.Parameter(m.bias, requires_grad=False)
    return linear


def onnx_translation():
    """The exporter's translation of fastflow_onnx::matmul_nbits into com.microsoft.MatMulNBits."""
    from onnxscript import values

    matmul = values.Op(values.Opset("com.microsoft", 1), "MatMulNBits", _matmul_nbits_schema())

    def translate(x, b, scales, zeros, bias, k: int, n: int, bits: int, block_size: int, accuracy_level: int):
        attrs = dict(K=k, N=n, bits=bits, block_size=block_size, accuracy_level=accuracy_level)
        if bias is None:
            return matmul(x, b, scales, zeros, **attrs)
        return matmul(x, b, scales, zeros, None, bias, **attrs)

    return {torch.ops.fastflow_onnx.matmul_nbits.default: translate}


def _matmul_nbits_schema():
    """MatMulNBits' signature as ONNX Runtime declares it (the onnx package has no contrib schemas)."""
    from onnx.defs import OpSchema

    optional = OpSchema.FormalParameterOption.Optional

    def param(name, type_str, option=OpSchema.FormalParameterOption.Single):
        return OpSchema.FormalParameter(name, type_str, param_option=option)

    ints = OpSchema.AttrType.INT
    return OpSchema(
        "MatMulNBits", "com.microsoft", 1,
        inputs=[param("A", "T1"), param("B", "T2"), param("scales", "T1"), param("zero_points", "T3", optional),
                param("g_idx", "T4", optional), param("bias", "T1", optional)],
        outputs=[param("Y", "T1")],
        type_constraints=[("T1", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("T2", ["tensor(uint8)", "tensor(int32)"], ""),
                          ("T3", ["tensor(uint8)", "tensor(int32)", "tensor(float)", "tensor(float16)",
                                  "tensor(bfloat16)"], ""),
                          ("T4", ["tensor(int32)"], "")],
        attributes=[OpSchema.Attribute(name, ints, "") for name in ("K", "N", "bits", "block_size", "accuracy_level")])
