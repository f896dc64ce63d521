"""Compiled decode: one graph per batch bucket, built at warm-up; requests arriving, growing past
block boundaries and finishing afterwards cause 0 recompiles, and greedy tokens still equal
transformers' own generate (also for an engine that quantizes its model: quant="int8")."""
import asyncio

import pytest
import torch

import ffl_backend
from ffl_backend.engine import OptimizedInferenceEngine
from ffl_backend.engine.runner import batch_buckets, unique_graphs
from tests.helpers import NoFallbacks
from tests.tiny_models import tiny_model

from .conftest import hf_greedy, random_prompts


def test_buckets():
    assert batch_buckets(1) == [1] and batch_buckets(4) == [1, 2, 4] and batch_buckets(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("backend", ["fastflow"])
def test_zero_recompiles_after_warmup(llama, references, backend):
    torch._dynamo.reset()
    prompts = random_prompts([3, 14, 7, 30, 1, 21], seed=6)
    news = [20, 6, 13, 9, 17, 5]
    with NoFallbacks():  # every bucket's graph fused by every family
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


def test_int8_engine_equals_eager_quantized_generate():
    """`quant="int8"`: the engine quantizes the model it is given, compiles its decode through
    fastflow, and 6 concurrent requests (2 batch slots, staggered arrivals) give the greedy tokens of
    transformers' generate() on the same model quantized eagerly."""
    torch._dynamo.reset()
    prompts = random_prompts([5, 17, 8, 26, 3, 11], seed=11)
    news = [12, 9, 16, 7, 14, 10]
    quantized = ffl_backend.quantize(tiny_model("llama"), "int8")
    refs = [hf_greedy(quantized, p, n) for p, n in zip(prompts, news)]
    with NoFallbacks():
        engine = OptimizedInferenceEngine(tiny_model("llama"), quant="int8", max_batch_size=2, max_seq_len=64,
                                          block_size=8)
    try:
        assert len(ffl_backend.quant.quantized_modules(engine.model)) == 7 * engine.model.config.num_hidden_layers

        async def main():
            streams = []
            for i, prompt in enumerate(prompts):
                streams.append(await engine.submit(prompt, max_new_tokens=news[i]))
                await asyncio.sleep(0.01 * (i % 3))
            return [await s.result() for s in streams]

        with NoFallbacks(require_graph=False):
            results = asyncio.run(main())
        stats = engine.stats()
    finally:
        engine.close()
    assert stats["recompiles_after_warmup"] == 0
    for res, ref in zip(results, refs):
        assert res.finish_reason in ("length", "stop") and res.token_ids == ref
