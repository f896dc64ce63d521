"""The quantized KV-cache format (attention/kv_quant.py) and every attention op reading it: CPU paths
(C++ decode kernel, SDPA, soft-capping), the Triton kernels (interpreted) for prefill, split-K decode
and paged decode, against the float64 reference on the dequantized values; opcheck."""
import pytest
import torch

from ffl_backend.attention import decode as D
from ffl_backend.attention import paged as PG
from ffl_backend.attention import prefill as P
from ffl_backend.attention.kv_quant import (
    dequantize_kv,
    packed_width,
    quantize_kv,
    row_bytes,
    row_scales,
    storage_dtype,
)
from ffl_backend.attention.reference import attention_ref
from tests.attention.test_paged import make_case
from tests.helpers import DTYPES, assert_matches_reference

FORMATS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("kv", FORMATS.values())
@pytest.mark.parametrize("d", [30, 64, 7])
def test_round_trip_error_is_within_the_format(kv, d):
    x = torch.randn(3, 5, 11, d) * torch.logspace(-3, 2, 11)[:, None]  # rows of very different ranges
    x[0, 0, 0] = 0.0  # a zero row stays exact
    packed = quantize_kv(x, kv)
    assert packed.dtype == kv and packed.shape[-1] == packed_width(d) == -(-d // 4) * 4 + 4
    amax = x.abs().amax(-1, keepdim=True)
    scale = row_scales(packed, d)
    back = dequantize_kv(packed, d, torch.float64)
    err = (back - x.double()).abs()
    if kv == torch.int8:
        torch.testing.assert_close(scale, torch.where(amax > 0, amax / 127, 1.0))
        assert (err <= scale.double() / 2 * (1 + 1e-6)).all()
    else:  # e4m3: 3 mantissa bits (relative 2^-4), subnormals below 2^-6 of the scale's unit
        assert (err <= x.abs().double() / 16 + scale.double() * 2.0 ** -10).all()
    assert back[0, 0, 0].abs().max() == 0


def test_storage_dtypes_and_bytes():
    assert storage_dtype("int8") == torch.int8 and storage_dtype("FP8") == torch.float8_e4m3fn
    assert storage_dtype(None) is None
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        storage_dtype("int4")
    assert row_bytes(64, torch.bfloat16) == 128 and row_bytes(64, torch.int8) == 68 and row_bytes(30, "fp8") == 36


def _packed(kv, *shape):
    return quantize_kv(torch.randn(*shape) * 3, kv)


def _ref(kq, vq, d):
    """attention_ref over K/V dequantized in the query's precision (float64 for the exact run)."""
    def ref(q, *args, **kwargs):
        return attention_ref(q, dequantize_kv(kq, d, q.dtype), dequantize_kv(vq, d, q.dtype), *args, **kwargs)
    return ref


def _mask(batch, q_len, length, pads):
    mask = torch.ones(batch, 1, q_len, length, dtype=torch.bool)
    for row, pad in enumerate(pads):
        mask[row, ..., :pad] = False
    return mask


# (q heads, kv heads, q_len, cache length, filled, head dim, window, softcap)
DECODE_CASES = [(9, 3, 1, 150, 141, 64, 0, 0.0), (8, 2, 3, 90, 57, 30, 0, 0.0), (4, 4, 1, 120, 100, 16, 9, 0.0),
                (6, 2, 2, 70, 33, 24, 0, 5.0)]


@pytest.mark.parametrize("kv", FORMATS.values())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,q_len,length,filled,d,window,cap", DECODE_CASES)
def test_decode_cpu_reads_quantized_caches(kv, dtype, hq, hkv, q_len, length, filled, d, window, cap):
    q = torch.randn(2, hq, q_len, d, dtype=dtype)
    kq, vq = _packed(kv, 2, hkv, length, d), _packed(kv, 2, hkv, length, d)
    mask = _mask(2, q_len, length, (4, 0))
    out = torch.ops.fastflow.attention_decode(q, kq, vq, torch.tensor(filled), 0.3, window, mask, cap)
    assert_matches_reference(out, _ref(kq, vq, d), (q, 0.3, window, filled, mask, cap), interpreted=False)


@pytest.mark.parametrize("kv", FORMATS.values())
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_cpu_reads_quantized_caches(kv, dtype):
    q = torch.randn(2, 6, 37, 30, dtype=dtype)
    kq, vq = _packed(kv, 2, 2, 37, 30), _packed(kv, 2, 2, 37, 30)
    for window, cap in ((0, 0.0), (8, 0.0), (0, 4.0)):
        out = torch.ops.fastflow.attention_prefill(q, kq, vq, 0.25, window, cap)
        assert_matches_reference(out, _ref(kq, vq, 30), (q, 0.25, window), {"softcap": cap}, interpreted=False)


@pytest.mark.parametrize("kv", FORMATS.values())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,cap", [(0, 0.0), (6, 0.0), (0, 3.0)])
def test_paged_cpu_reads_quantized_pools(kv, dtype, window, cap):
    q, k, v, table, lens = make_case(3, 9, 3, 30, 8, [5, 61, 33], dtype=torch.float32)
    kq, vq = quantize_kv(k, kv), quantize_kv(v, kv)
    q = q.to(dtype)
    out = PG.paged_decode_cpu(q, kq, vq, table, lens, 0.2, window, cap)
    kd, vd = dequantize_kv(kq, 30, torch.float64), dequantize_kv(vq, 30, torch.float64)
    exact = PG.paged_decode_ref(q.double(), kd, vd, table, lens, 0.2, window, cap)
    lowp = PG.paged_decode_ref(q, kd.to(dtype), vd.to(dtype), table, lens, 0.2, window, cap)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.double() - exact).abs().max() <= 2 * (lowp.double() - exact).abs().max() + tol


