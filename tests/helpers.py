"""Shared test helpers: dtype-aware comparison against a high-precision reference."""
from __future__ import annotations

import torch

# Absolute slack per dtype, on top of twice PyTorch's own low-precision error.
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DTYPES = (torch.float32, torch.bfloat16)
# The Triton interpreter rounds fp32 -> bf16/fp16 by truncation (triton/runtime/interpreter.py,
# cast_impl), which doubles each rounding error relative to the GPU's round-to-nearest-even. Only
# interpreted low-precision outputs get this factor; compiled GPU runs are held to the plain bound.
INTERPRETER_ROUNDING_FACTOR = 2.0


def as_f64(args):
    return [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def assert_matches_reference(kernel_out, ref_fn, args, kwargs=None, atol=None, interpreted=True):
    """Kernel error vs a float64 run of `ref_fn` must be <= 2x plain PyTorch's own error at the
    input precision (ref_fn on the low-precision inputs) + atol. Handles tuple outputs."""
    kwargs = kwargs or {}
    lowp = ref_fn(*args, **kwargs)
    exact = ref_fn(*as_f64(args), **kwargs)
    outs = kernel_out if isinstance(kernel_out, (tuple, list)) else (kernel_out,)
    lowps = lowp if isinstance(lowp, (tuple, list)) else (lowp,)
    exacts = exact if isinstance(exact, (tuple, list)) else (exact,)
    assert len(outs) == len(lowps)
    for out, lo, ex in zip(outs, lowps, exacts):
        assert out.shape == lo.shape, (out.shape, lo.shape)
        assert out.dtype == lo.dtype, (out.dtype, lo.dtype)
        tol = atol if atol is not None else ATOL[lo.dtype]
        torch_err = (lo.double() - ex).abs().max().item()
        err = (out.double() - ex).abs().max().item()
        factor = 2.0
        if interpreted and lo.dtype in (torch.bfloat16, torch.float16):
            factor *= INTERPRETER_ROUNDING_FACTOR
        assert err <= factor * torch_err + tol, \
            f"kernel error {err:.3g} > {factor} x torch error {torch_err:.3g} + {tol}"


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """torch's opmath type: fp32 for bf16/fp16/fp32, float64 kept (so the tests' HF formulas run in
    float64 on float64 inputs and stay high-precision references)."""
    return torch.promote_types(t.dtype, torch.float32)


def assert_no_fallbacks(reports, unfused_ok=(), require_graph=True):
    """Every fusion report in `reports` (ffl_backend.fusion_reports() slices) has no pattern family
    that fell back (its pass raised and the graph kept its unfused form: right numbers, lost speed)
    and no anchor op (rsqrt, silu, gelu, layer_norm, tanh) left unfused, except those in
    `unfused_ok`; with `require_graph`, at least one graph went through fastflow."""
    reports = list(reports)
    assert reports or not require_graph, "nothing was compiled through fastflow"
    for r in reports:
        assert not r.fallbacks, f"graph {r.graph_id}: pattern families fell back: {r.fallbacks}"
        left = {k: v for k, v in r.unfused.items() if v and k not in unfused_ok}
        assert not left, f"graph {r.graph_id}: anchor ops left unfused: {left} ({r.summary()})"


class NoFallbacks:
    """`with NoFallbacks() as nf: ...` checks, on exit, every graph fastflow compiled inside the block
    with `assert_no_fallbacks`; `nf.reports` lists them."""

    def __init__(self, unfused_ok=(), require_graph=True):
        self.unfused_ok, self.require_graph, self.reports = unfused_ok, require_graph, []

    def __enter__(self):
        import ffl_backend

        self._before = len(ffl_backend.fusion_reports())
        return self

    def __exit__(self, exc_type, *exc):
        import ffl_backend

        self.reports = ffl_backend.fusion_reports()[self._before:]
        if exc_type is None:
            assert_no_fallbacks(self.reports, self.unfused_ok, self.require_graph)
        return False


def fastflow_compiled(fn, *args, ops):
    """`fn(*args)` compiled by torch.compile(backend="fastflow") -- pattern passes and Inductor --
    under no_grad (the fused ops have no backward). Checks that it made one graph whose fastflow ops
    are exactly `ops` (name -> count), with no family fallen back and no anchor op left unfused."""
    torch._dynamo.reset()
    with NoFallbacks() as nf, torch.no_grad():
        out = torch.compile(fn, backend="fastflow", fullgraph=True, options={"on_error": "raise"})(*args)
    assert len(nf.reports) == 1, [r.summary() for r in nf.reports]
    assert dict(nf.reports[0].ops) == ops, nf.reports[0].summary()
    return out


async def stream_requests(engine, prompts, news, cancel=(), arrival_gap_s=0.0):
    """Submit every prompt to an engine (staggered by `arrival_gap_s`), stream each, cancel those in
    `cancel` after 3 tokens; returns [(streamed token ids, final result)] in prompt order."""
    import asyncio

    async def one(i):
        await asyncio.sleep(arrival_gap_s * i)
        stream = await engine.submit(prompts[i], max_new_tokens=news[i])
        got = []
        async for chunk in stream:
            got.append(chunk.token_id)
            if i in cancel and len(got) == 3:
                stream.cancel()
        return got, await stream.result()

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def greedy_eager_then_fastflow(model, ids, new_tokens: int, **options):
    """(eager, fastflow) greedy generations of `ids` over a static cache, with per-step logits: the
    model run eagerly, then with its decode step compiled by fastflow (`options` for the backend)."""
    import ffl_backend
    from ffl_backend.generation import configure_generate

    def generate():
        return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)

    configure_generate(model, backend=None)
    eager = generate()
    ffl_backend.clear_reports()
    torch._dynamo.reset()
    configure_generate(model, backend="fastflow", options={"on_error": "raise", **options})
    return eager, generate()



def fake_quant_kv_attention(kv_dtype):
    """The name of a transformers attention implementation that is the model's own eager attention
    over K/V quantized and dequantized as a quantized fastflow cache stores them
    (attention/kv_quant.py): the reference a model with that cache must reproduce."""
    import sys

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    from ffl_backend.attention.kv_quant import dequantize_kv, quantize_kv

    def attention(module, query, key, value, *args, **kwargs):
        key, value = (dequantize_kv(quantize_kv(t, kv_dtype), t.shape[-1], t.dtype) for t in (key, value))
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
        return eager(module, query, key, value, *args, **kwargs)

    name = f"fake_quant_kv_{str(kv_dtype).replace('torch.', '')}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)
    return name
