import pytest
import torch

from ffl_backend.kernels import rms_norm as R
from tests.helpers import DTYPES, assert_matches_reference
from tests.hf_math import add_llama_rms, gemma_rms, llama_rms, rms_norm_inputs

SHAPES = [(5, 123), (3, 7, 576), (2, 9000)]  # odd sizes, SmolLM2's width, a row wider than one block
VARIANTS = [(0.0, False), (1.0, True), (0.5, False)]  # Llama, Gemma (1 + w), offset without fp32 weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("offset,w32", VARIANTS)
def test_rms_norm_triton_matches_reference(dtype, shape, offset, w32):
    x = torch.randn(shape, dtype=dtype) * 3
    w = torch.randn(shape[-1], dtype=dtype)
    args = (x, w, 1e-6, offset, w32)
    assert_matches_reference(R.rms_norm_triton(*args), R.rms_norm_ref, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:2])
@pytest.mark.parametrize("offset,w32", VARIANTS[:2])
def test_add_rms_norm_triton_matches_reference(dtype, shape, offset, w32):
    x, res = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    w = torch.randn(shape[-1], dtype=dtype)
    args = (x, res, w, 1e-5, offset, w32)
    assert_matches_reference(R.add_rms_norm_triton(*args), R.add_rms_norm_ref, args)


def test_triton_handles_strided_rows():
    x = torch.randn(6, 2 * 123)[:, :123]  # row stride 246, unit column stride
    w = torch.randn(123)
    torch.testing.assert_close(R.rms_norm_triton(x, w, 1e-6), R.rms_norm_ref(x, w, 1e-6))


def test_reference_is_hf_llama_and_gemma_norm():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    llama = LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    gemma = GemmaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    for m in (llama, gemma):
        torch.nn.init.normal_(m.weight)
    torch.testing.assert_close(R.rms_norm_ref(x, llama.weight, 1e-5), llama(x), rtol=0, atol=0)
    torch.testing.assert_close(R.rms_norm_ref(x, gemma.weight, 1e-6, 1.0, True), gemma(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_pass_opcheck(dtype):
    x, res = torch.randn(3, 5, 64, dtype=dtype), torch.randn(3, 5, 64, dtype=dtype)
    w = torch.randn(64, dtype=dtype)
    torch.library.opcheck(torch.ops.fastflow.rms_norm.default, (x, w, 1e-6, 0.0, False))
    torch.library.opcheck(torch.ops.fastflow.add_rms_norm.default, (x, res, w, 1e-6, 1.0, True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_on_cpu_matches_float64_hf_math(dtype):
    """The CPU ops (eager) against HF's norms evaluated in float64: <= 2x plain PyTorch's error."""
    x, w, res = rms_norm_inputs(dtype)
    for out, form, args in [(torch.ops.fastflow.rms_norm(x, w, 1e-6), llama_rms, (x, w, 1e-6)),
                            (torch.ops.fastflow.rms_norm(x, w, 1e-6, 1.0, True), gemma_rms, (x, w, 1e-6)),
                            (torch.ops.fastflow.add_rms_norm(x, res, w, 1e-5), add_llama_rms, (x, res, w, 1e-5))]:
        assert_matches_reference(out, form, args, interpreted=False)


