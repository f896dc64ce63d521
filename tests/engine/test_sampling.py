"""The sampler's processors against transformers' and float64 references, the temperature floor,
and a sampling failure that fails its own request only."""
import pytest
import torch

from ffl_backend.engine import OptimizedInferenceEngine, SamplingParams, sampling
from ffl_backend.engine.sampling import apply_penalties, sample, token_logprobs

from .conftest import random_prompts


def draws(logits, params, n=300):
    gen = torch.Generator().manual_seed(0)
    return {sample(logits, params, gen) for _ in range(n)}


def test_a_tiny_temperature_is_the_floor_not_a_crash():
    logits = torch.randn(50, dtype=torch.float64) * 3
    tiny = SamplingParams(do_sample=True, temperature=1e-300).validate()
    floor = SamplingParams(do_sample=True, temperature=sampling.MIN_TEMPERATURE)
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert [sample(logits, tiny, gen_a) for _ in range(20)] == [sample(logits, floor, gen_b) for _ in range(20)]


def test_top_k_and_min_p_keep_only_their_tokens():
    logits = torch.tensor([4.0, 3.9, 3.8, 0.0, -1.0, -2.0])
    assert draws(logits, SamplingParams(do_sample=True, top_k=2)) == {0, 1}
    probs = logits.softmax(-1)
    kept = {i for i in range(6) if probs[i] >= 0.5 * probs.max()}
    assert draws(logits, SamplingParams(do_sample=True, min_p=0.5)) == kept


def test_repetition_penalty_equals_transformers_and_openai_penalties_their_formula():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(40, dtype=torch.float64)
    prompt, output = [3, 5, 5, 9], [9, 12, 12, 12]
    params = SamplingParams(repetition_penalty=1.3)
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[None].clone())[0]
    torch.testing.assert_close(apply_penalties(logits, params, prompt, output), want, rtol=0, atol=0)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits, params, prompt, output)
    want = logits.clone()
    for token, count in ((9, 1), (12, 3)):
        want[token] -= 0.25 * count + 0.5
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_logprobs_are_the_log_softmax_of_the_logits():
    logits = torch.randn(77) * 4
    value, top = token_logprobs(logits, 5, 3)
    ref = logits.double().log_softmax(-1)
    assert value == pytest.approx(ref[5].item(), abs=1e-5)
    assert [t for t, _ in top] == ref.topk(3).indices.tolist()
    assert [v for _, v in top] == pytest.approx(ref.topk(3).values.tolist(), abs=1e-5)


def test_a_sampling_failure_fails_only_its_request(llama, references, monkeypatch):
    real = sampling.sample

    def failing(logits, params, generator, prompt_ids=(), output_ids=()):
        if params.top_k == 7:  # the marked request
            raise RuntimeError("sampler exploded")
        return real(logits, params, generator, prompt_ids, output_ids)

    from ffl_backend.engine import scheduler

    monkeypatch.setattr(scheduler, "sample", failing)
    prompts = random_prompts([6, 9, 4], seed=3)
    with OptimizedInferenceEngine(llama, max_batch_size=3, max_seq_len=64, compile=None) as engine:
        import asyncio

        async def run():
            streams = [await engine.submit(p, SamplingParams(max_new_tokens=10, top_k=7 if i == 1 else 0))
                       for i, p in enumerate(prompts)]
            return [await s.result() for s in streams]

        results = asyncio.run(run())
    assert results[1].finish_reason == "error" and "sampler exploded" in results[1].error
    for i in (0, 2):
        assert results[i].token_ids == references(prompts[i], 10)
