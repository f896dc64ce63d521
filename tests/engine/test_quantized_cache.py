"""OptimizedInferenceEngine over an int8 / fp8 paged cache (attention/kv_quant.py): 16 concurrent
requests complete with the tokens transformers generates over the same quantized K/V, the pool never
grows, and the same cache_bytes holds more blocks than a float cache."""
import asyncio

import pytest
import torch

from ffl_backend.attention.kv_quant import packed_width
from ffl_backend.engine import OptimizedInferenceEngine
from tests.helpers import fake_quant_kv_attention, stream_requests

from .conftest import random_prompts

KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _reference(model, prompt, new, kv_dtype):
    previous = model.config._attn_implementation
    model.set_attn_implementation(fake_quant_kv_attention(kv_dtype))
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    finally:
        model.set_attn_implementation(previous)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_16_concurrent_requests_over_a_quantized_pool(llama, kv):
    prompts = random_prompts([3 + (11 * i) % 40 for i in range(16)], seed=7)
    news = [5 + (3 * i) % 14 for i in range(16)]
    expected = [_reference(llama, p, n, KV_DTYPES[kv]) for p, n in zip(prompts, news)]
    with OptimizedInferenceEngine(llama, compile=None, max_batch_size=8, max_seq_len=128, block_size=8,
                                  kv_cache_dtype=kv) as engine:
        pools = engine.cache.k_pools + engine.cache.v_pools
        assert all(p.dtype == KV_DTYPES[kv] and p.shape[-1] == packed_width(16) for p in pools)
        ptrs, nbytes = engine.cache.data_ptrs(), engine.cache.nbytes
        outs = asyncio.run(stream_requests(engine, prompts, news))
        stats = engine.stats()
        assert engine.cache.data_ptrs() == ptrs and engine.cache.nbytes == nbytes  # never grown
        assert engine.scheduler.allocator.free == engine.num_blocks - 1
    assert stats["peak_blocks"] > 8  # requests overlapped
    for i, (streamed, res) in enumerate(outs):
        assert res.error is None and streamed == res.token_ids == expected[i], i


def test_same_cache_bytes_hold_more_quantized_blocks(llama):
    budget = 64 * 1024
    counts = {}
    for kv in (None, "int8"):
        with OptimizedInferenceEngine(llama, compile=None, max_batch_size=2, max_seq_len=64, block_size=8,
                                      cache_bytes=budget, warmup=False, kv_cache_dtype=kv) as engine:
            counts[kv] = engine.num_blocks
            assert engine.cache.nbytes <= budget
    # fp32 rows of 16 values (64 bytes) vs packed rows of 20 bytes
    assert counts["int8"] == pytest.approx(counts[None] * 64 / packed_width(16), abs=1)
