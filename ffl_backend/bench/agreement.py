"""Greedy tokens of a model against a reference's: the prompts, the rows, where they first part.

Used by benchmarks/greedy_agreement.py (how often optimize()'s variants agree with bf16 eager) and by
tests/test_smollm2_variants.py; where and why they part: divergence.py.
"""
from __future__ import annotations

import torch

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")
NEW_TOKENS = 24


def greedy_rows(model, rows: list, new_tokens: int = NEW_TOKENS) -> list:
    """The `new_tokens` greedy tokens `model.generate` appends to each (1, L) prompt of `rows`."""
    with torch.inference_mode():
        return [model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False)[0, ids.shape[1]:] for ids in rows]


def first_divergence(tokens, reference) -> int:
    """The index of the first token that differs from the reference's (its length: none)."""
    return next((i for i in range(len(reference)) if tokens[i] != reference[i]), len(reference))
