"""The quantized-linear Triton kernels compiled for the GPU and run natively: W8A16, W4A16 and W8A8
(dynamic and static activation scales) at GEMV and GEMM tiles, FP8 on sm_90, per-token activation
quantization bit for bit; the ops on CUDA against the quantized-module references (SmoothQuant's
`smooth` included); and the four ops through `opcheck` on CUDA. References and bounds are those of
tests/kernels/test_triton_quant.py and tests/quant/test_quant_ops.py."""
import pytest
import torch

from ffl_backend import numerics as N
from ffl_backend.kernels import quant_linear as K
from ffl_backend.kernels import triton_quant as Q
from tests.cuda.support import CUDA_TESTS, DEVICE, DTYPES, INTERPRETED, check, needs_sm90, randn
from tests.helpers import ATOL

pytestmark = CUDA_TESTS

# (M, N, K): batch-1 decode of a Llama-3-8B projection, odd sizes on the GEMV tile (M <= 16), and
# the GEMM tile (prefill) at M = 17 and 300
SHAPES = [(1, 4096, 4096), (7, 1000, 576), (16, 1536, 4000), (17, 333, 1024), (300, 1000, 1536)]
# int4 needs K to be a multiple of the group size
INT4_SHAPES = [(1, 4096, 4096, 128), (7, 1000, 576, 32), (16, 1536, 4096, 64), (17, 333, 1024, 128),
               (300, 1000, 1536, 64)]


def _skip_big(m, n, k):
    if INTERPRETED and m * n * k > 50_000_000:
        pytest.skip("too large for the interpreter")


def _weight(n, k):
    return randn(n, k, scale=0.05)


def _bias(with_bias, n, dtype):
    return randn(n, dtype=dtype) if with_bias else None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_w8a16(dtype, m, n, k):
    _skip_big(m, n, k)
    q, scale = N.quantize_int8(_weight(n, k), dtype)
    args = (randn(m, k, dtype=dtype), q, scale, _bias(m % 2 == 1, n, dtype))
    check(Q.int8_linear_triton(*args), K.int8_linear_ref, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,group", INT4_SHAPES)
def test_w4a16(dtype, m, n, k, group):
    _skip_big(m, n, k)
    codes, scale, zero = N.quantize_int4(_weight(n, k), group, scale_dtype=dtype)
    args = (randn(m, k, dtype=dtype), N.pack_int4(codes), scale, zero, group, _bias(m % 2 == 1, n, dtype))
    check(Q.int4_linear_triton(*args), K.int4_linear_ref, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("static", [False, True])
def test_w8a8(dtype, m, n, k, static):
    _skip_big(m, n, k)
    q, w_scale = N.quantize_int8(_weight(n, k), torch.float32)
    x = randn(m, k, dtype=dtype)
    # a calibrated static scale that clips the largest activations, so the clamp is exercised
    x_scale = (x.float().abs().amax() / 127 * 0.8).reshape(1) if static else None
    args = (x, q, w_scale, x_scale, _bias(m % 2 == 1, n, dtype))
    check(Q.w8a8_linear_triton(*args), K.w8a8_linear_ref, args)


@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp8(dtype, m, n, k):
    _skip_big(m, n, k)
    q, w_scale = N.quantize_fp8(_weight(n, k))
    args = (randn(m, k, dtype=dtype), q, w_scale, _bias(m % 2 == 1, n, dtype))
    # sm_90 sums each wgmma's 32 fp8 products in ~14 bits before the fp32 accumulator takes them
    # (DeepSeek-V3 report, section 3.3.2): up to 2**-9 of the largest output on top of the usual bound
    # (before the promotion: errors of 0.006 to 0.1, benchmarks/results/gpu_check_h200_2026-12-04a).
    hardware = 2.0**-9 * K.fp8_linear_ref(*args).abs().max().item()
    check(Q.fp8_linear_triton(*args), K.fp8_linear_ref, args, atol=ATOL[dtype] + hardware)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=needs_sm90)])
@pytest.mark.parametrize("m,k", [(5, 4096), (2, 9000)])  # 9000 > one 8192 block: two passes loop
def test_quantize_per_token_is_bit_exact(dtype, fp8, m, k):
    """Half-to-even rounding and IEEE division (tl.div_rn) on the GPU give the reference's codes."""
    x = randn(m, k, dtype=dtype, scale=3)
    x[1] = 0  # an all-zero token: scale 0, zeros, no division by zero
    xq, xs = (Q.quantize_per_token_fp8_triton if fp8 else Q.quantize_per_token_triton)(x)
    rq, rs = N.quantize_act_fp8(x) if fp8 else N.quantize_act_int8(x)
    assert torch.equal(xs, rs[:, 0]) and xs[1] == 0
    assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))


def _module_cases(dtype, scheme):
    """(op, args, reference) as a quantized module calls the op: 3-D activations, the module layouts."""
    x, w, b = randn(2, 5, 576, dtype=dtype), _weight(1536, 576), randn(1536, dtype=dtype)
    ops = torch.ops.fastflow
    if scheme == "int8":
        q, s = N.quantize_int8(w, dtype)
        return ops.int8_linear.default, (x, q, s, b, None), K.int8_linear_ref, (x, q, s, b)
    if scheme == "int4":
        codes, s, z = N.quantize_int4(w, 64, scale_dtype=dtype)
        qw = N.pack_int4(codes)
        return (ops.int4_linear.default, (x, qw, s, z, 64, b, None, None), K.int4_linear_ref,
                (x, qw, s, z, 64, b))
    q, s = (N.quantize_fp8(w) if scheme == "fp8" else N.quantize_int8(w, torch.float32))
    if scheme == "fp8":
        return ops.fp8_linear.default, (x, q, s, b), K.fp8_linear_ref, (x, q, s, b)
    smooth = torch.rand(576, device=DEVICE) * 1.5 + 0.25  # SmoothQuant's 1/s, applied inside the op
    x_scale = ((x.float() * smooth).abs().amax() / 127).reshape(1) if scheme == "w8a8_static" else None
    args = (x, q, s, x_scale, b, smooth)
    return ops.w8a8_linear.default, args, K.w8a8_linear_ref, args


SCHEMES = ["int8", "int4", "w8a8", "w8a8_static", pytest.param("fp8", marks=needs_sm90)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_ops_on_cuda_match_the_module_references(dtype, scheme):
    if INTERPRETED and scheme.startswith("int"):
        pytest.skip("the int8/int4 CPU paths compute in bf16: tests/quant/test_quant_ops.py bounds them")
    op, args, ref_fn, ref_args = _module_cases(dtype, scheme)
    out = op(*args)
    assert out.shape == (2, 5, 1536) and out.dtype == dtype
    if scheme.startswith("int"):
        check(out, ref_fn, ref_args)
    else:
        # W8A8 and FP8 quantize activations exactly as the reference does (smoothing in fp32 first):
        # what is left is the order of fp32 scale products and the bias add (an FMA on the GPU)
        torch.testing.assert_close(out, ref_fn(*ref_args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_opcheck(dtype, scheme):
    op, args, _, _ = _module_cases(dtype, scheme)
    if scheme == "fp8":  # opcheck's schema test compares inputs with ops that have no float8 kernels
        torch.library.opcheck(op, args, test_utils=("test_faketensor", "test_autograd_registration",
                                                    "test_aot_dispatch_dynamic"))
    else:
        torch.library.opcheck(op, args)
