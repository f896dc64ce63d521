"""Per-request sampling parameters, their validation, and the sampler.

Greedy unless `do_sample`; then temperature scaling and nucleus (top-p) filtering as transformers'
TemperatureLogitsWarper / TopPLogitsWarper do, drawn with a per-request `torch.Generator` so a seed
reproduces a request's tokens whatever else is batched with it (the generator advances once per
token of that request only).
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor


class RequestError(ValueError):
    """A bad request (empty prompt, too long, invalid sampling values): only that request fails."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    do_sample: bool = False
    seed: int | None = None
    ignore_eos: bool = False

    def validate(self) -> "SamplingParams":
        def bad(msg):
            raise RequestError(msg)

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.do_sample, bool):
            bad(f"do_sample must be a bool, got {self.do_sample!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            bad(f"seed must be a non-negative integer or None, got {self.seed!r}")
        return self

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    def generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator()
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()
        return gen


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from one row of logits (V,)."""
    if params.greedy:
        return int(logits.argmax())
    scores = logits.float() / params.temperature
    if params.top_p < 1.0:
        # HF TopPLogitsWarper: drop the tokens whose cumulative probability (ascending order) is
        # <= 1 - top_p; the most likely token always stays.
        sorted_scores, order = scores.sort(descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum <= 1 - params.top_p
        drop[-1] = False
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
