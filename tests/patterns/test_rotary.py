"""The rotary family: HF's apply_rotary_pos_emb compiled by fastflow becomes the fused op, and the
graph's outputs match the same code in float64."""
import torch

from tests.helpers import assert_matches_reference, fastflow_compiled
from tests.hf_math import attention_qk, hf_rotary, rope_cos_sin


def test_rotary_family_fuses_hf_rotary_and_matches_float64():
    """HF's apply_rotary_pos_emb (partial in fp32, full in bf16) compiled by fastflow (fused, then
    Inductor's C++) in one graph, against float64."""
    q, k = attention_qk(2, 6, 2, 7, 80, torch.float32)
    cos, sin = rope_cos_sin(2, 7, 32, torch.float32)
    qb, kb = attention_qk(2, 6, 2, 7, 64, torch.bfloat16)
    cosb, sinb = rope_cos_sin(2, 7, 64, torch.bfloat16)

    def both(q, k, cos, sin, qb, kb, cosb, sinb):
        return hf_rotary(q, k, cos, sin, 32), hf_rotary(qb, kb, cosb, sinb, 64)

    out32, out16 = fastflow_compiled(both, q, k, cos, sin, qb, kb, cosb, sinb, ops={"rotary": 2})
    assert_matches_reference(out32, hf_rotary, (q, k, cos, sin, 32), interpreted=False)
    assert_matches_reference(out16, hf_rotary, (qb, kb, cosb, sinb, 64), interpreted=False)
