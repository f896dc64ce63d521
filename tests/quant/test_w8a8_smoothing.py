"""W8A8 with a SmoothQuant `smooth` vector: one order of operations on every device.

The reference multiplies x by `smooth` in fp32 and quantizes that product per token (or with the
static scale). The CPU path and the CUDA path (`w8a8_triton`, run here on CPU tensors by the Triton
interpreter that conftest turns on) must quantize exactly the same int8 codes, so their outputs equal
the reference's bit for bit: int8 x int8 sums are exact, and the scales, the bias and the one final
rounding are applied in the same order. A path that rounded x * smooth to bf16 first would move codes
by one and more -- the second test shows that such an order is caught by these comparisons."""
import pytest
import torch

from ffl_backend import numerics as P
from ffl_backend.kernels import _triton
from ffl_backend.kernels import quant_linear as K

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = [(1, 96, 48), (5, 64, 40), (33, 64, 40)]  # (M, K, N): GEMV tiles, and the GEMM tile at M = 33

needs_interpreter = pytest.mark.skipif(not _triton.interpreting(),
                                       reason="needs TRITON_INTERPRET=1 (set by conftest before triton is imported)")


def _case(m, k, n, dtype, static):
    """x, an int8 weight with fp32 scales, a bias, a smooth vector of non-bf16 values (so the product's
    rounding matters) and, for static, one per-tensor scale that clips the largest activations."""
    x = torch.randn(m, k, dtype=dtype) * 2
    q, w_scale = P.quantize_int8(torch.randn(n, k) * 0.05, torch.float32)
    smooth = torch.rand(k) * 1.5 + 0.25
    x_scale = (x.float() * smooth).abs().max().reshape(1) / 127 * 0.8 if static else None
    return x, q, w_scale, x_scale, torch.randn(n, dtype=dtype), smooth


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("static", (False, True))
def test_cuda_and_cpu_paths_smooth_as_the_reference_does(dtype, m, k, n, static):
    x, q, w_scale, x_scale, bias, smooth = _case(m, k, n, dtype, static)
    ref = K.w8a8_linear_ref(x, q, w_scale, x_scale, bias, smooth)
    triton_path = K.w8a8_triton(x, q, w_scale, x_scale, bias, smooth)
    cpu_path = torch.ops.fastflow.w8a8_linear(x, q, w_scale, x_scale, bias, smooth)
    assert triton_path.dtype == cpu_path.dtype == dtype
    assert torch.equal(triton_path, ref), (triton_path.double() - ref.double()).abs().max()
    # torch._int_mm and the float64 reference sum the same exact integers; only the fp32 scale
    # products may be ordered differently by the CPU kernels' vector code
    torch.testing.assert_close(cpu_path, ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_smoothing_in_the_model_dtype_would_be_caught(dtype):
    """The order these tests pin down matters: rounding x * smooth to 16 bits before quantizing
    (what the CUDA path once did) changes the output of a 64-wide layer."""
    x, q, w_scale, _, bias, smooth = _case(33, 64, 40, dtype, False)
    ref = K.w8a8_linear_ref(x, q, w_scale, None, bias, smooth)
    rounded_first = K.w8a8_linear_ref(x * smooth.to(dtype), q, w_scale, None, bias)
    assert not torch.equal(rounded_first, ref)


def test_smoothed_rows_is_the_fp32_product():
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    smooth = torch.rand(8) + 0.5
    rows = K.smoothed_rows(x, smooth)
    assert rows.dtype == torch.float32 and rows.shape == (6, 8)
    assert torch.equal(rows, x.reshape(6, 8).float() * smooth)
    assert K.smoothed_rows(x, None).dtype == torch.bfloat16  # nothing to multiply: x's own rows
