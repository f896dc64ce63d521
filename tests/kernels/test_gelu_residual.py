
import pytest
import torch

from ffl_backend.kernels import gelu_residual as G
from tests.helpers import DTYPES, assert_matches_reference
from tests.hf_math import gelu_mlp, gelu_residual_inputs

SHAPES = [(5, 123), (3, 7, 576)]  # odd sizes (a partial last block), SmolLM2's width
APPROX = ["none", "tanh"]
EXTRAS = [(True, True), (False, False), (True, False), (False, True)]  # bias?, residual?


def _extras(shape, dtype, has_b, has_r):
    b = torch.randn(shape[-1], dtype=dtype) if has_b else None
    r = torch.randn(shape, dtype=dtype) if has_r else None
    return b, r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("has_b,has_r", EXTRAS)
def test_gelu_residual_triton_matches_reference(dtype, shape, approximate, has_b, has_r):
    x = (torch.randn(shape) * 3).to(dtype)  # reaches both GELU tails
    b, r = _extras(shape, dtype, has_b, has_r)
    args = (x, b, r, approximate)
    assert_matches_reference(G.gelu_residual_triton(*args), G.gelu_residual_ref, args)


def test_triton_extreme_inputs_saturate_without_nan():
    # x / (1 + exp(-2u)) must saturate to x and to -0 where exp overflows, not produce inf/inf.
    x = torch.tensor([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4])
    for approximate in APPROX:
        out = G.gelu_residual_triton(x, None, None, approximate)
        torch.testing.assert_close(out, G.gelu_residual_ref(x, None, None, approximate))


def test_triton_handles_non_contiguous_and_mixed_dtypes():
    x = torch.randn(123, 6).t()  # non-contiguous: the launcher makes it contiguous
    b = torch.randn(123)
    torch.testing.assert_close(G.gelu_residual_triton(x, b, None, "none"),
                               G.gelu_residual_ref(x, b, None, "none"))
    # bf16 activation into an fp32 residual stream: the output is promoted, as the eager add is.
    xb, rf = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(5, 64)
    out = G.gelu_residual_triton(xb, None, rf, "tanh")
    assert out.dtype == torch.float32
    # The GELU is still rounded to bf16 before the add; the interpreter rounds by truncation
    # (tests/helpers.py), so allow one bf16 ulp of the largest activation.
    ulp = 2**-7 * G.gelu_ref(xb, "tanh").abs().max().item()
    torch.testing.assert_close(out, G.gelu_residual_ref(xb, None, rf, "tanh"), rtol=0, atol=ulp + 1e-5)


def test_rejects_bad_arguments():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError):
        G.gelu_residual_triton(x, None, None, "sigmoid")
    with pytest.raises(ValueError):
        G.gelu_residual_ref(x, None, None, "erf")
    with pytest.raises(ValueError):
        G.gelu_residual_triton(x, torch.randn(7), None, "none")
    with pytest.raises(ValueError):
        G.gelu_residual_triton(x, None, torch.randn(8), "none")  # residual is not broadcast


def test_reference_is_hf_gelu_in_fp32():
    # In fp32 every HF GELU that is written in Python runs exactly the reference's formula.
    from transformers.activations import GELUActivation, GELUTanh, NewGELUActivation

    x = torch.randn(4, 5, 768) * 3
    exact = {"none": [GELUActivation(use_gelu_python=True)],
             "tanh": [NewGELUActivation(), GELUTanh(use_gelu_tanh_python=True)]}
    for approximate, modules in exact.items():
        for m in modules:
            torch.testing.assert_close(G.gelu_ref(x, approximate), m(x), rtol=0, atol=0)


def test_reference_is_hf_cast_order_in_bf16():
    from transformers.activations import GELUActivation, GELUTanh, NewGELUActivation

    x = (torch.randn(4, 5, 768) * 3).to(torch.bfloat16)
    core = x.abs() < 3
    # GELUActivation/GELUTanh call F.gelu, which computes in fp32 and rounds once, like the
    # reference. Their fp32 erf/tanh differ from torch.erf/torch.tanh by ulps, which only shows in
    # bf16 in the negative tail: there 1 + erf(x/sqrt 2) cancels in fp32 (relative error large,
    # absolute < 1e-6) and bf16, with fp32's exponent range, resolves the difference. So: equal on
    # the bulk, within one bf16 ulp (+1e-6) everywhere.
    for approximate, m in (("none", GELUActivation()), ("tanh", GELUTanh())):
        ref, hf = G.gelu_ref(x, approximate), m(x)
        torch.testing.assert_close(ref, hf, rtol=2**-7, atol=1e-6)
        assert (ref != hf)[core].float().mean().item() < 1e-3
    # NewGELUActivation (GPT-2's gelu_new) instead runs its formula op by op in bf16, rounding after
    # every op, so it differs from a single rounding on ~44% of the bulk and bitwise equality is the
    # wrong test. The reference's one rounding must be at least as accurate: its error against a
    # float64 NewGELU is within 2x NewGELU's own bf16 error.
    new_gelu = NewGELUActivation()
    assert_matches_reference(G.gelu_ref(x, "tanh"), new_gelu, (x,), interpreted=False)
    assert (G.gelu_ref(x, "tanh") != new_gelu(x))[core].float().mean().item() > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_passes_opcheck(dtype):
    x = torch.randn(3, 5, 64, dtype=dtype)
    b, r = _extras(x.shape, dtype, True, True)
    torch.library.opcheck(torch.ops.fastflow.gelu_residual.default, (x, b, r, "none"))
    torch.library.opcheck(torch.ops.fastflow.gelu_residual.default, (x, None, None, "tanh"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_on_cpu_matches_float64_hf_math(dtype):
    """The CPU op (eager) against HF's GELU MLP in float64: <= 2x plain PyTorch's error."""
    x, b, r = gelu_residual_inputs(dtype)
    for approximate in APPROX:
        assert_matches_reference(torch.ops.fastflow.gelu_residual(x, b, r, approximate), gelu_mlp,
                                 (x, b, r, approximate), interpreted=False)


