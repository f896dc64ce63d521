"""attention_prefill: Triton kernel (interpreted) and CPU path vs the pure-torch reference; opcheck."""
import pytest
import torch

from ffl_backend.attention import prefill as P
from ffl_backend.attention.reference import attention_ref
from tests.helpers import DTYPES, assert_matches_reference

HEADS = [(4, 4), (6, 2), (8, 1)]  # GQA ratios 1 (MHA), 3, 8 (MQA for 8 q heads)
# (q_len, kv_len, head_dim, window): square, bottom-right aligned (q_len < kv_len), odd head dim, windows
SHAPES = [(37, 37, 64, 0), (5, 70, 24, 0), (37, 37, 64, 9), (3, 66, 16, 20)]


def _inputs(dtype, hq, hkv, q_len, kv_len, d, batch=2):
    q = torch.randn(batch, hq, q_len, d, dtype=dtype)
    k = torch.randn(batch, hkv, kv_len, d, dtype=dtype)
    v = torch.randn(batch, hkv, kv_len, d, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("q_len,kv_len,d,window", SHAPES)
def test_prefill_triton_matches_reference(dtype, hq, hkv, q_len, kv_len, d, window):
    q, k, v = _inputs(dtype, hq, hkv, q_len, kv_len, d)
    args = (q, k, v, d ** -0.5, window)
    assert_matches_reference(P.attention_prefill_triton(*args), attention_ref, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len,kv_len,d,window", SHAPES)
def test_prefill_cpu_path_matches_reference(dtype, q_len, kv_len, d, window):
    q, k, v = _inputs(dtype, 6, 2, q_len, kv_len, d)
    args = (q, k, v, 0.2, window)
    assert_matches_reference(torch.ops.fastflow.attention_prefill(*args), attention_ref, args, interpreted=False)


def test_prefill_handles_strided_cache_views():
    """HF hands a slice of the static cache (stride of the full cache) and transposed q."""
    q = torch.randn(1, 9, 4, 32).transpose(1, 2).contiguous().transpose(1, 2)
    cache = torch.randn(1, 3, 50, 32)
    k, v = cache[:, :, :9], torch.randn(1, 3, 50, 32)[:, :, :9]
    ref = attention_ref(q, k, v, 0.1)
    torch.testing.assert_close(P.attention_prefill_triton(q, k, v, 0.1), ref)
    torch.testing.assert_close(torch.ops.fastflow.attention_prefill(q, k, v, 0.1), ref)


def test_prefill_opcheck():
    q, k, v = _inputs(torch.float32, 6, 2, 7, 7, 16)
    torch.library.opcheck(torch.ops.fastflow.attention_prefill, (q, k, v, 0.25, 0))
    torch.library.opcheck(torch.ops.fastflow.attention_prefill, (q, k, v, 0.25, 3))


def test_reference_matches_sdpa():
    """The reference is the textbook definition: SDPA with repeated K/V heads and is_causal."""
    q, k, v = _inputs(torch.float64, 6, 2, 11, 11, 16)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True, scale=0.3)
    torch.testing.assert_close(attention_ref(q, k, v, 0.3), sdpa)


def _capped_ref(q, k, v, scale, window, softcap):
    return attention_ref(q, k, v, scale, window, softcap=softcap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len,kv_len,d,window", [(37, 37, 64, 0), (3, 66, 16, 20)])
def test_softcapped_prefill_matches_reference(dtype, q_len, kv_len, d, window):
    """Gemma 2's tanh cap, small enough (1.5) that most scores are bent: Triton and CPU paths."""
    q, k, v = _inputs(dtype, 6, 2, q_len, kv_len, d)
    q = q * 3  # scores of several units, where the cap matters
    args = (q, k, v, d ** -0.5, window, 1.5)
    assert_matches_reference(P.attention_prefill_triton(*args), _capped_ref, args)
    assert_matches_reference(torch.ops.fastflow.attention_prefill(*args), _capped_ref, args, interpreted=False)
    plain = attention_ref(*args[:5])
    assert (plain - _capped_ref(*args)).abs().max() > 0.05  # the cap changed the result


def test_softcapped_prefill_opcheck():
    q, k, v = _inputs(torch.float32, 6, 2, 7, 7, 16)
    torch.library.opcheck(torch.ops.fastflow.attention_prefill, (q, k, v, 0.25, 3, 2.0))
