"""The real SmolLM2-135M (fp32; eager decode to stay fast): 32 concurrent requests of mixed lengths,
8 cancelled midway; every other one gives transformers' own single-request greedy tokens, text
included, and the cache never grows."""
import asyncio
from pathlib import Path

import pytest
import torch

import ffl_backend

NEW = 8


@pytest.mark.slow
def test_smollm2_32_concurrent_requests_equal_single_generate():
    model, tokenizer = ffl_backend.load_smollm2(torch.float32)
    text = Path(__file__).resolve().parents[3] / "shared" / "data" / "prideprejudice.txt"
    words = (text.read_text()[20000:200000] if text.exists() else "the cat sat on the mat " * 2000).split()
    prompts = [" ".join(words[300 * i: 300 * i + 3 + (37 * i) % 120]) for i in range(32)]
    cancel = set(range(1, 32, 4))
    refs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            refs.append(model.generate(ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:].tolist())
    engine = ffl_backend.OptimizedInferenceEngine(model, tokenizer=tokenizer, max_batch_size=8, max_seq_len=512,
                                                  compile=None)
    with engine:
        ptrs = engine.cache.data_ptrs()

        async def one(i):
            stream = await engine.submit(prompts[i], max_new_tokens=NEW)
            n = 0
            async for _ in stream:
                n += 1
                if i in cancel and n == 2:
                    stream.cancel()
            return await stream.result()

        async def main():
            return await asyncio.gather(*(one(i) for i in range(32)))

        results = asyncio.run(main())
        assert engine.cache.data_ptrs() == ptrs and engine.scheduler.allocator.free == engine.num_blocks - 1
        assert engine.stats()["peak_blocks"] <= engine.num_blocks - 1
    for i, (ref, res) in enumerate(zip(refs, results)):
        if i in cancel:
            assert res.finish_reason == "cancelled" and res.token_ids == ref[:len(res.token_ids)]
        else:
            assert res.token_ids == ref, i
            assert res.text == tokenizer.decode(ref, skip_special_tokens=True)
