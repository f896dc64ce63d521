import pytest
import torch

from ffl_backend.kernels import layer_norm as L
from tests.helpers import DTYPES, assert_matches_reference
from tests.hf_math import layer_norm_hf, layer_norm_inputs

SHAPES = [(5, 123), (3, 7, 576), (2, 9000)]  # odd sizes, SmolLM2's width, a row wider than one block
AFFINE = [(True, True), (False, False), (True, False), (False, True)]  # weight?, bias?


def _params(n, dtype, has_w, has_b):
    w = torch.randn(n, dtype=dtype) if has_w else None
    b = torch.randn(n, dtype=dtype) if has_b else None
    return w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("has_w,has_b", AFFINE)
def test_layer_norm_triton_matches_reference(dtype, shape, has_w, has_b):
    x = (torch.randn(shape) * 3 + 2).to(dtype)  # nonzero row mean, so centring matters
    w, b = _params(shape[-1], dtype, has_w, has_b)
    args = (x, w, b, 1e-5)
    assert_matches_reference(L.layer_norm_triton(*args), L.layer_norm_ref, args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_stable_under_large_row_offset(dtype):
    # E[x^2] - E[x]^2 would lose every significant bit here in fp32; two-pass statistics and the
    # kernel's chunk merge (Chan) across the two 8192-blocks of a 9000-wide row must not.
    x = (torch.randn(2, 9000) + 1e3).to(dtype)
    w, b = _params(9000, dtype, True, True)
    args = (x, w, b, 1e-5)
    assert_matches_reference(L.layer_norm_triton(*args), L.layer_norm_ref, args)


def test_triton_handles_strided_rows():
    x = torch.randn(6, 2 * 123)[:, :123]  # row stride 246, unit column stride
    w, b = torch.randn(123), torch.randn(123)
    torch.testing.assert_close(L.layer_norm_triton(x, w, b, 1e-5), L.layer_norm_ref(x, w, b, 1e-5))


def test_triton_rejects_wrong_affine_size():
    with pytest.raises(ValueError):
        L.layer_norm_triton(torch.randn(2, 8), torch.randn(7), None, 1e-5)


@pytest.mark.parametrize("kwargs", [{}, {"elementwise_affine": False}, {"bias": False}])
def test_reference_is_nn_layer_norm(kwargs):
    # GPT-2 and GPT-NeoX normalise with nn.LayerNorm. In fp32 the reference and torch's kernel differ
    # only in reduction order (ulp-level), so they are close but not bitwise equal.
    n = 768
    ln = torch.nn.LayerNorm(n, eps=1e-5, **kwargs)
    for p in ln.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(4, 5, n) * 2 + 1
    with torch.no_grad():
        torch.testing.assert_close(L.layer_norm_ref(x, ln.weight, ln.bias, 1e-5), ln(x))
        # bf16: torch rounds once after the fp32 affine, and so does the reference. Those ulp-level
        # fp32 differences flip a bf16 rounding in ~1e-4 of outputs (by one bf16 ulp), never more;
        # rounding before the affine step (a wrong cast order) would change ~28% of them.
        ln, xb = ln.to(torch.bfloat16), x.to(torch.bfloat16)
        ref, hf = L.layer_norm_ref(xb, ln.weight, ln.bias, 1e-5), ln(xb)
    torch.testing.assert_close(ref, hf, rtol=2**-7, atol=1e-6)  # <= 1 bf16 ulp everywhere
    assert (ref != hf).float().mean().item() < 5e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_passes_opcheck(dtype):
    x = torch.randn(3, 5, 64, dtype=dtype)
    w, b = _params(64, dtype, True, True)
    torch.library.opcheck(torch.ops.fastflow.layer_norm.default, (x, w, b, 1e-5))
    torch.library.opcheck(torch.ops.fastflow.layer_norm.default, (x, None, None, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_on_cpu_matches_float64_layer_norm(dtype):
    """The CPU op (eager) against torch's LayerNorm in float64: <= 2x plain PyTorch's error."""
    x, w, b = layer_norm_inputs(dtype)
    for args in ((x, w, b, 1e-5), (x, None, None, 1e-6), (x, w, None, 1e-5)):
        assert_matches_reference(torch.ops.fastflow.layer_norm(*args), layer_norm_hf, args, interpreted=False)


