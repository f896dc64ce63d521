"""The rms_norm, add_rms_norm and layer_norm families: HF's norm code compiled by fastflow becomes the
fused ops, and the graph's outputs match the same code in float64."""
import torch

from tests.helpers import assert_matches_reference, fastflow_compiled
from tests.hf_math import add_llama_rms, gemma_rms, layer_norm_hf, layer_norm_inputs, llama_rms, rms_norm_inputs


def test_rms_norm_and_add_rms_norm_families_fuse_hf_norms_and_match_float64():
    """HF's norm code compiled by fastflow (fused to the ops, then Inductor's C++) in fp32 and bf16
    in one graph, against the same code in float64."""
    (x, w, res), (xb, wb, resb) = rms_norm_inputs(torch.float32), rms_norm_inputs(torch.bfloat16)

    def norms(x, w, res, xb, wb, resb):
        return (llama_rms(x, w, 1e-6), gemma_rms(x, w, 1e-6), *add_llama_rms(x, res, w, 1e-5),
                llama_rms(xb, wb, 1e-6), gemma_rms(xb, wb, 1e-6), *add_llama_rms(xb, resb, wb, 1e-5))

    out = fastflow_compiled(norms, x, w, res, xb, wb, resb, ops={"rms_norm": 4, "add_rms_norm": 2})
    for i, (a, b, r) in enumerate([(x, w, res), (xb, wb, resb)]):
        llama, gemma, normed, summed = out[4 * i: 4 * i + 4]
        assert_matches_reference(llama, llama_rms, (a, b, 1e-6), interpreted=False)
        assert_matches_reference(gemma, gemma_rms, (a, b, 1e-6), interpreted=False)
        assert_matches_reference((normed, summed), add_llama_rms, (a, r, b, 1e-5), interpreted=False)


def test_layer_norm_family_fuses_f_layer_norm_and_matches_float64():
    """F.layer_norm compiled by fastflow (fused, then Inductor's C++) in fp32 and bf16 in one graph,
    against float64."""
    (x, w, b), (xb, wb, bb) = layer_norm_inputs(torch.float32), layer_norm_inputs(torch.bfloat16)

    def norms(x, w, b, xb, wb, bb):
        return layer_norm_hf(x, w, b, 1e-5), layer_norm_hf(x, None, None, 1e-6), layer_norm_hf(xb, wb, bb, 1e-5)

    out = fastflow_compiled(norms, x, w, b, xb, wb, bb, ops={"layer_norm": 3})
    for o, args in zip(out, ((x, w, b, 1e-5), (x, None, None, 1e-6), (xb, wb, bb, 1e-5))):
        assert_matches_reference(o, layer_norm_hf, args, interpreted=False)
