"""Whether a variant's greedy tokens leave eager's only where the variant's own rounding explains it.

Eager's side is the path that produced eager's tokens -- the unpatched model's prefill of the prompt,
then one token at a time on a DynamicCache, as `generate` runs it -- fed the *variant's* tokens
(`forced_logits`). Every position of a row then compares the two on the same prefix, so every
divergence is checked, not only the first: position i diverges where the variant's token f is not
eager's argmax a there.

Why the variant may still pick f (docs/testing.md, "Greedy tokens: every divergence explained").
Let G = L_a - L_f >= 0 be eager's logit gap at a divergence. The variant computes G + d, where d is
what its rounding changes. To first order d = sum_j g_j e_j, g_j = dG/dv_j over the values v_j the
variant rounds differently from eager (autograd on an fp32 copy of the model at the same prefix:
`RoundingModel`), e_j their rounding errors:
- errors the variant makes deterministically -- quantized weights, e = dequantized - original, known
  exactly -- add the shift S = sum_j g_j e_j;
- errors that depend on the values rounded -- bf16 activations, a quantized KV cache -- are modelled as
  independent, zero mean and uniform over one rounding step q_j: variance sum_j g_j^2 q_j^2 / 12.
  bf16 activations (every leaf module's inputs and outputs, attention's q, k, v): eager and the variant
  both round them, in general in different places and orders, so both roundings count (2 x); the step
  is one bf16 ulp at the value. An int8 KV cache rounds K and V (after rotary, as cached) on a step of
  the row's absmax / 127, an e4m3 cache on 3 mantissa bits of the row scaled to 448: only the variant.
The variant picks f only if the noise reaches G + S. A normal variable exceeds `K_SIGMA` = 4 of its
standard deviations with probability 3e-5, so a divergence with G + S > K_SIGMA * sigma is not
explained by the variant's rounding: a wrong kernel, a dropped scale, a rotary off by a position.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

K_SIGMA = 4.0
PROBE = "ffl_rounding_probe"  # the attention implementation the fp32 copy runs (sdpa, recording q/k/v)
_RECORDED: list = []


@dataclass
class Divergence:
    row: int
    index: int  # position among the new tokens
    eager_token: int
    token: int
    gap: float  # G: eager's logit of its own token minus that of the variant's, on eager's path
    shift: float  # S: what the variant's deterministic rounding (its weights) moves G by, first order
    sigma: float  # standard deviation of what its value-dependent rounding moves G by

    @property
    def z(self) -> float:
        """(G + S) / sigma: how many standard deviations of noise the variant's choice needed."""
        return (self.gap + self.shift) / self.sigma

    def explained(self, k: float = K_SIGMA) -> bool:
        return self.gap + self.shift <= k * self.sigma

    def describe(self) -> str:
        return (f"row {self.row} token {self.index}: {self.token} for eager's {self.eager_token}, gap {self.gap:.4f}, "
                f"shift {self.shift:+.4f}, sigma {self.sigma:.4f}: {self.z:.1f} sigma")


def forced_logits(model, ids: Tensor, tokens: Tensor) -> Tensor:
    """(len(tokens), vocab) fp32 logits of `model`'s own decode path -- prefill of `ids` (1, L), then
    one token of `tokens` at a time on a DynamicCache -- before each of `tokens`."""
    from transformers import DynamicCache

    from ..generation import cache_kwarg

    with torch.inference_mode():
        cache = {cache_kwarg(model): DynamicCache(config=model.config)}
        out = model(ids, use_cache=True, **cache)
        logits = [out.logits[0, -1].float()]
        for token in tokens[:-1]:
            out = model(token.view(1, 1), use_cache=True, **cache)
            logits.append(out.logits[0, -1].float())
    return torch.stack(logits)


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for kind, t in (("act", query), ("kv", key), ("kv", value)):
        if t.requires_grad:
            t.retain_grad()
            _RECORDED.append((kind, t))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _record_leaf(module, args, output):
    for t in (*args, output):
        if torch.is_tensor(t) and t.requires_grad:
            t.retain_grad()
            _RECORDED.append(("act", t))


def bf16_ulp(t: Tensor) -> Tensor:
    """The spacing of bf16 numbers at each value of t (8 significant bits)."""
    _, exponent = torch.frexp(t)
    return torch.ldexp(torch.ones_like(t), exponent - 8)


def kv_step(t: Tensor, kv_dtype) -> Tensor:
    """The rounding step of each K/V element (..., D) in a quantized cache of `kv_dtype`."""
    if kv_dtype == torch.int8:
        return t.abs().amax(-1, keepdim=True).expand_as(t) / 127.0
    scale = t.abs().amax(-1, keepdim=True) / 448.0  # e4m3: 3 mantissa bits of the scaled value
    _, exponent = torch.frexp(t / scale.clamp_min(1e-30))
    return torch.ldexp(scale.expand_as(t), (exponent - 4).clamp_min(-6))


