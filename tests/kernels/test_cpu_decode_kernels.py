"""fastflow_cpu::attention_decode and fastflow_cpu::argmax, the C++ kernels of a CPU decode step,
against their references (attention/reference.py's attention_ref in float64; torch.argmax), odd
shapes, strided views of the cache, masks, windows, and opcheck."""
import pytest
import torch

from ffl_backend.attention import decode  # noqa: F401  (fastflow_cpu::attention_decode's fake)
from ffl_backend.attention.kv_quant import dequantize_kv, quantize_kv, quantize_kv_ref
from ffl_backend.attention.reference import attention_ref
from ffl_backend.kernels import cpu_argmax, cpu_lib
from tests.helpers import assert_matches_reference

pytestmark = pytest.mark.skipif(not cpu_lib.load(), reason=f"CPU kernels not built: {cpu_lib.load_error()}")

# (batch, q heads, kv heads, q_len, cache_len, filled, head_dim, window): MHA/GQA/MQA, one and a few
# queries, odd head dims, a window cutting into the filled part, a full cache, a long fill that splits
# the keys across threads
CASES = [(1, 9, 3, 1, 80, 17, 64, 0), (2, 4, 4, 3, 50, 33, 24, 0), (1, 8, 1, 2, 700, 613, 40, 0),
         (3, 6, 2, 1, 64, 64, 17, 9), (1, 2, 1, 5, 2048, 1501, 128, 300)]


def _attend(q, k, v, filled, scale, window, mask):
    return torch.ops.fastflow_cpu.attention_decode(q, k, v, torch.tensor(filled), scale, window, mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,hq,hkv,lq,s,filled,d,window", CASES)
@pytest.mark.parametrize("with_mask", [False, True])
def test_attention_decode_matches_reference(dtype, b, hq, hkv, lq, s, filled, d, window, with_mask):
    q = torch.randn(b, hq, lq, d, dtype=dtype)
    k, v = torch.randn(b, hkv, s, d, dtype=dtype), torch.randn(b, hkv, s, d, dtype=dtype)
    mask = None
    if with_mask:  # left padding of 3 slots in the last row, as transformers' boolean mask
        mask = torch.ones(b, 1, lq, s, dtype=torch.bool)
        mask[-1, ..., :3] = False
    out = _attend(q, k, v, filled, d ** -0.5, window, mask)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()  # (B, Lq, Hq, D) memory
    assert_matches_reference(out, attention_ref, (q, k, v, d ** -0.5, window, filled, mask), interpreted=False)


@pytest.mark.parametrize("kv", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,hq,hkv,lq,s,filled,d,window", CASES)
def test_attention_decode_quantized_cache_matches_reference(kv, dtype, b, hq, hkv, lq, s, filled, d, window):
    """Packed int8 / fp8 rows (attention/kv_quant.py): odd head dims exercise the 8-wide fp8 loop's tail,
    and each instruction-set build runs this (test_cpu_isa_paths.py)."""
    q = torch.randn(b, hq, lq, d, dtype=dtype)
    k, v = (quantize_kv(torch.randn(b, hkv, s, d) * 4, kv) for _ in range(2))
    out = _attend(q, k, v, filled, d ** -0.5, window, None)

    def ref(q, *args):
        return attention_ref(q, dequantize_kv(k, d, q.dtype), dequantize_kv(v, d, q.dtype), *args)

    assert_matches_reference(out, ref, (q, d ** -0.5, window, filled), interpreted=False)


@pytest.mark.parametrize("kv", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 30, 7])
def test_quantize_kv_matches_reference(kv, dtype, d):
    """fastflow_cpu::quantize_kv is bitwise the pure-torch definition: rows of very different ranges,
    a zero row, rounding ties, a transposed (non-contiguous) input as attention hands it over."""
    x = (torch.randn(2, 37, 3, d) * torch.logspace(-4, 3, 37)[:, None, None]).to(dtype).transpose(1, 2)
    x[0, 0, 0] = 0
    x[0, 0, 1, :3] = torch.tensor([1.5, 2.5, -0.5])
    out = torch.ops.fastflow_cpu.quantize_kv(x, kv == torch.float8_e4m3fn)
    assert torch.equal(out, quantize_kv_ref(x, kv))


def test_quantize_kv_opcheck():
    torch.library.opcheck(torch.ops.fastflow_cpu.quantize_kv, (torch.randn(2, 3, 5, 30), True))


def test_attention_decode_reads_views_and_only_filled_slots():
    """A cache viewed through a transpose and a query with odd strides; slots past `filled` are NaN."""
    k = torch.randn(2, 40, 3, 16).transpose(1, 2)  # (B, Hkv, S, D) with the head dim still innermost
    v = torch.randn(2, 40, 3, 16).transpose(1, 2)
    q = torch.randn(2, 2, 9, 16).transpose(1, 2)  # (B, 9, 2, D) -> strides of another layout
    k[:, :, 25:], v[:, :, 25:] = float("nan"), float("nan")
    mask = torch.ones(1, 1, 2, 40, dtype=torch.bool)  # batch-1 mask broadcast over the batch
    out = _attend(q, k, v, 25, 0.25, 0, mask)
    torch.testing.assert_close(out, attention_ref(q, k, v, 0.25, 0, 25, mask), rtol=1e-5, atol=1e-5)


def test_attention_decode_fully_masked_row_gives_zeros():
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 30, 8), torch.randn(2, 2, 30, 8)
    mask = torch.ones(2, 1, 1, 30, dtype=torch.bool)
    mask[0] = False
    out = _attend(q, k, v, 20, 0.3, 0, mask)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0


