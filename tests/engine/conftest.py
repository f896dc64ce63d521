"""Shared fixtures: a tiny random Llama (fp32) and HF greedy references for it."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import tiny_model  # noqa: E402

VOCAB = 128


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


def random_prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model, prompt, new):
    """Single-request greedy generation by transformers itself (dynamic cache, sdpa)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def references(llama):
    """Memoised hf_greedy, keyed by (prompt, new)."""
    memo = {}

    def get(prompt, new):
        key = (tuple(prompt), new)
        if key not in memo:
            memo[key] = hf_greedy(llama, prompt, new)
        return memo[key]

    return get
