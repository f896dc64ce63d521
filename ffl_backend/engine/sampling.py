"""Per-request sampling parameters, their validation, and the sampler.

Greedy unless `do_sample`; then, in transformers' order, repetition / presence / frequency
penalties, temperature, top-k, top-p (nucleus) and min-p filtering, drawn with a per-request
`torch.Generator` so a seed reproduces a request's tokens whatever else is batched with it (the
generator advances once per token of that request only). Temperatures in (0, 1e-2) are raised to
1e-2 (vLLM's floor): below it float32 logits / T overflow and the draw has no distribution.
Log-probabilities, when asked for, are those of the model's own distribution (before penalties and
filtering), as OpenAI and vLLM report them.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

MIN_TEMPERATURE = 1e-2
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64  # a request's own stop ids; more is a mistake or an attack


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
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely
    stop_token_ids: tuple[int, ...] | frozenset = ()  # the engine keeps a frozenset: checked every token

    def validate(self) -> "SamplingParams":
        def bad(msg):
            raise RequestError(msg)

        def integer(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not integer(self.max_new_tokens) or self.max_new_tokens < 1:
            bad(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not integer(self.top_k) or self.top_k < -1:
            bad(f"top_k must be an integer >= -1 (0 or -1: off), got {self.top_k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 100:
            bad(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        if self.logprobs is not None and (not integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not isinstance(self.do_sample, bool):
            bad(f"do_sample must be a bool, got {self.do_sample!r}")
        if self.seed is not None and (not integer(self.seed) or not 0 <= self.seed < 2**64):
            bad(f"seed must be an integer in [0, 2**64) or None, got {self.seed!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if not all(integer(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        return self

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator()
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()
        return gen


def apply_penalties(scores: Tensor, params: SamplingParams, prompt_ids, output_ids) -> Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor over prompt + output tokens, then OpenAI's
    presence and frequency penalties over the output tokens."""
    if params.repetition_penalty != 1 and (prompt_ids or output_ids):
        seen = torch.tensor(list(prompt_ids) + list(output_ids), dtype=torch.long, device=scores.device).unique()
        picked = scores[seen]
        scores = scores.index_put((seen,), torch.where(picked < 0, picked * params.repetition_penalty,
                                                       picked / params.repetition_penalty))
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=scores.device),
                                minlength=scores.numel())[: scores.numel()].to(scores.dtype)
        scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(scores.dtype)
    return scores


def _filter(scores: Tensor, params: SamplingParams) -> Tensor:
    """Top-k, top-p (transformers' TopPLogitsWarper: drop tokens whose ascending cumulative
    probability is <= 1 - top_p; the most likely token always stays) and min-p, on scaled scores."""
    if params.top_k > 0 and params.top_k < scores.numel():
        kth = scores.topk(params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = scores.sort(descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum <= 1 - params.top_p
        drop[-1] = False
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    if params.min_p > 0:
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return scores


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None,
           prompt_ids=(), output_ids=()) -> int:
    """One token id from one row of logits (V,)."""
    scores = logits.float()
    if params.penalized:
        scores = apply_penalties(scores, params, prompt_ids, output_ids)
    if params.greedy:
        return int(scores.argmax())
    scores = _filter(scores / max(params.temperature, MIN_TEMPERATURE), params)
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def token_logprobs(logits: Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability and the `top` most likely (id, log-probability) pairs."""
    logp = logits.float().log_softmax(-1)
    pairs = []
    if top:
        values, ids = logp.topk(top)
        pairs = list(zip(ids.tolist(), values.tolist()))
    return float(logp[token]), pairs
