"""fastflow's int8/int4 linears as MatMulNBits inputs: the weights they describe are fastflow's own
(float64 reference), and ONNX Runtime's kernel computes what nbits' torch reference says, at float
activations and at accuracy_level 4 (int8 activations per block)."""
import pytest
import torch
from torch import nn

from ffl_backend.numerics import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from ffl_backend.quant.modules import Int4Linear, Int8Linear

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
nbits = pytest.importorskip("ffl_backend.onnx.nbits")

FP32_RTOL = 1e-5  # a K-term fp32 dot product against float64, K <= 2048


def _int4_linear(k: int, n: int, group: int, bias: bool) -> Int4Linear:
    linear = nn.Linear(k, n, bias=bias)
    m = Int4Linear(k, n, torch.float32, bias, "meta", group)
    q, m.scale, m.zero = quantize_int4(linear.weight.detach(), group)
    m.zero = m.zero + torch.rand_like(m.zero) * 0.9  # fractional zero points, as the fitted grid makes
    from ffl_backend.numerics import pack_int4

    m.qweight = pack_int4(q)
    m.bias = linear.bias.detach().clone() if bias else None
    return m.finalize()


def _int8_linear(k: int, n: int) -> Int8Linear:
    linear = nn.Linear(k, n, bias=False)
    m = Int8Linear(k, n, torch.float32, False, "meta")
    m.qweight, m.scale = quantize_int8(linear.weight.detach())
    return m.finalize()


def _ort_matmul_nbits(inputs: dict, k: int, n: int, level: int, bias=None):
    """A one-node ONNX Runtime session of MatMulNBits over `inputs` (nbits' layout)."""
    from onnx import TensorProto, helper, numpy_helper

    names = ["A", "B", "S", "Z", "", "bias"] if bias is not None else ["A", "B", "S", "Z"]
    inits = [numpy_helper.from_array(inputs["b"].numpy(), "B"), numpy_helper.from_array(inputs["scales"].numpy(), "S"),
             numpy_helper.from_array(inputs["zeros"].numpy(), "Z")]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias.numpy(), "bias"))
    node = helper.make_node("MatMulNBits", names, ["Y"], domain="com.microsoft", K=k, N=n, bits=inputs["bits"],
                            block_size=inputs["block_size"], accuracy_level=level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", n])], inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("k,n,group,bias", [(64, 24, 32, False), (96, 40, 32, True), (256, 17, 128, False),
                                            (192, 8, 64, True)])
def test_int4_inputs_describe_fastflows_weights(k, n, group, bias):
    m = _int4_linear(k, n, group, bias)
    inputs = nbits.int4_inputs(m)
    w = nbits.dequantize(inputs["b"], inputs["scales"], inputs["zeros"], k, n, 4, group).double()
    w = w - inputs["residual"].t().double().repeat_interleave(group, dim=1)  # the zero points' fractions
    ref = dequantize_int4(m.portable_qweight(), m.scale, m.zero, group, torch.float64)
    torch.testing.assert_close(w, ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    x = torch.randn(3, 5, k)
    y = nbits.NBitsLinear(m, inputs, accuracy_level=0)(x)
    exact = x.double() @ ref.t() + (m.bias.double() if bias else 0)
    torch.testing.assert_close(y.double(), exact, rtol=FP32_RTOL, atol=FP32_RTOL * float(exact.abs().max()))


@pytest.mark.parametrize("k,n", [(64, 16), (100, 9), (320, 33)])
def test_int8_inputs_describe_fastflows_weights(k, n):
    m = _int8_linear(k, n)
    inputs = nbits.int8_inputs(m)
    w = nbits.dequantize(inputs["b"], inputs["scales"], inputs["zeros"], k, n, 8, inputs["block_size"])
    torch.testing.assert_close(w, dequantize_int8(m.qweight, m.scale, torch.float32), rtol=0, atol=0)


@pytest.mark.parametrize("bits,k,n,group", [(4, 96, 40, 32), (4, 256, 24, 128), (8, 100, 9, None), (8, 576, 64, None)])
@pytest.mark.parametrize("level", [0, 4])
def test_onnxruntime_kernel_computes_the_reference(bits, k, n, group, level):
    m = _int4_linear(k, n, group, bias=True) if bits == 4 else _int8_linear(k, n)
    inputs = nbits.int4_inputs(m) if bits == 4 else nbits.int8_inputs(m)
    bias = m.bias.float() if m.bias is not None else None
    x = torch.randn(7, k)
    got = torch.from_numpy(_ort_matmul_nbits(inputs, k, n, level, bias).run(None, {"A": x.numpy()})[0])
    ref = nbits.matmul_nbits(x, inputs["b"], inputs["scales"], inputs["zeros"], bias, k, n, bits,
                             inputs["block_size"], level)
    # both sum the same (rounded) products in fp32; level 4's integer sums are exact
    torch.testing.assert_close(got, ref, rtol=FP32_RTOL, atol=FP32_RTOL * float(ref.abs().max()))


def test_level_4_rounds_activations_per_block_like_int8():
    x = torch.randn(4, 100) * torch.linspace(0.1, 10, 100)
    rounded = nbits.round_activations(x, 32)
    blocks = torch.nn.functional.pad(x, (0, 28)).reshape(4, 4, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    err = (torch.nn.functional.pad(rounded - x, (0, 28)).reshape(4, 4, 32)).abs()
    assert (err <= step / 2 + 1e-6 * step).all()
    assert not torch.equal(rounded, x)


def test_an_int4_group_that_is_no_power_of_two_exports_as_float_weights():
    m = _int4_linear(96, 8, 48, bias=False)
    assert nbits.int4_inputs(m) is None
    linear = nbits.nbits_module(m, 4)
    assert isinstance(linear, nn.Linear)
    torch.testing.assert_close(linear.weight, m.dequantized_weight())
