import pytest
import torch

from ffl_backend.kernels import rms_norm as R
from tests.helpers import DTYPES, acc_dtype, assert_matches_reference, fastflow_compiled

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


def _llama_rms(x, w, eps):
    """LlamaRMSNorm.forward written out here (not the op's reference), in torch's opmath type: a
    float64 run of it is the exact answer, a bf16 run is plain PyTorch's own error."""
    h = x.to(acc_dtype(x))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _gemma_rms(x, w, eps):
    """GemmaRMSNorm.forward: the `1 + w` weight applied in fp32, one rounding at the end."""
    h = x.to(acc_dtype(x))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.to(acc_dtype(x)))).to(x.dtype)


def _add_llama_rms(x, res, w, eps):
    h = res + x
    return _llama_rms(h, w, eps), h


def _inputs(dtype, n=576):
    return (torch.randn(4, 3, n, dtype=dtype) * 3, torch.nn.Parameter(torch.randn(n, dtype=dtype)),
            torch.randn(4, 3, n, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_on_cpu_matches_float64_hf_math(dtype):
    """The CPU ops (eager) against HF's norms evaluated in float64: <= 2x plain PyTorch's error."""
    x, w, res = _inputs(dtype)
    for out, form, args in [(torch.ops.fastflow.rms_norm(x, w, 1e-6), _llama_rms, (x, w, 1e-6)),
                            (torch.ops.fastflow.rms_norm(x, w, 1e-6, 1.0, True), _gemma_rms, (x, w, 1e-6)),
                            (torch.ops.fastflow.add_rms_norm(x, res, w, 1e-5), _add_llama_rms, (x, res, w, 1e-5))]:
        assert_matches_reference(out, form, args, interpreted=False)


def test_fused_compiled_graph_matches_float64_hf_math():
    """HF's norm code compiled by fastflow (fused to the ops, then Inductor's C++) in fp32 and bf16
    in one graph, against the same code in float64."""
    (x, w, res), (xb, wb, resb) = _inputs(torch.float32), _inputs(torch.bfloat16)

    def norms(x, w, res, xb, wb, resb):
        return (_llama_rms(x, w, 1e-6), _gemma_rms(x, w, 1e-6), *_add_llama_rms(x, res, w, 1e-5),
                _llama_rms(xb, wb, 1e-6), _gemma_rms(xb, wb, 1e-6), *_add_llama_rms(xb, resb, wb, 1e-5))

    out = fastflow_compiled(norms, x, w, res, xb, wb, resb, ops={"rms_norm": 4, "add_rms_norm": 2})
    for i, (a, b, r) in enumerate([(x, w, res), (xb, wb, resb)]):
        llama, gemma, normed, summed = out[4 * i: 4 * i + 4]
        assert_matches_reference(llama, _llama_rms, (a, b, 1e-6), interpreted=False)
        assert_matches_reference(gemma, _gemma_rms, (a, b, 1e-6), interpreted=False)
        assert_matches_reference((normed, summed), _add_llama_rms, (a, r, b, 1e-5), interpreted=False)