def test_mismatched_packed_rows_are_refused():
    q = torch.randn(1, 2, 1, 30)
    kq = _packed(torch.int8, 1, 2, 8, 40)  # rows of a 40-dim head
    with pytest.raises(ValueError, match="packed_width"):
        P.attention_prefill_cpu(q, kq, kq, 0.2)


@pytest.mark.parametrize("kv", FORMATS.values())
def test_opcheck_with_quantized_caches(kv):
    # torch's schema check compares inputs before/after with a multiply CPU torch lacks for fp8
    # ("mul_cpu_reduced_float"): fp8 runs the other checks
    utils = OPCHECKS if kv == torch.int8 else tuple(u for u in OPCHECKS if u != "test_schema")
    q = torch.randn(2, 6, 2, 16)
    kq, vq = _packed(kv, 2, 3, 40, 16), _packed(kv, 2, 3, 40, 16)
    torch.library.opcheck(torch.ops.fastflow.attention_decode, (q, kq, vq, torch.tensor(30), 0.25, 0, None),
                          test_utils=utils)
    qq, kp, vp, table, lens = make_case(2, 6, 3, 16, 8, [9, 20])
    torch.library.opcheck(torch.ops.fastflow.paged_decode,
                          (qq, quantize_kv(kp, kv), quantize_kv(vp, kv), table, lens, 0.25), test_utils=utils)
    q = torch.randn(1, 4, 12, 16)
    torch.library.opcheck(torch.ops.fastflow.attention_prefill, (q, kq[:1, :2, :12], vq[:1, :2, :12], 0.25),
                          test_utils=utils)


@pytest.mark.parametrize("kv", FORMATS.values())
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernels_read_quantized_caches(kv, dtype):
    d = 24
    kq, vq = _packed(kv, 2, 3, 150, d), _packed(kv, 2, 3, 150, d)
    mask = _mask(2, 2, 150, (0, 5))
    q = torch.randn(2, 9, 2, d, dtype=dtype)  # split-K decode
    out = D.attention_decode_triton(q, kq, vq, torch.tensor(141), 0.2, 0, mask)
    assert_matches_reference(out, _ref(kq, vq, d), (q, 0.2, 0, 141, mask))
    q = torch.randn(2, 24, 3, d, dtype=dtype)  # 8 x 3 rows per kv head: the tiled (flash) kernel
    mask = _mask(2, 3, 150, (0, 5))
    out = D.attention_decode_triton(q, kq, vq, torch.tensor(77), 0.2, 0, mask)
    assert_matches_reference(out, _ref(kq, vq, d), (q, 0.2, 0, 77, mask))
    q = torch.randn(2, 9, 40, d, dtype=dtype)  # prefill with a window and soft-capping
    k40, v40 = kq[:, :, :40], vq[:, :, :40]
    out = P.attention_prefill_triton(q, k40, v40, 0.2, 7, 4.0)
    assert_matches_reference(out, _ref(k40, v40, d), (q, 0.2, 7), {"softcap": 4.0})


@pytest.mark.parametrize("kv", FORMATS.values())
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_paged_kernel_reads_quantized_pools(kv, dtype):
    q, k, v, table, lens = make_case(3, 9, 3, 30, 16, [5, 61, 33])
    kq, vq = quantize_kv(k, kv), quantize_kv(v, kv)
    q = q.to(dtype)
    out = PG.paged_decode_triton(q, kq, vq, table, lens, 0.2, 20)
    kd, vd = dequantize_kv(kq, 30, torch.float64), dequantize_kv(vq, 30, torch.float64)
    exact = PG.paged_decode_ref(q.double(), kd, vd, table, lens, 0.2, 20)
    lowp = PG.paged_decode_ref(q, kd.to(dtype), vd.to(dtype), table, lens, 0.2, 20)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # interpreted bf16 rounding truncates (tests/helpers.py)
    assert (out.double() - exact).abs().max() <= 4 * (lowp.double() - exact).abs().max() + tol