class RoundingModel:
    """The first-order model of how a variant's rounding moves eager's logit gaps (module docstring).

    eager: the bf16 (or fp32) model eager ran; variant: the variant's model (its quantized modules give
    the weight errors), or None for unquantized weights; kv_dtype: the variant's KV-cache storage dtype
    (torch.int8, torch.float8_e4m3fn) or None; activations_bf16: whether activations are bf16."""

    def __init__(self, eager: nn.Module, variant: nn.Module | None = None, kv_dtype=None,
                 activations_bf16: bool = True):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(PROBE, _probe_attention)
        AttentionMaskInterface.register(PROBE, sdpa_mask)
        self.kv_dtype, self.activations_bf16 = kv_dtype, activations_bf16
        self.fp32 = copy.deepcopy(eager).float().eval()
        self.fp32.config._attn_implementation = PROBE
        head = self.fp32.get_output_embeddings()
        head.weight = nn.Parameter(head.weight.detach().clone())  # untied: the head's own gradient
        for p in self.fp32.parameters():
            p.requires_grad_(False)
        for m in self.fp32.modules():
            if not any(True for _ in m.children()):
                m.register_forward_hook(_record_leaf)
        self.deltas = weight_errors(eager, variant) if variant is not None else {}
        self.embedding_error = self.deltas.pop(_embedding_name(eager), None)
        for name in self.deltas:
            self.fp32.get_submodule(name).weight.requires_grad_(True)

    def explain(self, prefix: Tensor, eager_token: int, token: int) -> tuple[float, float]:
        """(shift S, sigma) of G = L[eager_token] - L[token] after `prefix` (1, L)."""
        _RECORDED.clear()
        for name in self.deltas:
            self.fp32.get_submodule(name).weight.grad = None
        with torch.enable_grad():
            embeds = self.fp32.get_input_embeddings()(prefix).detach().requires_grad_()
            logits = self.fp32(inputs_embeds=embeds).logits[0, -1]
            (logits[eager_token] - logits[token]).backward()
        shift = sum(float((self.fp32.get_submodule(n).weight.grad * e).sum(dtype=torch.float64))
                    for n, e in self.deltas.items())
        if self.embedding_error is not None:
            shift += float((embeds.grad[0] * self.embedding_error[prefix[0]]).sum(dtype=torch.float64))
        variance, seen = 0.0, set()
        for kind, t in _RECORDED:
            if id(t) in seen or t.grad is None:
                continue
            seen.add(id(t))
            g2 = t.grad.double().square()
            if self.activations_bf16:
                variance += 2 * float((g2 * bf16_ulp(t.detach()).double().square()).sum()) / 12
            if kind == "kv" and self.kv_dtype is not None:
                variance += float((g2 * kv_step(t.detach(), self.kv_dtype).double().square()).sum()) / 12
        _RECORDED.clear()
        return shift, variance ** 0.5


def _embedding_name(model: nn.Module) -> str:
    embedding = model.get_input_embeddings()
    return next(name for name, m in model.named_modules() if m is embedding)


def weight_errors(eager: nn.Module, variant: nn.Module) -> dict:
    """{module name: dequantized - original weight (float64)} of every quantized module of `variant`."""
    from ..quant.quantizer import quantized_modules

    return {name: m.dequantized_weight().float() - eager.get_submodule(name).weight.detach().float()
            for name, m in quantized_modules(variant).items()}


def divergences(eager: nn.Module, rows: list, tokens: list, model: RoundingModel) -> Iterator[Divergence]:
    """Every position where the variant's `tokens` (one tensor per prompt of `rows`) are not eager's
    argmax on the same prefix, with what the rounding model says of it (one backward pass each: a
    caller looking for the first unexplained one can stop there)."""
    for r, (ids, row) in enumerate(zip(rows, tokens)):
        picks = forced_logits(eager, ids, row)
        for i in torch.nonzero(picks.argmax(-1) != row).flatten().tolist():
            a, f = int(picks[i].argmax()), int(row[i])
            shift, sigma = model.explain(torch.cat([ids[0], row[:i]])[None], a, f)
            yield Divergence(r, i, a, f, float(picks[i, a] - picks[i, f]), shift, sigma)


def variant_logits(model, ids: Tensor, tokens: Tensor) -> Tensor:
    """(len(tokens), vocab) fp32 logits of an optimized `model`'s own generate fed `tokens` (a logits
    processor forces each; output_logits returns them before it, as the compiled decode made them)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            forced = torch.full_like(scores, -float("inf"))
            forced[:, tokens[input_ids.shape[1] - ids.shape[1]]] = 0.0
            return forced

    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=len(tokens), min_new_tokens=len(tokens), do_sample=False,
                             logits_processor=LogitsProcessorList([Force()]), return_dict_in_generate=True,
                             output_logits=True)
    return torch.stack([step[0].float() for step in out.logits])


def calibration(eager: nn.Module, variant: nn.Module, rows: list, tokens: list, model: RoundingModel) -> list:
    """The rounding model checked where no token decides: at every position of eager's own `tokens`, the
    variant's change of eager's top-2 gap minus the predicted shift, in units of the predicted sigma
    (a standard deviation near or below 1: the model is right or errs on the safe side)."""
    z = []
    for ids, row in zip(rows, tokens):
        ours, theirs = forced_logits(eager, ids, row), variant_logits(variant, ids, row)
        for i in range(len(row)):
            a, b = (int(t) for t in ours[i].topk(2).indices)
            shift, sigma = model.explain(torch.cat([ids[0], row[:i]])[None], a, b)
            change = float(theirs[i, a] - theirs[i, b] - ours[i, a] + ours[i, b])
            z.append((change - shift) / sigma)
    return z
