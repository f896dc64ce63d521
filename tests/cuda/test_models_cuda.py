"""Whole models on the GPU: a tiny random model of each supported architecture compiled with fastflow
(HF generate over a static cache, Inductor on) equals eager -- greedy tokens and logits in fp32,
logits within bf16 noise in bf16 -- with the same fused ops as on CPU (tests/patterns/
test_architectures.py); `optimize()` + `generate()` decode every prompt length with one graph and no
recompile (CUDA graphs: its default "reduce-overhead"); quantized models decode as their eager selves."""
import pytest
import torch

import ffl_backend
from tests.cuda.support import CUDA_TESTS, DEVICE, needs_sm90
from tests.helpers import greedy_eager_then_fastflow
from tests.patterns.test_architectures import EXPECTED_OPS
from tests.tiny_models import ARCHS, LAYERS, VOCAB, tiny_model

pytestmark = CUDA_TESTS

NEW_TOKENS = 16


def _model(arch, dtype=torch.float32):
    return tiny_model(arch, dtype=dtype).to(DEVICE)


def _prompt(length, batch=1):
    return torch.randint(3, VOCAB, (batch, length), device=DEVICE)


def _eager_then_fastflow(model):
    """Greedy generation of one prompt over a static cache, eagerly and then compiled with fastflow."""
    ids = _prompt(9)
    return (ids, *greedy_eager_then_fastflow(model, ids, NEW_TOKENS))


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_greedy_tokens_and_logits_equal_eager(arch):
    _, eager, fast = _eager_then_fastflow(_model(arch))
    assert torch.equal(fast.sequences, eager.sequences), "greedy tokens differ from eager"
    for a, b in zip(fast.logits, eager.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    rep = ffl_backend.last_report()
    assert rep is not None and rep.device == DEVICE, "generate did not compile through fastflow on the GPU"
    assert not rep.fallbacks
    assert {op: rep.ops.get(op, 0) for op in EXPECTED_OPS[arch]} == EXPECTED_OPS[arch]
    # a CPU-only family (patterns/inline_sdpa.py): on the GPU single-query SDPA stays torch's kernel
    assert rep.matches["inline_sdpa"] == (LAYERS if torch.device(DEVICE).type == "cpu" else 0)
    assert sum(rep.unfused.values()) == 0, f"math left unfused: {dict(rep.unfused)}"


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_stay_within_bf16_noise_of_eager(arch):
    """bf16 may flip a near-tie between two tokens, after which the inputs differ: the logits are
    compared up to and including the first step whose tokens differ (as on CPU)."""
    ids, eager, fast = _eager_then_fastflow(_model(arch, torch.bfloat16))
    new_fast, new_eager = fast.sequences[0, ids.shape[1]:], eager.sequences[0, ids.shape[1]:]
    same = int((new_fast == new_eager).int().cumprod(0).sum())
    for a, b in zip(fast.logits[:same + 1], eager.logits[:same + 1]):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_optimize_decodes_every_prompt_length_with_one_graph():
    """optimize()'s default mode is "reduce-overhead", on CUDA CUDA graphs over the static cache; the
    decode loop then replays the recorded graph. Greedy tokens equal HF's own generate (dynamic cache,
    sdpa); prompts of 5 to 150 tokens share one decode graph: no recompile."""
    model = _model("llama")
    prompts = [_prompt(n) for n in (5, 17, 64, 150)]
    with torch.inference_mode():
        expected = [model.generate(p, max_new_tokens=12, do_sample=False) for p in prompts]
    ffl_backend.optimize(model, max_seq_len=256)
    reports, graphs = len(ffl_backend.fusion_reports()), _dynamo_graphs()
    with torch.inference_mode():
        for prompt, want in zip(prompts, expected):
            assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False), want), prompt.shape
    new = ffl_backend.fusion_reports()[reports:]
    assert len(new) == 1 and new[0].device == DEVICE and new[0].mode == "reduce-overhead", [r.summary() for r in new]
    assert not ffl_backend.recompiles(), [r.guard_failure for r in ffl_backend.recompiles()]
    assert _dynamo_graphs() - graphs == 1


def test_optimize_with_a_batch_of_left_padded_prompts():
    model = _model("llama")
    prompts = [_prompt(n)[0] for n in (5, 9, 3, 12)]
    with torch.inference_mode():
        alone = [model.generate(p[None], max_new_tokens=10, do_sample=False)[0, len(p):] for p in prompts]
    ffl_backend.optimize(model, max_batch_size=4, max_seq_len=64)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(4, width, dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    with torch.inference_mode():
        batch = model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=10, do_sample=False)
    for row, want in enumerate(alone):
        assert torch.equal(batch[row, width:width + len(want)], want), row


@pytest.mark.parametrize("scheme", ["int8", "int4", "w8a8", pytest.param("fp8", marks=needs_sm90)])
def test_quantized_optimize_equals_the_eager_quantized_model(scheme):
    """The quantized ops' Triton kernels called eagerly (each linear, one launch) and traced into the
    compiled decode graph give the same greedy tokens (fp32 activations)."""
    eager = ffl_backend.quantize(_model("llama"), scheme)
    ids = _prompt(7)
    with torch.inference_mode():
        want = eager.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    fast = ffl_backend.optimize(_model("llama"), quant=scheme, max_seq_len=64, mode="default")
    with torch.inference_mode():
        got = fast.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(got, want)
    assert ffl_backend.last_report().device == DEVICE
