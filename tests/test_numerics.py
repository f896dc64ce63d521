"""Quantize/dequantize primitives: layouts, round trips, and SQNR floors on random weights.

The floors are the measured SQNR of Gaussian (256, 512) weights (stable to 0.1 dB across seeds)
minus ~0.5 dB, so a regression of the quantizer (a wrong scale, a clipped range) fails them."""
import pytest
import torch

from ffl_backend import numerics as P

W_SHAPE = (256, 512)
INT4_FLOORS = {(32, False): 21.5, (32, True): 20.2, (64, False): 20.5, (64, True): 19.3,
               (128, False): 19.5, (128, True): 18.5}


def test_int4_packing_layout_is_the_kernel_contract():
    q = torch.tensor([[1, 2, 3, 4], [15, 0, 7, 8]], dtype=torch.uint8)
    packed = P.pack_int4(q)
    assert packed.tolist() == [[1 | 2 << 4, 3 | 4 << 4], [15, 7 | 8 << 4]]  # even k low nibble
    assert torch.equal(P.unpack_int4(packed), q)


def test_int8_sqnr_and_layout():
    w = torch.randn(W_SHAPE)
    q, s = P.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (W_SHAPE[0],) and s.dtype == w.dtype
    assert q.abs().max() == 127
    assert P.sqnr(w, P.dequantize_int8(q, s)) > 42.0


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_int8_row_blocks_change_nothing(dtype):
    """Big tables are quantized a block of rows at a time (peak memory); the result is the same as
    all rows at once, including a last block shorter than the others."""
    w = torch.randn(101, 37, dtype=dtype) * torch.rand(101, 1, dtype=dtype)
    whole = P.quantize_int8(w, block_elements=w.numel())
    for rows in (1, 7, 100):
        blocked = P.quantize_int8(w, block_elements=rows * w.shape[1])
        assert torch.equal(blocked[0], whole[0]) and torch.equal(blocked[1], whole[1])
    ref_scale = (w.float().abs().amax(1) / 127).clamp_min(P.SCALE_EPS).to(dtype)
    assert torch.equal(whole[1], ref_scale)


@pytest.mark.parametrize("group", (32, 64, 128))
@pytest.mark.parametrize("symmetric", (False, True))
def test_int4_sqnr_and_layout(group, symmetric):
    w = torch.randn(W_SHAPE)
    q, s, z = P.quantize_int4(w, group, symmetric)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert s.shape == z.shape == (W_SHAPE[0], W_SHAPE[1] // group)
    if symmetric:
        assert torch.all(z == 8)
    deq = P.dequantize_int4(P.pack_int4(q), s, z, group)
    assert P.sqnr(w, deq) > INT4_FLOORS[(group, symmetric)]


def test_int4_scales_rounded_before_codes_in_bf16():
    """Codes are chosen on the stored bf16 grid: re-quantizing the dequantized weight is exact."""
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    q, s, z = P.quantize_int4(w, 32)
    deq = P.dequantize_int4(P.pack_int4(q), s, z, 32)
    q2 = torch.round(deq.reshape(64, 4, 32) / s.float()[..., None] + z.float()[..., None]).reshape(64, 128)
    assert torch.equal(q2.to(torch.uint8), q)


def test_fp8_sqnr_and_layout():
    w = torch.randn(W_SHAPE)
    q, s = P.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.float().abs().max() == 448
    assert P.sqnr(w, P.dequantize_fp8(q, s)) > 31.0


def test_zero_rows_do_not_divide_by_zero():
    w = torch.zeros(16, 64)
    for deq in (P.dequantize_int8(*P.quantize_int8(w)), P.dequantize_fp8(*P.quantize_fp8(w))):
        assert torch.equal(deq, w)
    q, s, z = P.quantize_int4(w, 32)
    assert torch.equal(P.dequantize_int4(P.pack_int4(q), s, z, 32), w)


def test_activation_quantizers_per_token_and_static():
    x = torch.randn(5, 64) * torch.tensor([1.0, 10, 100, 0.1, 1])[:, None]
    q, s = P.quantize_act_int8(x)
    assert s.shape == (5, 1) and torch.all(q.abs().amax(1) == 127)
    q, s = P.quantize_act_int8(x, torch.tensor(0.5))
    assert s.shape == (1, 1) and q.abs().max() == 127  # the 100x row saturates a static scale
    qf, sf = P.quantize_act_fp8(x)
    assert torch.allclose(qf.float().abs().amax(1), torch.full((5,), 448.0))


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="does not divide"):
        P.quantize_int4(torch.randn(8, 96), 64)
