"""The fused-op Triton kernels (norms, gated activations, rotary, GELU + residual) compiled for the GPU
and run natively, against the float64 references and bounds of their CPU tests (tests/kernels), in
every dtype they serve, at odd and at model-sized shapes; and every op through `opcheck` on CUDA."""
import pytest
import torch

from ffl_backend.kernels import gated_act as G
from ffl_backend.kernels import gelu_residual as GR
from ffl_backend.kernels import layer_norm as LN
from ffl_backend.kernels import rms_norm as RN
from ffl_backend.kernels import rotary as RO
from tests.cuda.support import CUDA_TESTS, DEVICE, DTYPES, INTERPRETED, check, randn
from tests.helpers import ATOL

pytestmark = CUDA_TESTS

# odd sizes, SmolLM2's width, Llama-3-8B's width (one 4096 block), a row wider than one 8192 block
ROW_SHAPES = [(5, 123), (3, 7, 576), (17, 4096), (2, 9000)]
RMS_VARIANTS = [(0.0, False), (1.0, True)]  # Llama: w * normed; Gemma: (1 + w) in fp32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("offset,w32", RMS_VARIANTS)
def test_rms_norm(dtype, shape, offset, w32):
    args = (randn(*shape, dtype=dtype, scale=3), randn(shape[-1], dtype=dtype), 1e-6, offset, w32)
    check(RN.rms_norm_triton(*args), RN.rms_norm_ref, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES[1:3])
