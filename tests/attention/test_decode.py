"""attention_decode: split-K Triton kernels (interpreted), the CPU path, masks, opcheck, and the
no-recompile property of a tensor `filled`."""
import pytest
import torch

from ffl_backend.attention import decode as D
from ffl_backend.attention.reference import attention_ref
from tests.helpers import DTYPES, assert_matches_reference

HEADS = [(4, 4), (9, 3), (8, 1)]  # GQA ratios 1, 3 (SmolLM2), 8
# (q_len, cache_len, filled, head_dim, window): one and a few queries, odd filled lengths, several
# splits (cache 700 -> 6 splits), a window that cuts into the filled part
CASES = [(1, 200, 131, 64, 0), (3, 700, 517, 24, 0), (1, 700, 600, 64, 45), (2, 90, 33, 16, 7)]


def _inputs(dtype, hq, hkv, q_len, cache_len, d, batch=2):
    q = torch.randn(batch, hq, q_len, d, dtype=dtype)
    k = torch.randn(batch, hkv, cache_len, d, dtype=dtype)
    v = torch.randn(batch, hkv, cache_len, d, dtype=dtype)
    return q, k, v


def _left_pad_mask(batch, q_len, cache_len, pads):
    mask = torch.ones(batch, 1, q_len, cache_len, dtype=torch.bool)
    for row, pad in enumerate(pads):
        mask[row, ..., :pad] = False
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("q_len,cache_len,filled,d,window", CASES)
def test_decode_triton_matches_reference(dtype, hq, hkv, q_len, cache_len, filled, d, window):
    q, k, v = _inputs(dtype, hq, hkv, q_len, cache_len, d)
    mask = _left_pad_mask(2, q_len, cache_len, (0, 5))
    args = (q, k, v, torch.tensor(filled), d ** -0.5, window, mask)
    assert_matches_reference(D.attention_decode_triton(*args), attention_ref,
                             (q, k, v, d ** -0.5, window, filled, mask))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len,cache_len,filled,d,window", CASES + [(33, 80, 33, 16, 0)])  # + a prompt
@pytest.mark.parametrize("with_mask", [False, True])
def test_decode_cpu_path_matches_reference(dtype, q_len, cache_len, filled, d, window, with_mask):
    q, k, v = _inputs(dtype, 9, 3, q_len, cache_len, d)
    mask = _left_pad_mask(2, q_len, cache_len, (3, 0)) if with_mask else None
    out = torch.ops.fastflow.attention_decode(q, k, v, torch.tensor(filled), 0.2, window, mask)
    assert_matches_reference(out, attention_ref, (q, k, v, 0.2, window, filled, mask), interpreted=False)


def test_many_query_rows_use_the_tiled_kernel():
    """group * Lq > 64 rows go to the prefill kernel, reading `filled` from the tensor."""
    q, k, v = _inputs(torch.float32, 8, 1, 9, 120, 16)
    mask = _left_pad_mask(2, 9, 120, (0, 4))
    out = D.attention_decode_triton(q, k, v, torch.tensor(77), 0.25, 0, mask)
    torch.testing.assert_close(out, attention_ref(q, k, v, 0.25, 0, 77, mask))


def test_fully_masked_rows_give_zeros_not_nan():
    """Left-padded prompts have pad queries that see no key; NaN there would poison the cache."""
    q, k, v = _inputs(torch.float32, 4, 2, 3, 40, 16)
    mask = _left_pad_mask(2, 3, 40, (40, 0))
    for out in (D.attention_decode_triton(q, k, v, torch.tensor(20), 0.3, 0, mask),
                torch.ops.fastflow.attention_decode(q, k, v, torch.tensor(20), 0.3, 0, mask)):
        assert torch.isfinite(out).all()
        assert out[0].abs().max() == 0


def test_decode_reads_only_filled_slots():
    q, k, v = _inputs(torch.float32, 9, 3, 1, 64, 16)
    ref = torch.ops.fastflow.attention_decode(q, k, v, torch.tensor(20), 0.25, 0, None)
    k[:, :, 20:], v[:, :, 20:] = float("nan"), float("nan")
    torch.testing.assert_close(torch.ops.fastflow.attention_decode(q, k, v, torch.tensor(20), 0.25, 0, None), ref)
    torch.testing.assert_close(D.attention_decode_triton(q, k, v, torch.tensor(20), 0.25, 0, None), ref)


def test_decode_opcheck():
    q, k, v = _inputs(torch.float32, 9, 3, 2, 48, 16)
    mask = _left_pad_mask(2, 2, 48, (0, 3))
    torch.library.opcheck(torch.ops.fastflow.attention_decode, (q, k, v, torch.tensor(30), 0.25, 0, mask))
    torch.library.opcheck(torch.ops.fastflow.attention_decode, (q, k, v, torch.tensor(30), 0.25, 5, None))


def test_growing_filled_does_not_recompile():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def step(q, k, v, filled):
        return torch.ops.fastflow.attention_decode(q, k, v, filled, 0.25, 0, None) * 2

    q, k, v = _inputs(torch.float32, 9, 3, 1, 64, 16)
    for n in (5, 6, 40, 64):
        torch.testing.assert_close(step(q, k, v, torch.tensor(n)), 2 * attention_ref(q, k, v, 0.25, 0, n))
    assert counter.frame_count == 1


def _capped_ref(q, k, v, scale, window, filled, mask, softcap):
    return attention_ref(q, k, v, scale, window, filled, mask, softcap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len,cache_len,filled,d,window", [CASES[1], CASES[2], (33, 80, 33, 16, 0)])
def test_softcapped_decode_matches_reference(dtype, q_len, cache_len, filled, d, window):
    """Soft-capped scores (cap 1.5) through the split kernel, the tiled one (33 rows x 3) and the CPU path."""
    q, k, v = _inputs(dtype, 9, 3, q_len, cache_len, d)
    q = q * 3
    mask = _left_pad_mask(2, q_len, cache_len, (0, 5))
    ref_args = (q, k, v, 0.2, window, filled, mask, 1.5)
    out = D.attention_decode_triton(q, k, v, torch.tensor(filled), 0.2, window, mask, 1.5)
    assert_matches_reference(out, _capped_ref, ref_args)
    out = torch.ops.fastflow.attention_decode(q, k, v, torch.tensor(filled), 0.2, window, mask, 1.5)
    assert_matches_reference(out, _capped_ref, ref_args, interpreted=False)


def test_softcapped_decode_opcheck():
    q, k, v = _inputs(torch.float32, 9, 3, 2, 40, 16)
    mask = _left_pad_mask(2, 2, 40, (0, 3))
    torch.library.opcheck(torch.ops.fastflow.attention_decode, (q, k, v, torch.tensor(30), 0.25, 4, mask, 2.0))
