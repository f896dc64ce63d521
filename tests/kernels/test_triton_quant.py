"""Quantized-linear Triton kernels (W8A16, W4A16, W8A8, FP8) against their float64 references, under
the Triton interpreter on CPU tensors (conftest sets TRITON_INTERPRET). Shapes are small but ragged:
M = 1 and 5 take the GEMV tile, M = 33 the GEMM tile (two M-blocks of 16 rows would hide it); N and
K are not multiples of the block sizes except where the int4 group structure requires it.

Weights are quantized here with a few lines of torch, independent of ffl_backend.quant."""
import pytest
import torch
import torch.nn.functional as F

from ffl_backend import numerics as P
from ffl_backend.kernels import quant_linear as K
from ffl_backend.kernels import triton_quant as Q
from tests.helpers import assert_matches_reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = [(1, 48, 64), (5, 80, 96), (33, 80, 96)]  # (M, N, K)


def _int8_weight(n, k):
    w = torch.randn(n, k) * 0.05
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def _int4_weight(n, k, group_size, dtype):
    """Asymmetric min/max per group; float zero points in x's dtype, as the contract allows."""
    w = torch.randn(n, k // group_size, group_size) * 0.05
    lo, hi = w.amin(-1), w.amax(-1)
    scale, zero = ((hi - lo) / 15).to(dtype), (-lo / ((hi - lo) / 15)).to(dtype)
    q = torch.round(w / scale.float()[..., None] + zero.float()[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(n, k)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale, zero


def _bias(with_bias, n, dtype):
    return torch.randn(n, dtype=dtype) if with_bias else None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", (False, True))
def test_int8_linear_matches_reference(dtype, m, n, k, with_bias):
    q, scale = _int8_weight(n, k)
    args = (torch.randn(m, k, dtype=dtype), q, scale.to(dtype), _bias(with_bias, n, dtype))
    assert_matches_reference(Q.int8_linear_triton(*args), K.int8_linear_ref, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,group_size", [(1, 48, 64, 32), (5, 80, 128, 64), (5, 48, 128, 128),
                                              (33, 80, 128, 32), (33, 48, 256, 128)])
@pytest.mark.parametrize("with_bias", (False, True))
def test_int4_linear_matches_reference(dtype, m, n, k, group_size, with_bias):
    q, scale, zero = _int4_weight(n, k, group_size, dtype)
    args = (torch.randn(m, k, dtype=dtype), q, scale, zero, group_size, _bias(with_bias, n, dtype))
    assert_matches_reference(Q.int4_linear_triton(*args), K.int4_linear_ref, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("static,with_bias", [(False, False), (False, True), (True, False), (True, True)])
def test_w8a8_linear_matches_reference(dtype, m, n, k, static, with_bias):
    q, w_scale = _int8_weight(n, k)
    x = torch.randn(m, k, dtype=dtype)
    # a static scale from "calibration" that clips the largest activations, so the clamp is exercised
    x_scale = (x.float().abs().amax() / 127 * 0.8).reshape(()) if static else None
    args = (x, q, w_scale, x_scale, _bias(with_bias, n, dtype))
    assert_matches_reference(Q.w8a8_linear_triton(*args), K.w8a8_linear_ref, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", (False, True))
def test_fp8_linear_matches_reference(dtype, m, n, k, with_bias):
    # The interpreter loads float8_e4m3fn CPU tensors and runs the e4m3 tl.dot (via fp16), so the
    # FP8 kernel is tested here like the others; only the compiled sm_90 path is GPU-only.
    w = torch.randn(n, k) * 0.05
    w_scale = w.abs().amax(dim=1) / 448
    q = (w / w_scale[:, None]).to(torch.float8_e4m3fn)
    args = (torch.randn(m, k, dtype=dtype), q, w_scale, _bias(with_bias, n, dtype))
    assert_matches_reference(Q.fp8_linear_triton(*args), K.fp8_linear_ref, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", (False, True))
@pytest.mark.parametrize("m,k", [(5, 96), (2, 9000)])  # 9000 > one 8192 block: two passes loop
def test_quantize_per_token_is_bit_exact(dtype, fp8, m, k):
    x = torch.randn(m, k, dtype=dtype) * 3
    x[1] = 0  # an all-zero token: scale 0, zeros, no division by zero
    fn = Q.quantize_per_token_fp8_triton if fp8 else Q.quantize_per_token_triton
    xq, xs = fn(x)
    rq, rs = P.quantize_act_fp8(x) if fp8 else P.quantize_act_int8(x)
    assert xq.dtype == rq.dtype and xs.dtype == torch.float32 and xs.shape == (m,)
    assert torch.equal(xs, rs[:, 0]) and xs[1] == 0
    assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))


def test_int8_quantize_rounds_half_to_even():
    # absmax 127 -> scale exactly 1, so x / scale hits the .5 ties: the kernel rounds them like
    # torch.round (half to even), not half away from zero (which would give 1, 3, -3, 4).
    x = torch.tensor([[127.0, 0.5, 2.5, -2.5, 3.5, -127.0, 1.49999988, -0.5]])
    xq, xs = Q.quantize_per_token_triton(x)
    assert xs.item() == 1.0
    assert xq.tolist() == [[127, 0, 2, -2, 4, -127, 1, 0]]
    assert torch.equal(xq, torch.round(x).to(torch.int8))


def test_fp8_quantize_rounds_like_torch_cast():
    # absmax 448 -> scale 1. Ties between e4m3 neighbours round to the even mantissa (17 -> 16,
    # 19 -> 20), 31 carries into the next binade (-> 32), subnormals (< 2**-6) round too: the cases
    # the interpreter's own fp32->fp8 cast gets wrong, which is why the kernel rounds in fp32 first.
    vals = [448.0, 17.0, 19.0, 31.0, -31.0, 1.5 * 2**-9, 2.5 * 2**-9, 3e-4, 0.0, -447.0, 1000.0 / 3]
    x = torch.tensor([vals])
    xq, xs = Q.quantize_per_token_fp8_triton(x)
    assert xs.item() == 1.0
    assert xq.float().tolist() == x.to(torch.float8_e4m3fn).float().tolist()
    assert xq.float()[0, 1:5].tolist() == [16.0, 20.0, 32.0, -32.0]


def test_int4_nibble_order_and_reference_dequant():
    # byte j of row n: k = 2j in the low nibble, k = 2j + 1 in the high nibble
    qw = torch.tensor([[0x21, 0xF0]], dtype=torch.uint8)
    assert P.unpack_int4(qw).tolist() == [[1, 2, 0, 15]]
    x = torch.eye(4)
    scale, zero = torch.tensor([[0.5, 2.0]]), torch.tensor([[1.0, 8.0]])
    expect = torch.tensor([[0.0, 0.5, -16.0, 14.0]]).T  # (q - zero) * scale, one row per unit x
    torch.testing.assert_close(K.int4_linear_ref(x, qw, scale, zero, 2), expect)
    # the kernel, K = 64 in two groups of 32: unit rows pick k = 0, 1, 2 (group 0) and k = 35 (group 1)
    y = Q.int4_linear_triton(torch.eye(64)[[0, 1, 2, 35]], qw.repeat(1, 16), scale, zero, 32)
    assert y.flatten().tolist() == [0.0, 0.5, -0.5, 14.0]


def test_references_are_plain_dequantize_then_linear():
    x, b = torch.randn(3, 64), torch.randn(24)
    q, s = _int8_weight(24, 64)
    torch.testing.assert_close(K.int8_linear_ref(x, q, s, b), F.linear(x, q.float() * s[:, None], b))
    q4, s4, z4 = _int4_weight(24, 64, 32, torch.float32)
    w4 = (P.unpack_int4(q4).float() - z4.repeat_interleave(32, 1)) * s4.repeat_interleave(32, 1)
    torch.testing.assert_close(K.int4_linear_ref(x, q4, s4, z4, 32), F.linear(x, w4))
    xq, xs = P.quantize_act_int8(x)
    torch.testing.assert_close(K.w8a8_linear_ref(x, q, s, None, b),
                               F.linear(xq.float() * xs, q.float() * s[:, None], b))


@pytest.mark.parametrize("scheme,min_sqnr_db", [("int8", 35), ("int4", 18), ("w8a8", 30), ("fp8", 25)])
def test_quantized_output_stays_close_to_the_float_linear(scheme, min_sqnr_db):
    """End to end: quantize a weight, run the kernel, compare with F.linear on the float weight."""
    n, k, g = 80, 128, 32
    x, w = torch.randn(5, k), torch.randn(n, k) * 0.05
    if scheme == "int4":
        lo, hi = w.view(n, -1, g).amin(-1), w.view(n, -1, g).amax(-1)
        scale = (hi - lo) / 15
        zero = -lo / scale
        q = torch.round(w.view(n, -1, g) / scale[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8)
        q = q.reshape(n, k)
        y = Q.int4_linear_triton(x, q[:, 0::2] | (q[:, 1::2] << 4), scale, zero, g)
    elif scheme == "fp8":
        s = w.abs().amax(1) / 448
        y = Q.fp8_linear_triton(x, (w / s[:, None]).to(torch.float8_e4m3fn), s)
    else:
        s = w.abs().amax(1) / 127
        q = torch.round(w / s[:, None]).to(torch.int8)
        y = Q.int8_linear_triton(x, q, s) if scheme == "int8" else Q.w8a8_linear_triton(x, q, s)
    ref = F.linear(x, w)
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (y - ref).pow(2).sum()).item()
    assert sqnr >= min_sqnr_db, sqnr


def test_strided_rows_empty_batch_and_bad_arguments():
    x = torch.randn(5, 2 * 64)[:, :64]  # row stride 128: a view, no copy
    q, s = _int8_weight(48, 64)
    torch.testing.assert_close(Q.int8_linear_triton(x, q, s), K.int8_linear_ref(x, q, s))
    assert Q.w8a8_linear_triton(x[:0], q, s).shape == (0, 48)
    q4, s4, z4 = _int4_weight(48, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="group_size"):
        Q.int4_linear_triton(x, q4, s4, z4, 48)
    with pytest.raises(ValueError, match="scale and zero"):
        Q.int4_linear_triton(x, q4, s4[:, :1], z4, 32)
    with pytest.raises(ValueError, match="does not match K"):
        Q.int8_linear_triton(x[:, :32], q, s)
    with pytest.raises(ValueError, match="per-tensor"):
        Q.w8a8_linear_triton(x, q, s, x_scale=torch.ones(2))


def test_aot_specs_cover_every_launch_config():
    """Each (tile, BLOCK_K) a launcher can pick has a spec; FP8 kernels are sm_90-only."""
    specs = Q.aot_specs()
    names = {s.name for s in specs}
    for dt in ("fp32", "fp16", "bf16"):
        for m in (1, 16, 17, 4096):
            tag = "gemv" if m <= Q.GEMV_MAX_M else "gemm"
            for g in Q.INT4_GROUP_SIZES:
                assert f"w4a16[{dt},{tag},K{Q.gemm_config(m, g)[2]},bias=True]" in names
            for name in ("w8a16[{},{},bias=False]", "w8a8[{},{},static,bias=True]",
                         "fp8_linear[{},{},fp8,bias=False]"):
                assert name.format(dt, tag) in names
    assert all(s.min_arch == (90 if "fp8" in s.name else 80) for s in specs)