@pytest.mark.parametrize("offset,w32", RMS_VARIANTS)
def test_add_rms_norm(dtype, shape, offset, w32):
    args = (randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype), 1e-5,
            offset, w32)
    check(RN.add_rms_norm_triton(*args), RN.add_rms_norm_ref, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(dtype, shape, affine):
    x = randn(*shape, dtype=dtype, scale=3, shift=2)  # a nonzero row mean, so centring matters
    w, b = (randn(shape[-1], dtype=dtype), randn(shape[-1], dtype=dtype)) if affine else (None, None)
    check(LN.layer_norm_triton(x, w, b, 1e-5), LN.layer_norm_ref, (x, w, b, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_stable_under_a_large_row_offset(dtype):
    """Chan's merge of the two 8192-blocks of a 9000-wide row, with a mean of 1000 (massive activations)."""
    x = randn(2, 9000, dtype=dtype, shift=1e3)
    args = (x, randn(9000, dtype=dtype), randn(9000, dtype=dtype), 1e-5)
    check(LN.layer_norm_triton(*args), LN.layer_norm_ref, args)


def test_norms_take_strided_rows():
    x = randn(6, 2 * 123)[:, :123]  # row stride 246: a view, no copy
    w, b = randn(123), randn(123)
    torch.testing.assert_close(RN.rms_norm_triton(x, w, 1e-6), RN.rms_norm_ref(x, w, 1e-6))
    torch.testing.assert_close(LN.layer_norm_triton(x, w, b, 1e-5), LN.layer_norm_ref(x, w, b, 1e-5))


def _gated_atol(ref_fn, args):
    """Interpreted bf16 only: truncation at both of the kernel's roundings (tests/kernels/test_gated_act.py)."""
    if not INTERPRETED or args[0].dtype != torch.bfloat16:
        return None
    exact = ref_fn(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
    return ATOL[torch.bfloat16] + 2.0**-7 * exact.abs().max().item()


GATED = [("silu", G.silu_mul_triton, G.silu_mul_ref, ()), ("gelu", G.gelu_mul_triton, G.gelu_mul_ref, ("none",)),
         ("gelu_tanh", G.gelu_mul_triton, G.gelu_mul_ref, ("tanh",))]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # interpreter only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 123), (3, 7, 14336)])  # odd; Llama-3-8B's intermediate size
@pytest.mark.parametrize("act,kernel,ref_fn,extra", GATED, ids=[g[0] for g in GATED])
def test_gated_act(dtype, shape, act, kernel, ref_fn, extra):
    args = (randn(*shape, dtype=dtype, scale=3), randn(*shape, dtype=dtype), *extra)
    check(kernel(*args), ref_fn, args, atol=_gated_atol(ref_fn, args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_act_takes_the_halves_of_a_fused_gate_up(dtype):
    gu = randn(2, 5, 2 * 8192, dtype=dtype, scale=3)  # Phi-3's gate_up_proj output, row stride 2I
    gate, up = gu[..., :8192], gu[..., 8192:]
    check(G.silu_mul_triton(gate, up), G.silu_mul_ref, (gate, up), atol=_gated_atol(G.silu_mul_ref, (gate, up)))


def test_gated_act_extreme_gates_stay_finite():
    gate = torch.tensor([[-1e4, -90.0, -20.0, -5.125, 0.0, 5.0, 90.0, 1e4]], device=DEVICE)
    up = torch.ones_like(gate)
    for out in (G.silu_mul_triton(gate, up), G.gelu_mul_triton(gate, up), G.gelu_mul_triton(gate, up, "tanh")):
        assert torch.isfinite(out).all()
    exact = G.gelu_mul_ref(gate.double(), up.double(), "tanh").float()  # fp32 torch gives -0.0 at -5.125
    torch.testing.assert_close(G.gelu_mul_triton(gate, up, "tanh"), exact, rtol=1e-5, atol=1e-6)


def _cos_sin(batch, seq_len, rotary_dim, dtype):
    """HF's rotary table: cat(freqs, freqs), cos/sin in the model dtype, positions offset per row."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, device=DEVICE) / rotary_dim)
    pos = torch.arange(seq_len, device=DEVICE) + torch.randint(0, 4000, (batch, 1), device=DEVICE)
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _qk(batch, n_q, n_k, seq_len, head_dim, dtype):
    """q and k as attention makes them: `proj(x).view(B, L, H, D).transpose(1, 2)`, non-contiguous."""
    q = randn(batch, seq_len, n_q, head_dim, dtype=dtype).transpose(1, 2)
    k = randn(batch, seq_len, n_k, head_dim, dtype=dtype).transpose(1, 2)
    return q, k


# (q heads, kv heads, head_dim, rotary_dim, seq_len): Llama-3-8B GQA decode and prefill, Phi-2's 80,
# Phi-3's 96, Gemma's 256, MQA, GPT-NeoX partial rotary (16 of 64), Phi-2 partial (32 of 80)
ROTARY_CASES = [(32, 8, 128, 128, 1), (32, 8, 128, 128, 77), (32, 32, 80, 80, 13), (32, 32, 96, 96, 5),
                (8, 1, 256, 256, 9), (16, 16, 64, 16, 7), (32, 32, 80, 32, 13)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_q,n_k,head_dim,rotary_dim,seq_len", ROTARY_CASES)
def test_rotary(dtype, n_q, n_k, head_dim, rotary_dim, seq_len):
    q, k = _qk(3, n_q, n_k, seq_len, head_dim, dtype)
    cos, sin = _cos_sin(3, seq_len, rotary_dim, dtype)
    args = (q, k, cos, sin, rotary_dim)
    out = RO.rotary_triton(*args)
    assert all(t.is_contiguous() for t in out)
    check(out, RO.rotary_ref, args)
    if rotary_dim < head_dim:  # pass-through features are copied, not recomputed
        assert torch.equal(out[0][..., rotary_dim:], q[..., rotary_dim:])


def test_rotary_broadcasts_a_batch_one_table():
    q, k = _qk(4, 8, 2, 6, 128, torch.bfloat16)
    cos, sin = _cos_sin(1, 6, 128, torch.bfloat16)
    check(RO.rotary_triton(q, k, cos, sin, 128), RO.rotary_ref, (q, k, cos, sin, 128))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 123), (9, 4096)])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("has_bias,has_res", [(True, True), (False, False)])
def test_gelu_residual(dtype, shape, approximate, has_bias, has_res):
    x = randn(*shape, dtype=dtype, scale=3)  # reaches both GELU tails
    bias = randn(shape[-1], dtype=dtype) if has_bias else None
    res = randn(*shape, dtype=dtype) if has_res else None
    check(GR.gelu_residual_triton(x, bias, res, approximate), GR.gelu_residual_ref, (x, bias, res, approximate))


def _op_cases(dtype):
    x, res = randn(3, 5, 64, dtype=dtype), randn(3, 5, 64, dtype=dtype)
    w, b = randn(64, dtype=dtype), randn(64, dtype=dtype)
    q, k = _qk(2, 6, 2, 5, 64, dtype)
    cos, sin = _cos_sin(2, 5, 32, dtype)
    ops = torch.ops.fastflow
    return {
        "rms_norm": (ops.rms_norm.default, (x, w, 1e-6, 0.0, False)),
        "add_rms_norm": (ops.add_rms_norm.default, (x, res, w, 1e-6, 1.0, True)),
        "layer_norm": (ops.layer_norm.default, (x, w, b, 1e-5)),
        "layer_norm_plain": (ops.layer_norm.default, (x, None, None, 1e-6)),
        "silu_mul": (ops.silu_mul.default, (x, res)),
        "gelu_mul": (ops.gelu_mul.default, (x, res, "tanh")),
        "rotary": (ops.rotary.default, (q, k, cos, sin, 32)),
        "gelu_residual": (ops.gelu_residual.default, (x, b, res, "none")),
        "packed_linear": (ops.packed_linear.default, (x, randn(16, 64, dtype=dtype), randn(16, dtype=dtype))),
    }


OP_NAMES = ["rms_norm", "add_rms_norm", "layer_norm", "layer_norm_plain", "silu_mul", "gelu_mul", "rotary",
            "gelu_residual", "packed_linear"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", OP_NAMES)
def test_opcheck(dtype, name):
    from ffl_backend import kernels

    kernels.load_all()
    op, args = _op_cases(dtype)[name]
    torch.library.opcheck(op, args)
