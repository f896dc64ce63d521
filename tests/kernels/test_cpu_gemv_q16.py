"""fastflow_cpu::gemv_q16, the int8 decode GEMV with integer dot products: bit-equal to its reference
on odd shapes (K not a multiple of the 32-value step, long rows summed in segments, zero rows), within
the documented activation-rounding bound of the float64 product, opcheck, clear errors, and its use
by the decode_gemv family under the option int8_activations="int16"."""
import pytest
import torch

import ffl_backend
from ffl_backend.generation import configure_generate
from ffl_backend.kernels import cpu_gemv, cpu_lib
from tests.tiny_models import LAYERS, tiny_model

pytestmark = pytest.mark.skipif(not cpu_lib.load(), reason=f"CPU GEMV kernel not built: {cpu_lib.load_error()}")


def _operands(rows, k, xdtype, m=1, scaled=True, biased=True):
    x = torch.randn(m, k, dtype=xdtype) * torch.linspace(0.1, 4.0, k).to(xdtype)  # uneven magnitudes
    ws = [torch.randint(-128, 128, (n, k), dtype=torch.int8) for n in rows]
    scales = [torch.rand(n, dtype=torch.bfloat16) / 64 for n in rows] if scaled else []
    biases = [torch.randn(n, dtype=xdtype) for n in rows] if biased else []
    return x, ws, scales, biases


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("rows,k", [((1,), 1), ((7,), 15), ((5, 3), 33), ((193,), 64), ((33, 2), 65),
                                    ((96, 19), 577), ((9,), 1000), ((4,), 8192 + 40)])
def test_q16_matches_reference_bit_for_bit(xdtype, m, rows, k):
    args = _operands(rows, k, xdtype, m, scaled=len(rows) != 2, biased=m % 2 == 1)
    out = torch.ops.fastflow_cpu.gemv_q16(*args)
    assert out.shape == (m, sum(rows)) and out.dtype == xdtype
    assert torch.equal(out, cpu_gemv.gemv_q16_ref(*args))


def test_q16_zero_rows_and_single_values():
    x, ws, scales, biases = _operands((17,), 40, torch.float32, m=3)
    x[1] = 0  # scale 0: the bias alone
    x[2] = 0
    x[2, 7] = -3.0  # one value: exact, 32767 * (-3 / 32767)
    out = torch.ops.fastflow_cpu.gemv_q16(x, ws, scales, biases)
    torch.testing.assert_close(out[1], biases[0], rtol=0, atol=0)
    exact = cpu_gemv.gemv_ref(x.double(), ws, scales, biases).float()
    torch.testing.assert_close(out[2], exact[2], rtol=1e-6, atol=1e-6)
    assert torch.equal(out, cpu_gemv.gemv_q16_ref(x, ws, scales, biases))


@pytest.mark.parametrize("m", [1, 4, 6])
def test_q16_largest_sums_do_not_overflow(m):
    """Every product at its largest (|q| = 32767, w = -128) over two and a half segments of K: the
    lane sums and the tiles' shared reductions must not wrap (5 weight rows: one tile and a single row)."""
    k = 2 * 8192 + 4000
    x = torch.full((m, k), -1.0)
    ws = [torch.full((5, k), -128, dtype=torch.int8)]
    out = torch.ops.fastflow_cpu.gemv_q16(x, ws, [], [])
    assert torch.equal(out, cpu_gemv.gemv_q16_ref(x, ws))
    torch.testing.assert_close(out, torch.full((m, 5), 128.0 * k), rtol=2.0**-23, atol=0)


@pytest.mark.parametrize("k", [64, 576, 1536])
def test_q16_error_is_within_the_activation_rounding_bound(k):
    """Each x is off by at most half a step (max|x| / 32767 / 2): the error of row m, output n is at
    most step_m / 2 * sum_k |w_nk| * |s_n| (plus fp32's rounding of the result)."""
    x, ws, scales, _ = _operands((64,), k, torch.float32, m=4, biased=False)
    out = torch.ops.fastflow_cpu.gemv_q16(x, ws, scales, []).double()
    exact = cpu_gemv.gemv_ref(x.double(), ws, scales).double()
    _, step = cpu_gemv.quantize_rows_int16(x)
    bound = step.double() / 2 * (ws[0].double().abs().sum(1) * scales[0].double().abs())[None, :]
    assert ((out - exact).abs() <= bound * 1.001 + exact.abs() * 2.0**-22).all()


def test_q16_opcheck():
    torch.library.opcheck(torch.ops.fastflow_cpu.gemv_q16.default, _operands((24, 8), 48, torch.bfloat16, m=2))


def test_q16_bad_operands_raise_clear_errors():
    x, w = torch.randn(1, 32), torch.randint(-5, 5, (8, 32), dtype=torch.int8)
    with pytest.raises(RuntimeError, match="gemv_q16: weights must be int8"):
        torch.ops.fastflow_cpu.gemv_q16(x, [torch.randn(8, 32, dtype=torch.bfloat16)], [], [])
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        torch.ops.fastflow_cpu.gemv_q16(torch.randn(9, 32), [w], [], [])


def _calls(fn, op: str) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == op)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_int16_option_decodes_through_gemv_q16(dtype):
    """A tiny int8-all Llama with int8_activations="int16": every decode linear (q/k/v, o, gate/up,
    down grouped per layer, and the lm_head) calls gemv_q16, none gemv; the logits stay within the
    activation rounding of the "float" run's."""
    from ffl_backend.quant import quantize

    model = quantize(tiny_model("llama", dtype=dtype), "int8-all")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    runs = {}
    for choice in ("float", "int16"):
        torch._dynamo.reset()
        ffl_backend.clear_reports()
        configure_generate(model, backend="fastflow", options={"on_error": "raise", "int8_activations": choice})
        model.generate(ids, **kw)  # compiles
        out = {}
        counts = {op: _calls(lambda: out.setdefault("g", model.generate(ids, **kw)), op)
                  for op in ("fastflow_cpu::gemv_q16", "fastflow_cpu::gemv")}
        runs[choice] = out["g"], counts
    steps = len(runs["int16"][0].logits) - 1
    # the prefill's lm_head (a symbolic-length graph) runs the int8 op's own CPU path: gemv, both runs
    assert runs["int16"][1] == {"fastflow_cpu::gemv_q16": steps * (4 * LAYERS + 1), "fastflow_cpu::gemv": 1}
    assert runs["float"][1] == {"fastflow_cpu::gemv_q16": 0, "fastflow_cpu::gemv": steps * (4 * LAYERS + 1) + 1}
    same = int((runs["int16"][0].sequences == runs["float"][0].sequences).all(0).int().cumprod(0).sum())
    for a, b in zip(runs["int16"][0].logits[:same - 9 + 1], runs["float"][0].logits):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=0.02 if dtype == torch.float32 else 0.1)


def test_int8_activations_option_is_checked():
    with pytest.raises(ValueError, match="int8_activations must be one of"):
        ffl_backend.config.BackendOptions.parse(options={"int8_activations": "int4"})
