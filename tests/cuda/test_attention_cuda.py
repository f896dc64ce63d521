"""The attention Triton kernels compiled for the GPU and run natively: causal prefill (FlashAttention
style), split-K decode over a static cache at several filled lengths, and decode over a paged cache,
in MHA, GQA and MQA, against the references and bounds of their CPU tests (tests/attention); and the
three ops through `opcheck` on CUDA; and the same kernels over int8 / fp8 KV caches."""
import pytest
import torch

from ffl_backend.attention import decode as D
from ffl_backend.attention import paged as PG
from ffl_backend.attention import prefill as P
from ffl_backend.attention.kv_quant import dequantize_kv, quantize_kv
from ffl_backend.attention.reference import attention_ref
from tests.cuda.support import CUDA_TESTS, DEVICE, DTYPES, INTERPRETED, check, randn

pytestmark = CUDA_TESTS


def _qkv(dtype, batch, hq, hkv, q_len, kv_len, d):
    return (randn(batch, hq, q_len, d, dtype=dtype), randn(batch, hkv, kv_len, d, dtype=dtype),
            randn(batch, hkv, kv_len, d, dtype=dtype))


# (batch, q heads, kv heads, q_len, kv_len, head_dim, window): Llama-3-8B GQA prefill of an odd
# length, MHA at Phi-2's 80, MQA, Gemma's 256, bottom-right aligned (q_len < kv_len), a window that
# cuts into the prompt (Mistral), Phi-3's 96
PREFILL_CASES = [(2, 32, 8, 300, 300, 128, 0), (1, 16, 16, 77, 77, 80, 0), (2, 16, 1, 129, 129, 64, 0),
                 (1, 8, 4, 65, 65, 256, 0), (2, 8, 2, 5, 700, 128, 0), (1, 8, 2, 200, 200, 64, 48),
                 (1, 12, 4, 33, 33, 96, 0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,hq,hkv,q_len,kv_len,d,window", PREFILL_CASES)
def test_prefill(dtype, batch, hq, hkv, q_len, kv_len, d, window):
    if INTERPRETED and q_len * kv_len > 10_000:
        pytest.skip("too large for the interpreter")
    q, k, v = _qkv(dtype, batch, hq, hkv, q_len, kv_len, d)
    args = (q, k, v, d ** -0.5, window)
    check(P.attention_prefill_triton(*args), attention_ref, args)


def test_prefill_takes_strided_cache_views():
    """HF hands q transposed out of the projection, and k/v as slices of a longer static cache."""
    q = randn(1, 40, 32, 128).transpose(1, 2)
    k, v = randn(1, 8, 512, 128)[:, :, :40], randn(1, 8, 512, 128)[:, :, :40]
    torch.testing.assert_close(P.attention_prefill_triton(q, k, v, 0.1), attention_ref(q, k, v, 0.1))


def _left_pad_mask(batch, q_len, cache_len, pads):
    mask = torch.ones(batch, 1, q_len, cache_len, dtype=torch.bool, device=DEVICE)
    for row, pad in enumerate(pads):
        mask[row, ..., :pad] = False
    return mask


# (q heads, kv heads, q_len, cache_len, head_dim, window, filled). Decode of one token and of a few
# (speculative verification) against a 4096-slot cache, split-K over up to 32 splits: Llama-3-8B's GQA
# as the cache fills (the first token; inside the first split; one split exactly; many; full), then
# SmolLM2's 9/3, MQA, four new tokens, a sliding window.
DECODE_CASES = [(32, 8, 1, 4096, 128, 0, n) for n in (1, 77, 128, 1000, 4096)] + [
    (9, 3, 1, 4096, 64, 0, 1000), (16, 1, 1, 4096, 128, 0, 1000), (32, 8, 4, 4096, 128, 0, 2049),
    (8, 2, 1, 4096, 64, 100, 1000)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,q_len,cache_len,d,window,filled", DECODE_CASES)
def test_split_k_decode(dtype, hq, hkv, q_len, cache_len, d, window, filled):
    if INTERPRETED and filled > 200:
        pytest.skip("too large for the interpreter")
    q, k, v = _qkv(dtype, 2, hq, hkv, q_len, cache_len, d)
    mask = _left_pad_mask(2, q_len, cache_len, (0, min(5, filled - 1)))  # row 1 left-padded
    args = (q, k, v, torch.tensor(filled, device=DEVICE), d ** -0.5, window, mask)
    check(D.attention_decode_triton(*args), attention_ref, (q, k, v, d ** -0.5, window, filled, mask))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_of_many_query_rows_takes_the_tiled_kernel(dtype):
    """group * Lq > the split kernel's rows: the prefill kernel, with `filled` read on the device."""
    q, k, v = _qkv(dtype, 2, 32, 4, 17, 512, 128)
    mask = _left_pad_mask(2, 17, 512, (0, 9))
    args = (q, k, v, torch.tensor(333, device=DEVICE), 0.09, 0, mask)
    check(D.attention_decode_triton(*args), attention_ref, (q, k, v, 0.09, 0, 333, mask))


def test_decode_reads_only_filled_slots_and_masked_rows_give_zeros():
    q, k, v = _qkv(torch.float32, 2, 8, 2, 3, 1024, 64)
    filled = torch.tensor(700, device=DEVICE)
    ref = D.attention_decode_triton(q, k, v, filled, 0.125, 0, None)
    k[:, :, 700:], v[:, :, 700:] = float("nan"), float("nan")
    torch.testing.assert_close(D.attention_decode_triton(q, k, v, filled, 0.125, 0, None), ref)
    out = D.attention_decode_triton(q, k, v, filled, 0.125, 0, _left_pad_mask(2, 3, 1024, (1024, 0)))
    assert torch.isfinite(out).all() and out[0].abs().max() == 0  # a pad row sees no key: zeros, not NaN


def test_growing_filled_does_not_recompile():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def step(q, k, v, filled):
        return torch.ops.fastflow.attention_decode(q, k, v, filled, 0.125, 0, None) * 2

    q, k, v = _qkv(torch.bfloat16, 1, 32, 8, 1, 2048, 128)
    for n in (5, 6, 700, 2048):
        out = step(q, k, v, torch.tensor(n, device=DEVICE))
        check(out / 2, attention_ref, (q, k, v, 0.125, 0, n))
    assert counter.frame_count == 1


def _paged_case(dtype, hq, hkv, d, block, lens, spare_blocks=3):
    """Pools with random content and a shuffled, non-contiguous block assignment per row, made as
    tests/attention/test_paged.py makes them."""
    need = [-(-n // block) for n in lens]
    num_blocks = sum(need) + spare_blocks
    k_pool = randn(num_blocks, block, hkv, d, dtype=dtype)
    v_pool = randn(num_blocks, block, hkv, d, dtype=dtype)
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()  # never the dummy block 0
    table = torch.zeros(len(lens), max(need) + 2, dtype=torch.int32)
    for b, nb in enumerate(need):
        table[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    q = randn(len(lens), hq, d, dtype=dtype)
    return q, k_pool, v_pool, table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


# (q heads, kv heads, head_dim, block, lengths): Llama-3-8B GQA at 8 rows of very different lengths,
# SmolLM2's 9/3, MQA with a 32-row group, MHA with 32-slot blocks, a lone one-token row
PAGED_CASES = [(32, 8, 128, 16, [1, 17, 500, 2048, 33, 999, 1024, 7]), (9, 3, 64, 16, [5, 123, 33]),
               (32, 1, 128, 16, [300, 64]), (16, 16, 64, 32, [65, 1000]), (8, 8, 128, 16, [1])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,block,lens", PAGED_CASES)
def test_paged_decode(dtype, hq, hkv, d, block, lens):
    if INTERPRETED and max(lens) > 200:
        pytest.skip("too large for the interpreter")
    q, k, v, table, seq_lens = _paged_case(dtype, hq, hkv, d, block, lens)
    scale = d ** -0.5
    out = PG.paged_decode_triton(q, k, v, table, seq_lens, scale)
    # the float64 reference, as in tests/attention/test_paged.py (it builds its output on the CPU)
    cpu = [t.cpu() for t in (q, k, v, table, seq_lens)]
    exact = PG.paged_decode_ref(*[t.double() if t.is_floating_point() else t for t in cpu], scale)
    plain = PG.paged_decode_ref(*cpu, scale)  # the same math in the input dtype
    atol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    err, plain_err = (out.cpu().double() - exact).abs().max(), (plain.double() - exact).abs().max()
    assert out.dtype == dtype and err <= 2 * plain_err + atol, (err, plain_err)


def test_opcheck_attention_ops():
    q, k, v = _qkv(torch.bfloat16, 2, 8, 2, 7, 7, 64)
    torch.library.opcheck(torch.ops.fastflow.attention_prefill.default, (q, k, v, 0.125, 0))
    torch.library.opcheck(torch.ops.fastflow.attention_prefill.default, (q, k, v, 0.125, 3))
    q, k, v = _qkv(torch.bfloat16, 2, 8, 2, 2, 256, 64)
    mask = _left_pad_mask(2, 2, 256, (0, 3))
    filled = torch.tensor(130, device=DEVICE)
    torch.library.opcheck(torch.ops.fastflow.attention_decode.default, (q, k, v, filled, 0.125, 0, mask))
    torch.library.opcheck(torch.ops.fastflow.attention_decode.default, (q, k, v, filled, 0.125, 5, None))
    case = _paged_case(torch.bfloat16, 9, 3, 64, 16, [5, 40, 17])
    torch.library.opcheck(torch.ops.fastflow.paged_decode.default, (*case, 0.125))


KV_FORMATS = (torch.int8, torch.float8_e4m3fn)


def _quantized_ref(kq, vq, d):
    """attention_ref over the packed K/V dequantized in the query's precision (float64 for the exact run)."""
    def ref(q, *args, **kwargs):
        return attention_ref(q, dequantize_kv(kq, d, q.dtype), dequantize_kv(vq, d, q.dtype), *args, **kwargs)
    return ref


@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_kernels_read_quantized_caches(kv, dtype):
    """int8 / fp8 rows (attention/kv_quant.py) through the prefill, split-K decode and tiled decode
    kernels at Llama-3-8B's GQA (SmolLM2's head dim in the interpreter)."""
    d, length, filled = (64, 150, 141) if INTERPRETED else (128, 4096, 3001)
    kq, vq = quantize_kv(randn(2, 8, length, d, scale=3.0), kv), quantize_kv(randn(2, 8, length, d, scale=3.0), kv)
    mask = _left_pad_mask(2, 1, length, (0, 5))
    q = randn(2, 32, 1, d, dtype=dtype)
    out = D.attention_decode_triton(q, kq, vq, torch.tensor(filled, device=DEVICE), d ** -0.5, 0, mask)
    check(out, _quantized_ref(kq, vq, d), (q, d ** -0.5, 0, filled, mask))
    q = randn(2, 32, 4, d, dtype=dtype)  # 16 query heads x 4 rows per kv head: the tiled kernel
    mask = _left_pad_mask(2, 4, length, (0, 5))
    out = D.attention_decode_triton(q, kq, vq, torch.tensor(filled, device=DEVICE), d ** -0.5, 0, mask)
    check(out, _quantized_ref(kq, vq, d), (q, d ** -0.5, 0, filled, mask))
    n = 40 if INTERPRETED else 300
    q = randn(2, 32, n, d, dtype=dtype)
    k, v = kq[:, :, :n], vq[:, :, :n]
    check(P.attention_prefill_triton(q, k, v, d ** -0.5, 0), _quantized_ref(k, v, d), (q, d ** -0.5, 0))


@pytest.mark.parametrize("kv", KV_FORMATS)
def test_paged_decode_reads_quantized_pools(kv):
    lens = [5, 123, 33] if INTERPRETED else [1, 17, 500, 2048, 33, 999, 1024, 7]
    q, k, v, table, seq_lens = _paged_case(torch.bfloat16, 32, 8, 128, 16, lens)
    kq, vq = quantize_kv(k.float() * 3, kv), quantize_kv(v.float() * 3, kv)
    out = PG.paged_decode_triton(q, kq, vq, table, seq_lens, 128 ** -0.5)
    cpu = [t.cpu() for t in (q, kq, vq, table, seq_lens)]
    kd, vd = (dequantize_kv(t, 128, torch.float64) for t in cpu[1:3])
    exact = PG.paged_decode_ref(cpu[0].double(), kd, vd, cpu[3], cpu[4], 128 ** -0.5)
    plain = PG.paged_decode_ref(cpu[0], kd.to(torch.bfloat16), vd.to(torch.bfloat16), cpu[3], cpu[4], 128 ** -0.5)
    err, plain_err = (out.cpu().double() - exact).abs().max(), (plain.double() - exact).abs().max()
    assert err <= 2 * plain_err + 2e-2, (err, plain_err)
