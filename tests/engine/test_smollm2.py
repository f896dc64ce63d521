"""The real SmolLM2-135M (fp32, eager decode to stay fast): text prompts through the engine, batched,
give transformers' own single-request greedy tokens, and the text decodes from them."""
import pytest
import torch

import ffl_backend

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):", "Water boils at"]


@pytest.mark.slow
def test_smollm2_text_prompts_batched_equal_single_generate():
    model, tokenizer = ffl_backend.load_smollm2(torch.float32)
    refs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            refs.append(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist())
    engine = ffl_backend.OptimizedInferenceEngine(model, tokenizer=tokenizer, max_batch_size=4, max_seq_len=256,
                                                  compile=None)
    with engine:
        results = engine.generate(PROMPTS, max_new_tokens=12)
    for ref, res in zip(refs, results):
        assert res.token_ids == ref
        assert res.text == tokenizer.decode(ref, skip_special_tokens=True)
