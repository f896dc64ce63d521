"""The quantized linear ops on CPU: each path against its pure-torch reference, opcheck, compile.

Tolerances are dtype-aware. The int8/int4 CPU paths compute in bf16 for every activation dtype
(torch's packed kernels are 3-15x slower with fp32 activations), so their bound is twice the error
of the float64 reference run on bf16-rounded inputs and scales with a bf16-rounded output, plus
atol. W8A8 and fp8 quantize activations exactly as the reference does and are held to equality
up to float summation order."""
import pytest
import torch

from ffl_backend import numerics as P
from ffl_backend.kernels import quant_linear as K
from tests.helpers import ATOL as DTYPE_ATOL

DTYPES = (torch.float32, torch.bfloat16)
SHAPES = [(1, 576, 1536), (5, 128, 96), (2, 3, 64, 48)]  # (..., K, N): GEMV, odd M, 3-D input
ATOL = 1e-2


def _inputs(shape, dtype, bias=True):
    *lead, k, n = shape
    x = torch.randn(*lead, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype) * 0.05
    b = torch.randn(n, dtype=dtype) if bias else None
    return x, w, b


def _bf16(t):
    return t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _f64(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def assert_bf16_path_close(out, ref_fn, args):
    """Error vs the float64 reference <= 2x the error of a bf16 computation of it + ATOL."""
    exact = ref_fn(*map(_f64, args)).double()
    bf16_err = (ref_fn(*map(_bf16, args)).double() - exact).abs().max().item()
    err = (out.double() - exact).abs().max().item()
    assert out.dtype == args[0].dtype and out.shape == exact.shape
    assert err <= 2 * bf16_err + ATOL, f"error {err:.3g} > 2 x bf16 error {bf16_err:.3g} + {ATOL}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_cpu_path_matches_reference(dtype, shape):
    x, w, b = _inputs(shape, dtype)
    q, s = P.quantize_int8(w)
    out = torch.ops.fastflow.int8_linear(x, q, s, b, s.to(torch.bfloat16))
    assert_bf16_path_close(out, K.int8_linear_ref, (x, q, s, b))


@pytest.mark.parametrize("shape", [(1, 123, 77), (3, 123, 77), (3, 136, 40)])
def test_int8_odd_in_features_take_the_reference_path(shape):
    """K not a multiple of 16 crashes torch's int8 kernel (a segfault for M > 1): never called there."""
    x, w, b = _inputs(shape, torch.bfloat16)
    q, s = P.quantize_int8(w)
    torch.testing.assert_close(torch.ops.fastflow.int8_linear(x, q, s, b), K.int8_linear_ref(x, q, s, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group", (32, 64))
def test_int4_cpu_path_matches_reference(dtype, shape, group):
    x, w, b = _inputs(shape, dtype)
    q, s, z = P.quantize_int4(w, group)
    qw = P.pack_int4(q)
    packed, sz = K.int4_cpu_pack(qw, s, z, group)
    assert packed is not None  # every N here is a multiple of 16: torch's kernel runs
    out = torch.ops.fastflow.int4_linear(x, qw, s, z, group, b, packed, sz)
    assert_bf16_path_close(out, K.int4_linear_ref, (x, qw, s, z, group, b))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(64, 576, 192), (2, 40, 96, 80)])
def test_prompt_rows_widen_the_weight_and_match_the_reference(scheme, shape):
    """From WIDEN_MIN_ROWS rows of bf16 x, on CPUs with native bf16 matrices, the weight is widened to
    bf16 for one GEMM: within the bf16 bound of the float64 reference."""
    from ffl_backend.kernels import cpu_lib

    x, w, b = _inputs(shape, torch.bfloat16)
    if not K._widens(x, scheme, *w.shape):
        pytest.skip("no native bf16 matrix instructions on this CPU: the row kernels serve prompts")
    if scheme == "int8":
        q, s = P.quantize_int8(w)
        out = torch.ops.fastflow.int8_linear(x, q, s, b, s)
        assert_bf16_path_close(out, K.int8_linear_ref, (x, q, s, b))
    else:
        if not cpu_lib.load():
            pytest.skip(f"CPU kernels not built: {cpu_lib.load_error()}")
        q, s, z = P.quantize_int4(w, 32)
        qw = P.pack_int4(q)
        packed, sz = K.int4_cpu_form(qw, s, z, 32)
        assert packed.dim() == 3  # fastflow's layout, which the widening reads
        out = torch.ops.fastflow.int4_linear(x, qw, s, z, 32, b, packed, sz)
        assert_bf16_path_close(out, K.int4_linear_ref, (x, qw, s, z, 32, b))


def test_int4_falls_back_to_reference_where_torch_kernel_cannot_run():
    x, w, b = _inputs((3, 64, 40), torch.float32)  # N = 40: not a multiple of 16
    q, s, z = P.quantize_int4(w, 32)
    qw = P.pack_int4(q)
    assert K.int4_cpu_pack(qw, s, z, 32) == (None, None)
    out = torch.ops.fastflow.int4_linear(x, qw, s, z, 32, b, None, None)
    torch.testing.assert_close(out, K.int4_linear_ref(x, qw, s, z, 32, b), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("static", (False, True))
def test_w8a8_cpu_path_matches_reference(dtype, shape, static):
    x, w, b = _inputs(shape, dtype)
    q, s = P.quantize_int8(w, torch.float32)
    x_scale = x.abs().max().float() / 127 if static else None
    smooth = torch.rand(shape[-2]) + 0.5
    for sm in (None, smooth):
        out = torch.ops.fastflow.w8a8_linear(x, q, s, x_scale, b, sm)
        torch.testing.assert_close(out, K.w8a8_linear_ref(x, q, s, x_scale, b, sm))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gemm", ("fastflow", "torch"))
def test_w8a8_fallback_where_int_mm_saturates_matches_the_float64_reference(dtype, shape, gemm, monkeypatch):
    """On CPUs whose torch._int_mm saturates (no VNNI: K.int_mm_is_exact() False) W8A8 multiplies its
    int8 codes in fp32: through fastflow's GEMM, or torch's matmul where the library is missing. Forced
    here on any CPU. Bound: twice the error of the same codes summed by torch in fp32, plus the output
    dtype's rounding of the result, against the float64 reference."""
    from ffl_backend.kernels import cpu_gemm

    monkeypatch.setattr(K, "int_mm_is_exact", lambda: False)
    if gemm == "torch":
        monkeypatch.setattr(cpu_gemm, "available", lambda: False)
    elif not cpu_gemm.available():
        pytest.skip("fastflow's CPU GEMM is not built here")
    x, w, b = _inputs(shape, dtype)
    q, s = P.quantize_int8(w, torch.float32)
    for smooth in (None, torch.rand(shape[-2]) + 0.5):
        out = torch.ops.fastflow.w8a8_linear(x, q, s, None, b, smooth)
        exact = K.w8a8_linear_ref(x.double(), q, s.double(), None, _f64(b), _f64(smooth))
        qx, xs = P.quantize_act_int8(K.smoothed_rows(x, smooth))
        fp32 = ((qx.float() @ q.float().T) * xs * s).reshape(exact.shape) + (0 if b is None else b.float())
        own = (fp32.double() - exact).abs().max().item()
        rounding = exact.abs().max().item() * torch.finfo(dtype).eps
        err = (out.double() - exact).abs().max().item()
        assert out.dtype == dtype and out.shape == exact.shape
        assert err <= 2 * own + rounding + 1e-6, f"error {err:.3g} > 2 x fp32 error {own:.3g} + {rounding:.3g}"


def test_w8a8_reference_is_close_to_float():
    x, w, _ = _inputs((8, 512, 256), torch.float32, bias=False)
    q, s = P.quantize_int8(w, torch.float32)
    assert P.sqnr(x @ w.T, K.w8a8_linear_ref(x, q, s)) > 38.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_cpu_emulation_matches_float64_dequantized_math(dtype, shape):
    """The CPU fp8 path *is* fp8_linear_ref (an emulation), so it is held to float64 math written
    here instead: per-token e4m3 activations (row absmax / 448, the scheme's definition) times the
    dequantized e4m3 weights, + bias, against <= 2x the error of plain F.linear at `dtype` on the same
    dequantized operands (+ ATOL); and the whole fp8 linear stays near the unquantized one (SQNR)."""
    x, w, b = _inputs(shape, dtype)
    q, s = P.quantize_fp8(w)
    out = torch.ops.fastflow.fp8_linear(x, q, s, b)
    x2 = x.reshape(-1, x.shape[-1]).float()
    xs = x2.abs().amax(dim=1, keepdim=True) / 448.0
    qx = (x2 / xs).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

    def dequantized_linear(t):  # the same math in dtype t
        return torch.nn.functional.linear(qx.to(t) * xs.to(t), q.to(t) * s.to(t)[:, None], b.to(t))

    exact = dequantized_linear(torch.float64).reshape(out.shape)
    plain_err = (dequantized_linear(dtype).reshape(out.shape).double() - exact).abs().max().item()
    err = (out.double() - exact).abs().max().item()
    assert out.dtype == dtype and err <= 2 * plain_err + DTYPE_ATOL[dtype], (err, plain_err)
    assert P.sqnr(torch.nn.functional.linear(x.double(), w.double(), _f64(b)), out) > 26.0


def _op_cases(dtype):
    x, w, b = _inputs((2, 3, 64, 48), dtype)
    q8, s8 = P.quantize_int8(w)
    q4, s4, z4 = P.quantize_int4(w, 32)
    qw4 = P.pack_int4(q4)
    packed, sz = K.int4_cpu_pack(qw4, s4, z4, 32)
    qa, sa = P.quantize_int8(w, torch.float32)
    qf, sf = P.quantize_fp8(w)
    return {
        "int8": (torch.ops.fastflow.int8_linear.default, (x, q8, s8, b, s8.to(torch.bfloat16))),
        "int4": (torch.ops.fastflow.int4_linear.default, (x, qw4, s4, z4, 32, b, packed, sz)),
        "int4_ref": (torch.ops.fastflow.int4_linear.default, (x, qw4, s4, z4, 32, None, None, None)),
        "w8a8": (torch.ops.fastflow.w8a8_linear.default, (x, qa, sa, None, b, None)),
        "w8a8_static": (torch.ops.fastflow.w8a8_linear.default,
                        (x, qa, sa, torch.tensor(0.02), None, torch.rand(64) + 0.5)),
        "fp8": (torch.ops.fastflow.fp8_linear.default, (x, qf, sf, b)),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["int8", "int4", "int4_ref", "w8a8", "w8a8_static", "fp8"])
def test_opcheck(dtype, case):
    op, args = _op_cases(dtype)[case]
    # opcheck's schema test compares inputs with ops that have no float8 CPU kernel
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic") if case == "fp8" else None
    torch.library.opcheck(op, args, test_utils=utils) if utils else torch.library.opcheck(op, args)


# The reference of each op case and the arguments it takes (the ops' extra CPU-form arguments dropped).
REFERENCES = {"int8": (K.int8_linear_ref, slice(0, 4)), "int4": (K.int4_linear_ref, slice(0, 6)),
              "w8a8": (K.w8a8_linear_ref, slice(0, 6)), "fp8": (K.fp8_linear_ref, slice(0, 4))}


@pytest.mark.parametrize("case", ["int8", "int4", "w8a8", "fp8"])
def test_compiled_op_matches_the_float64_reference(case):
    """The op inside an Inductor graph (its lowering may differ from the eager kernel: Inductor's
    C++ GEMM template for the packed int8 kernel rounds in another order) against the float64
    reference, held to the eager op's own error, doubled, plus one bf16 ulp of the output."""
    op, args = _op_cases(torch.float32)[case]
    ref_fn, ref_args = REFERENCES[case]
    exact = ref_fn(*map(_f64, args[ref_args])).double()
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True)(*args)
    eager_err = (op(*args).double() - exact).abs().max().item()
    err = (compiled.double() - exact).abs().max().item()
    ulp = exact.abs().max().item() * 2**-8
    assert compiled.shape == exact.shape and err <= 2 * eager_err + ulp, (err, eager_err, ulp)
