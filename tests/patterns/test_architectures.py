"""Every supported architecture, tiny and random: fastflow matches eager and fuses what it should.

One compiled decode graph per architecture (HF generate over a static cache, Inductor on), checked
three ways: greedy tokens equal eager's, per-step logits close, and the expected fastflow op counts
present in the graph with none of the replaced math (rsqrt) left behind.
"""
import pytest
import torch

import ffl_backend
from ffl_backend.kernels import cpu_lib
from tests.helpers import greedy_eager_then_fastflow
from tests.tiny_models import ARCHS, LAYERS, tiny_model

L = LAYERS
# fastflow op counts expected in one decode graph, per architecture.
EXPECTED_OPS = {
    "llama": {"rms_norm": 1, "add_rms_norm": 2 * L, "silu_mul": L, "rotary": L},
    "mistral": {"rms_norm": 1, "add_rms_norm": 2 * L, "silu_mul": L, "rotary": L},
    "qwen2": {"rms_norm": 1, "add_rms_norm": 2 * L, "silu_mul": L, "rotary": L},
    "qwen3": {"rms_norm": 1 + 2 * L, "add_rms_norm": 2 * L, "silu_mul": L, "rotary": L},  # + q/k norms
    "gemma": {"rms_norm": 1, "add_rms_norm": 2 * L, "gelu_mul": L, "rotary": L},
    "phi3": {"rms_norm": 1, "add_rms_norm": 2 * L, "silu_mul": L, "rotary": L},
    "gpt2": {"layer_norm": 2 * L + 1, "gelu_residual": L},
    "gpt_neox": {"layer_norm": 2 * L + 1, "gelu_residual": L, "rotary": L},
}
# q/k/v and gate/up become one matmul each where the model has them separate.
EXPECTED_HORIZONTAL = {"llama": 2 * L, "mistral": 2 * L, "qwen2": 2 * L, "qwen3": 2 * L, "gemma": 2 * L,
                       "phi3": 0, "gpt2": 0, "gpt_neox": 0}
NEW_TOKENS = 32


def _eager_then_fastflow(model, **options):
    """Greedy generation of the same prompt eagerly, then compiled with fastflow (static cache)."""
    ids = torch.randint(3, 128, (1, 9))
    return (ids, *greedy_eager_then_fastflow(model, ids, NEW_TOKENS, **options))


@pytest.mark.parametrize("arch", ARCHS)
def test_fastflow_decode_matches_eager_and_fuses(arch):
    _, eager, fast = _eager_then_fastflow(tiny_model(arch))

    assert torch.equal(fast.sequences, eager.sequences), "greedy tokens differ from eager"
    for a, b in zip(fast.logits, eager.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    reports = ffl_backend.fusion_reports()
    assert reports, "generate did not compile through fastflow"
    rep = reports[-1]
    assert not rep.fallbacks
    assert dict(rep.ops) == EXPECTED_OPS[arch]
    assert rep.matches["horizontal"] == EXPECTED_HORIZONTAL[arch]
    assert rep.matches["inline_sdpa"] == L  # every layer's single-query SDPA
    norms = rep.ops.get("rms_norm", 0) + rep.ops.get("add_rms_norm", 0)
    assert norms in (0, 2 * L + 1 + (2 * L if arch == "qwen3" else 0))
    assert sum(rep.unfused.values()) == 0, f"math left unfused: {dict(rep.unfused)}"


@pytest.mark.parametrize("cpu_gemv", ["kernel", "loops"])
def test_bf16_cpu_decode_linears_are_gemvs_and_match_eager(cpu_gemv):
    """In a bf16 decode graph on CPU every parameter linear is a single-row GEMV (decode_gemv); logits
    stay within bf16 noise of eager. The kernel reads q/k/v and gate/up from their own weights in one
    call each, so they are not fused first (a fused copy would only cost memory); the Inductor loops
    read fused weights: q/k/v, o, gate/up, down, lm_head."""
    if cpu_gemv == "kernel" and not cpu_lib.load():
        pytest.skip(f"CPU GEMV kernel unavailable: {cpu_lib.load_error()}")
    ids, eager, fast = _eager_then_fastflow(tiny_model("llama", dtype=torch.bfloat16), cpu_gemv=cpu_gemv)
    rep = ffl_backend.last_report()
    if cpu_gemv == "kernel":
        assert rep.matches["horizontal"] == 0 and rep.matches["decode_gemv"] == 7 * L + 1
        assert rep.declined["horizontal"] == 2 * L
        assert all("a fused copy would only add" in why for family, _, why in rep.reasons if family == "horizontal")
    else:
        assert rep.matches["horizontal"] == 2 * L and rep.matches["decode_gemv"] == 4 * L + 1
    assert "packed_linear" not in rep.ops
    # compare logits up to the first diverging token (bf16 may flip a near-tie; after it inputs differ)
    new_fast, new_eager = fast.sequences[0, ids.shape[1]:], eager.sequences[0, ids.shape[1]:]
    same = (new_fast == new_eager).int().cumprod(0).sum().item()
    for a, b in zip(fast.logits[:same + 1], eager.logits[:same + 1]):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)
