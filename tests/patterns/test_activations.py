"""The gated_act and gelu families: HF's MLP activations compiled by fastflow become the fused ops,
and the graph's outputs match the same code in float64."""
import torch

from tests.helpers import assert_matches_reference, fastflow_compiled
from tests.hf_math import gate_up_halves, geglu, gelu_mlp, gelu_residual_inputs, new_gelu, swiglu


def test_gated_act_family_fuses_hf_mlps_and_matches_float64():
    """HF's gated activations compiled by fastflow (fused, then Inductor's C++), fp32 and bf16 in one
    graph, against the same code in float64."""
    gu, gub = gate_up_halves(torch.float32)[0], gate_up_halves(torch.bfloat16)[0]

    def mlps(*tensors):
        outs = []
        for t in tensors:
            g, u = t[..., :96], t[..., 96:]
            outs += [swiglu(g, u), geglu(g, u, "none"), geglu(g, u, "tanh")]
        return outs

    out = fastflow_compiled(mlps, gu, gub, ops={"silu_mul": 2, "gelu_mul": 4})
    for i, t in enumerate((gu, gub)):
        g, u = t[..., :96], t[..., 96:]
        assert_matches_reference(out[3 * i], swiglu, (g, u), interpreted=False)
        assert_matches_reference(out[3 * i + 1], geglu, (g, u, "none"), interpreted=False)
        assert_matches_reference(out[3 * i + 2], geglu, (g, u, "tanh"), interpreted=False)


def test_gelu_family_fuses_gelu_with_residual_and_matches_float64():
    """F.gelu (erf and tanh) and GPT-2's written-out NewGELU, each followed by the residual add,
    compiled by fastflow (fused, then Inductor's C++) in fp32 and bf16 in one graph, against float64."""
    args32, args16 = gelu_residual_inputs(torch.float32), gelu_residual_inputs(torch.bfloat16)

    def mlps(*t):
        return [f for x, b, r in (t[:3], t[3:]) for f in
                (gelu_mlp(x, b, r, "none"), gelu_mlp(x, b, r, "tanh"), new_gelu(x, r))]

    out = fastflow_compiled(mlps, *args32, *args16, ops={"gelu_residual": 6})
    for i, (x, b, r) in enumerate((args32, args16)):
        assert_matches_reference(out[3 * i], gelu_mlp, (x, b, r, "none"), interpreted=False)
        assert_matches_reference(out[3 * i + 1], gelu_mlp, (x, b, r, "tanh"), interpreted=False)
        assert_matches_reference(out[3 * i + 2], new_gelu, (x, r), interpreted=False)
