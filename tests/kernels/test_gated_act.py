import pytest
import torch
import torch.nn.functional as F

from ffl_backend.kernels import gated_act as G
from tests.helpers import ATOL, DTYPES, assert_matches_reference
from tests.hf_math import gate_up_halves, geglu, swiglu

SHAPES = [(5, 123), (3, 7, 1536)]  # odd sizes; a row of two column blocks (1024 + a masked 512)
GELU_MODES = ["none", "tanh"]  # F.gelu's erf form, and Gemma's gelu_pytorch_tanh
# exp(-x) overflowing to inf for x << 0 is how the kernel reaches silu(x) -> -0 (see gated_act.py);
# the interpreter's numpy warns about it, the GPU does not.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _inputs(shape, dtype):
    return torch.randn(shape, dtype=dtype) * 3, torch.randn(shape, dtype=dtype)


def _atol(ref_fn, args):
    """The interpreter truncates fp32 -> bf16 (tests/helpers.py). The kernel rounds twice (the
    activation, then the product) and both truncations lose magnitude, so their errors add instead
    of cancelling as torch's round-to-nearest errors do: allow one more bf16 ulp of the largest
    output (2^-7 relative) on top of the shared bound. fp32 keeps the shared atol."""
    if args[0].dtype != torch.bfloat16:
        return None
    exact = ref_fn(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
    return ATOL[torch.bfloat16] + 2.0**-7 * exact.abs().max().item()


def _truncate_bf16(x):
    """fp32 -> bf16 by truncation, as the Triton interpreter casts."""
    return (x.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_silu_mul_triton_matches_reference(dtype, shape):
    args = _inputs(shape, dtype)
    assert_matches_reference(G.silu_mul_triton(*args), G.silu_mul_ref, args,
                             atol=_atol(G.silu_mul_ref, args))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("approximate", GELU_MODES)
def test_gelu_mul_triton_matches_reference(dtype, shape, approximate):
    args = (*_inputs(shape, dtype), approximate)
    assert_matches_reference(G.gelu_mul_triton(*args), G.gelu_mul_ref, args,
                             atol=_atol(G.gelu_mul_ref, args))


@pytest.mark.parametrize("act", ["silu", "none", "tanh"])
def test_bf16_kernel_rounds_activation_before_multiply(act):
    # HF's cast order, checked exactly: emulating the interpreter's truncation at the two rounding
    # points reproduces the kernel (all of silu; gelu's erf/exp differ from torch's by an fp32 ulp,
    # which flips a truncation now and then). Skipping the activation's rounding matches ~50%.
    gate, up = _inputs((4, 123), torch.bfloat16)
    if act == "silu":
        out, a = G.silu_mul_triton(gate, up), F.silu(gate.float())
    else:
        out, a = G.gelu_mul_triton(gate, up, act), F.gelu(gate.float(), approximate=act)
    emulated = _truncate_bf16(_truncate_bf16(a).float() * up.float())
    assert (out == emulated).float().mean().item() > 0.85


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_takes_halves_of_fused_gate_up(dtype):
    # Phi-3's gate_up_proj output split in two: views with row stride 2I, no copies.
    gu = torch.randn(2, 5, 2 * 300, dtype=dtype) * 3
    gate, up = gu[..., :300], gu[..., 300:]
    assert not gate.is_contiguous() and not up.is_contiguous()
    for kernel, ref_fn, args in [(G.silu_mul_triton, G.silu_mul_ref, (gate, up)),
                                 (G.gelu_mul_triton, G.gelu_mul_ref, (gate, up, "tanh"))]:
        assert_matches_reference(kernel(*args), ref_fn, args, atol=_atol(ref_fn, args))


def test_extreme_gate_values_stay_finite():
    gate = torch.tensor([[-1e4, -90.0, -20.0, -5.125, 0.0, 5.0, 90.0, 1e4]])
    up = torch.ones_like(gate)
    g64, u64 = gate.double(), up.double()  # torch's fp32 tanh-GELU gives -0.0 at -5.125 (cancellation)
    for out, ref in [(G.silu_mul_triton(gate, up), G.silu_mul_ref(gate, up)),
                     (G.gelu_mul_triton(gate, up), G.gelu_mul_ref(gate, up)),
                     (G.gelu_mul_triton(gate, up, "tanh"), G.gelu_mul_ref(g64, u64, "tanh"))]:
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_references_are_hf_activations(dtype):
    # HF: `act_fn(gate_proj(x)) * up_proj(x)` with ACT2FN["silu"] (Llama), ["gelu"],
    # ["gelu_pytorch_tanh"] (Gemma); gate_proj outputs are contiguous.
    from transformers.activations import ACT2FN

    gate, up = _inputs((4, 9, 320), dtype)
    for ref, name, args in [(G.silu_mul_ref, "silu", ()), (G.gelu_mul_ref, "gelu", ("none",)),
                            (G.gelu_mul_ref, "gelu_pytorch_tanh", ("tanh",))]:
        torch.testing.assert_close(ref(gate, up, *args), ACT2FN[name](gate) * up, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_pass_opcheck(dtype):
    gate, up = _inputs((3, 5, 64), dtype)
    torch.library.opcheck(torch.ops.fastflow.silu_mul.default, (gate, up))
    torch.library.opcheck(torch.ops.fastflow.gelu_mul.default, (gate, up, "tanh"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_on_cpu_match_float64_hf_math(dtype):
    """The CPU ops (eager) against HF's MLP activations in float64: <= 2x plain PyTorch's error."""
    _, gate, up = gate_up_halves(dtype)
    assert_matches_reference(torch.ops.fastflow.silu_mul(gate, up), swiglu, (gate, up), interpreted=False)
    for approximate in GELU_MODES:
        assert_matches_reference(torch.ops.fastflow.gelu_mul(gate, up, approximate), geglu,
                                 (gate, up, approximate), interpreted=False)


