"""Compiled decode: one graph per batch bucket, built at warm-up; requests arriving, growing past
block boundaries and finishing afterwards cause 0 recompiles, and greedy tokens still equal
transformers' own generate."""
import asyncio

import pytest
import torch

from ffl_backend.engine import OptimizedInferenceEngine
from ffl_backend.engine.runner import batch_buckets, unique_graphs

from .conftest import random_prompts


def test_buckets():
    assert batch_buckets(1) == [1] and batch_buckets(4) == [1, 2, 4] and batch_buckets(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("backend", ["fastflow"])
def test_zero_recompiles_after_warmup(llama, references, backend):
    torch._dynamo.reset()
    prompts = random_prompts([3, 14, 7, 30, 1, 21], seed=6)
    news = [20, 6, 13, 9, 17, 5]
    engine = OptimizedInferenceEngine(llama, max_batch_size=2, max_seq_len=64, block_size=8, compile=backend)
    try:
        assert engine.runner.graphs_after_warmup == unique_graphs() >= len(engine.runner.buckets)

        async def main():
            streams = []
            for i, prompt in enumerate(prompts):  # staggered arrivals while others decode
                streams.append(await engine.submit(prompt, max_new_tokens=news[i]))
                await asyncio.sleep(0.01 * (i % 3))
            return [await s.result() for s in streams]

        results = asyncio.run(main())
        stats = engine.stats()
    finally:
        engine.close()
    assert stats["recompiles_after_warmup"] == 0
    assert stats["decode_steps"] > 20
    for prompt, new, res in zip(prompts, news, results):
        assert res.token_ids == references(prompt, new)
