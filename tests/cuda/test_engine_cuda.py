"""The inference engine on the GPU: the paged-decode and prefill Triton kernels behind continuous
batching. Concurrent requests, arriving while others decode and some cancelled midway, give
transformers' own greedy tokens; the compiled decode graphs built at warm-up serve them all without
a recompile; every KV block comes back. As tests/engine, on a tiny random model per architecture."""
import asyncio

import pytest
import torch

from ffl_backend.engine import OptimizedInferenceEngine
from tests.cuda.support import CUDA_TESTS, DEVICE
from tests.helpers import stream_requests
from tests.tiny_models import VOCAB, tiny_model

pytestmark = CUDA_TESTS


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _references(model, prompts, news):
    """Greedy tokens of transformers' own generate (dynamic cache, sdpa), one request at a time; made
    before an engine plugs its attention into the model."""
    refs = []
    with torch.inference_mode():
        for prompt, new in zip(prompts, news):
            out = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=new, do_sample=False)
            refs.append(out[0, len(prompt):].tolist())
    return refs


def test_concurrent_requests_compiled_decode_equal_generate_without_recompiles():
    model = tiny_model("llama").to(DEVICE)
    lengths = [3 + (7 * i) % 45 for i in range(24)]
    news = [6 + (5 * i) % 17 for i in range(24)]
    prompts = _prompts(lengths, seed=1)
    refs = _references(model, prompts, news)
    cancel = set(range(2, 24, 5))
    engine = OptimizedInferenceEngine(model, max_batch_size=4, max_seq_len=128, block_size=16, compile="fastflow")
    try:
        outs = asyncio.run(stream_requests(engine, prompts, news, cancel, arrival_gap_s=0.002))
        stats = engine.stats()
        assert engine.scheduler.allocator.free == engine.num_blocks - 1  # every block came back
    finally:
        engine.close()
    assert stats["recompiles_after_warmup"] == 0
    assert stats["peak_blocks"] > 4  # requests really overlapped
    for i, (streamed, res) in enumerate(outs):
        assert streamed == res.token_ids
        if res.finish_reason == "cancelled":
            assert i in cancel and refs[i][:len(res.token_ids)] == res.token_ids
        else:
            assert res.finish_reason in ("length", "stop") and res.token_ids == refs[i], i
    assert sum(r.finish_reason == "cancelled" for _, r in outs) >= len(cancel) - 1


@pytest.mark.parametrize("arch", ["qwen3", "gemma", "phi3", "gpt2", "gpt_neox"])
def test_other_architectures_through_the_paged_kernels(arch):
    """Eager decode, so only the attention kernels are new: paged decode for steps, the flash kernel
    for prompts; GPT-NeoX calls the cache without the forward's kwargs (the cache's step state)."""
    model = tiny_model(arch).to(DEVICE)
    prompts = _prompts([3, 17, 40, 1], seed=11)
    refs = _references(model, prompts, [10] * len(prompts))
    with OptimizedInferenceEngine(model, max_batch_size=4, max_seq_len=64, compile=None) as engine:
        results = engine.generate(prompts, max_new_tokens=10)
    assert [r.token_ids for r in results] == refs


def test_preemption_with_a_small_pool_keeps_outputs():
    model = tiny_model("llama").to(DEVICE)
    prompts = _prompts([30, 25, 20, 12, 7, 28], seed=2)
    refs = _references(model, prompts, [30] * len(prompts))
    with OptimizedInferenceEngine(model, max_batch_size=4, max_seq_len=64, block_size=16, num_blocks=8,
                                  compile=None) as engine:  # 7 usable blocks = 112 tokens
        results = engine.generate(prompts, max_new_tokens=30)
        stats = engine.stats()
    assert stats["preemptions"] > 0
    assert [r.token_ids for r in results] == refs