def test_attention_decode_rejects_bad_operands():
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 30, 8)
    with pytest.raises(RuntimeError, match="filled"):
        _attend(q, k, k, 31, 0.3, 0, None)
    with pytest.raises(RuntimeError, match="must share q's dtype"):
        _attend(q, k.bfloat16(), k.bfloat16(), 10, 0.3, 0, None)
    with pytest.raises(RuntimeError, match="mask"):
        _attend(q, k, k, 10, 0.3, 0, torch.ones(1, 1, 1, 5, dtype=torch.bool))


def test_attention_decode_opcheck():
    q, k, v = torch.randn(2, 6, 2, 16), torch.randn(2, 3, 40, 16), torch.randn(2, 3, 40, 16)
    mask = torch.ones(2, 1, 2, 40, dtype=torch.bool)
    torch.library.opcheck(torch.ops.fastflow_cpu.attention_decode, (q, k, v, torch.tensor(30), 0.25, 0, mask))
    torch.library.opcheck(torch.ops.fastflow_cpu.attention_decode, (q, k, v, torch.tensor(12), 0.25, 4, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 49152), (3, 1, 1001), (2, 7)])
def test_argmax_equals_torch(dtype, shape):
    x = torch.randn(shape, dtype=dtype)
    assert torch.equal(torch.ops.fastflow_cpu.argmax(x), cpu_argmax.argmax_ref(x))
    x.view(-1, shape[-1])[:, 0] = x.max() + 1  # ties broken to the first index, like torch
    x.view(-1, shape[-1])[:, -1] = x.max()
    assert torch.equal(torch.ops.fastflow_cpu.argmax(x), cpu_argmax.argmax_ref(x))


def test_argmax_nan_wins_like_torch():
    x = torch.randn(2, 300)
    x[0, 17] = x[0, 200] = float("nan")
    assert torch.ops.fastflow_cpu.argmax(x).tolist() == cpu_argmax.argmax_ref(x).tolist() == [17, x[1].argmax().item()]


def test_argmax_opcheck():
    torch.library.opcheck(torch.ops.fastflow_cpu.argmax, (torch.randn(3, 77),))
