import pytest
import torch

from ffl_backend.kernels import rotary as R
from tests.helpers import DTYPES, assert_matches_reference
from tests.hf_math import attention_qk, hf_rotary, rope_cos_sin

# (head_dim, rotary_dim, seq_len): Llama-style full rotary at 64; Phi-2-style 80 (not a power of
# two) in full and partial (32 of 80); GPT-NeoX / Pythia's rotary_pct=0.25 (16 of 64); odd L.
CASES = [(64, 64, 13), (80, 80, 7), (80, 32, 13), (64, 16, 7)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,seq_len", CASES)
def test_rotary_triton_matches_reference(dtype, head_dim, rotary_dim, seq_len):
    q, k = attention_qk(2, 6, 2, seq_len, head_dim, dtype)  # GQA: 6 query heads, 2 kv heads
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = rope_cos_sin(2, seq_len, rotary_dim, dtype)
    args = (q, k, cos, sin, rotary_dim)
    out = R.rotary_triton(*args)
    assert all(t.is_contiguous() for t in out)
    assert_matches_reference(out, R.rotary_ref, args)


def test_pass_through_features_are_copied_exactly():
    q, k = attention_qk(1, 3, 1, 5, 80, torch.bfloat16)
    cos, sin = rope_cos_sin(1, 5, 32, torch.bfloat16)
    q_out, k_out = R.rotary_triton(q, k, cos, sin, 32)
    assert torch.equal(q_out[..., 32:], q[..., 32:]) and torch.equal(k_out[..., 32:], k[..., 32:])


def test_batch_one_cos_sin_broadcast_and_contiguous_inputs():
    # HF builds position_ids of batch 1 when none are given: cos/sin (1, L, r) serve every batch row.
    q, k = (t.contiguous() for t in attention_qk(3, 4, 4, 5, 64, torch.float32))
    cos, sin = rope_cos_sin(1, 5, 64, torch.float32)
    torch.testing.assert_close(R.rotary_triton(q, k, cos, sin, 64), R.rotary_ref(q, k, cos, sin, 64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_hf_apply_rotary_pos_emb(dtype):
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_rope
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope

    for hf, head_dim, rotary_dim in [(llama_rope, 64, 64), (neox_rope, 80, 32), (phi3_rope, 64, 16),
                                     (phi3_rope, 96, 96)]:
        q, k = attention_qk(2, 6, 2, 7, head_dim, dtype)
        cos, sin = rope_cos_sin(2, 7, rotary_dim, dtype)
        for ours, theirs in zip(R.rotary_ref(q, k, cos, sin, rotary_dim), hf(q, k, cos, sin)):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("dtype,rotary_dim", [(torch.float32, 64), (torch.bfloat16, 16)])
def test_op_passes_opcheck(dtype, rotary_dim):
    q, k = attention_qk(2, 6, 2, 5, 64, dtype)
    cos, sin = rope_cos_sin(2, 5, rotary_dim, dtype)
    torch.library.opcheck(torch.ops.fastflow.rotary.default, (q, k, cos, sin, rotary_dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(80, 32), (64, 64)])
def test_op_on_cpu_matches_float64_hf_math(dtype, head_dim, rotary_dim):
    """The CPU op (eager) against HF's rotary in float64: <= 2x plain PyTorch's error."""
    q, k = attention_qk(2, 6, 2, 7, head_dim, dtype)
    cos, sin = rope_cos_sin(2, 7, rotary_dim, dtype)
    assert_matches_reference(torch.ops.fastflow.rotary(q, k, cos, sin, rotary_dim), hf_rotary,
                             (q, k, cos, sin, rotary_dim), interpreted=False)


