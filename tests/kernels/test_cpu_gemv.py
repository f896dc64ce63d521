"""fastflow_cpu::gemv, the hand-written CPU decode GEMV: reference equality on odd shapes, opcheck,
clear errors, the build fallback, and its use by the decode_gemv family (siblings grouped)."""
import pytest
import torch

import ffl_backend
from ffl_backend.generation import configure_generate
from ffl_backend.kernels import cpu_gemv, cpu_lib
from tests.helpers import assert_matches_reference
from tests.tiny_models import LAYERS, tiny_model

pytestmark = pytest.mark.skipif(not cpu_lib.load(), reason=f"CPU GEMV kernel not built: {cpu_lib.load_error()}")


def _weights(rows, k, dtype):
    if dtype == torch.int8:
        return [torch.randint(-128, 128, (n, k), dtype=torch.int8) for n in rows]
    return [torch.randn(n, k, dtype=dtype) for n in rows]


def _operands(rows, k, wdtype, xdtype, scaled, biased, xshape=None):
    x = torch.randn(xshape or (1, 1, k), dtype=xdtype)
    ws = _weights(rows, k, wdtype)
    scales = [torch.rand(n, dtype=torch.bfloat16) / 64 for n in rows] if scaled else []
    biases = [torch.randn(n, dtype=xdtype) for n in rows] if biased else []
    return x, ws, scales, biases


@pytest.mark.parametrize("wdtype", [torch.int8, torch.bfloat16])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,k", [((1,), 1), ((7,), 15), ((5, 3), 17), ((193,), 64), ((33, 2, 64), 65),
                                    ((576, 192, 192), 576), ((96,), 1000)])
@pytest.mark.parametrize("scaled,biased", [(True, False), (False, True), (False, False)])
def test_matches_reference(wdtype, xdtype, rows, k, scaled, biased):
    args = _operands(rows, k, wdtype, xdtype, scaled, biased)
    out = torch.ops.fastflow_cpu.gemv(*args)
    assert_matches_reference(out, cpu_gemv.gemv_ref, args, atol=_fp32_sum_tolerance(*args), interpreted=False)


def _fp32_sum_tolerance(x, weights, scales, biases):
    """fp32 outputs: the bound on reordering an fp32 sum of K products, K * eps * sum |x w| (int8
    weights without a scale make sums of ~1e3, where torch's own error is no yardstick)."""
    if x.dtype != torch.float32:
        return None
    mags = [(x.double().abs().reshape(-1, x.shape[-1]) @ w.double().abs().T).max().item() for w in weights]
    return max(1e-5, x.shape[-1] * 2.0**-24 * max(mags))


@pytest.mark.parametrize("wdtype", [torch.int8, torch.bfloat16])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("xshape,k", [((2, 17), 17), ((4, 576), 576), ((3, 1, 65), 65), ((8, 40), 40),
                                      ((5, 1000), 1000), ((7, 9), 9), ((6, 33), 33)])
def test_several_rows_match_reference(wdtype, xdtype, xshape, k):
    """A small batch's decode step: up to MAX_ROWS rows in one call, each weight row loaded once."""
    args = _operands((48, 19), k, wdtype, xdtype, True, True, xshape)
    out = torch.ops.fastflow_cpu.gemv(*args)
    assert out.shape == (*xshape[:-1], 67)
    assert_matches_reference(out, cpu_gemv.gemv_ref, args, atol=_fp32_sum_tolerance(*args), interpreted=False)


@pytest.mark.parametrize("xshape", [(40,), (1, 40), (1, 1, 1, 40)])
def test_output_takes_the_rows_shape(xshape):
    x, ws, scales, biases = _operands((9, 4), 40, torch.int8, torch.float32, True, True, xshape)
    out = torch.ops.fastflow_cpu.gemv(x, ws, scales, biases)
    assert out.shape == (*xshape[:-1], 13)  # the two outputs, concatenated


def test_threads_split_rows_across_matrix_boundaries():
    """Many small matrices in one call: every thread's run of rows starts and ends mid-matrix."""
    args = _operands(tuple(range(1, 40)), 80, torch.int8, torch.float32, True, False)
    for threads in (1, 2, 3):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = torch.ops.fastflow_cpu.gemv(*args)
        finally:
            torch.set_num_threads(previous)
        assert_matches_reference(out, cpu_gemv.gemv_ref, args, interpreted=False)


@pytest.mark.parametrize("wdtype,scaled", [(torch.int8, True), (torch.bfloat16, False)])
def test_opcheck(wdtype, scaled):
    args = _operands((24, 8), 48, wdtype, torch.bfloat16, scaled, True)
    torch.library.opcheck(torch.ops.fastflow_cpu.gemv.default, args)


def test_bad_operands_raise_clear_errors():
    x = torch.randn(1, 32)
    w = torch.randint(-5, 5, (8, 32), dtype=torch.int8)
    gemv = torch.ops.fastflow_cpu.gemv
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        gemv(torch.randn(9, 32), [w], [], [])
    with pytest.raises(RuntimeError, match=r"contiguous CPU \(N, 32\)"):
        gemv(x, [w, torch.randint(-5, 5, (8, 31), dtype=torch.int8)], [], [])
    with pytest.raises(RuntimeError, match=r"contiguous CPU \(N, 32\)"):
        gemv(x, [torch.randint(-5, 5, (32, 8), dtype=torch.int8).T], [], [])
    with pytest.raises(RuntimeError, match="int8 or bfloat16"):
        gemv(x, [torch.randn(8, 32)], [], [])
    with pytest.raises(RuntimeError, match="one scale per weight"):
        gemv(x, [w, w], [torch.ones(8)], [])
    with pytest.raises(RuntimeError, match="vector of its weight's 8 rows"):
        gemv(x, [w], [torch.ones(7)], [])


@pytest.mark.parametrize("n_weights", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_compiles_under_inductor_and_its_cpp_wrapper(n_weights):
    """The op inside an Inductor graph, with the Python and the C++ wrapper (torch 2.13's cpp_wrapper
    crashed on a custom op returning a one-element tensor list: the op returns one tensor)."""
    x, ws, scales, _ = _operands((16,) * n_weights, 32, torch.int8, torch.float32, True, False, (1, 32))

    def f(x):
        return torch.ops.fastflow_cpu.gemv(x * 2, ws, scales, []) + 1

    expected = cpu_gemv.gemv_ref(x * 2, ws, scales) + 1
    for cpp_wrapper in (False, True):
        torch._dynamo.reset()
        with torch._inductor.config.patch(cpp_wrapper=cpp_wrapper):
            torch.testing.assert_close(torch.compile(f, backend="inductor")(x), expected)


def test_build_failure_is_reported_and_loading_says_no(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_lib, "_state", {})
    monkeypatch.setattr(cpu_lib, "_cache_dir", lambda: tmp_path)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_lib.load() is False
    assert "no-such-compiler" in cpu_lib.load_error()
    assert not list(tmp_path.glob("*.so"))


def _kernel_calls(fn) -> int:
    """How many times `fn()` ran the kernel (profiler events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "fastflow_cpu::gemv")


def _decode(model, cpu_gemv_option):
    torch._dynamo.reset()
    ffl_backend.clear_reports()
    options = {"on_error": "raise", "cpu_gemv": cpu_gemv_option, "int8_activations": "float"}  # this op's calls
    configure_generate(model, backend="fastflow", options=options)
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    model.generate(ids, **kw)  # compiles
    out = {}
    calls = _kernel_calls(lambda: out.setdefault("generated", model.generate(ids, **kw)))
    return out["generated"], calls, ffl_backend.last_report()


@pytest.mark.parametrize("scheme,dtype", [("int8-all", torch.float32), (None, torch.bfloat16)])
def test_decode_uses_grouped_kernel_calls_and_matches_inductor_loops(scheme, dtype):
    """A tiny int8 (or bf16) Llama: per layer q/k/v is one call, o one, gate/up one, down one, plus the
    lm_head -- and decoding equals the same model with Inductor's GEMV loops."""
    from ffl_backend.quant import quantize

    model = tiny_model("llama", dtype=dtype)
    if scheme:
        quantize(model, scheme)
    loops, loop_calls, _ = _decode(model, "loops")
    kernel, kernel_calls, report = _decode(model, "auto")
    # The prefill graph's lm_head reads one row (HF keeps only the last position's logits) through a
    # symbolic-length graph, where decode_gemv does not rewrite: an int8 lm_head there runs the op's
    # own CPU path, which takes the kernel for single rows whatever the backend option.
    assert loop_calls == (1 if scheme else 0)
    steps = len(kernel.logits) - 1  # the first token comes from the prefill
    assert kernel_calls == steps * (4 * LAYERS + 1) + loop_calls
    # bf16 q/k/v and gate/up are not fused first: the kernel reads them from their own weights
    assert report.matches["decode_gemv"] == 7 * LAYERS + 1 and report.matches["horizontal"] == 0
    if dtype == torch.float32:
        assert torch.equal(kernel.sequences, loops.sequences)
    for a, b in zip(kernel.logits, loops.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 if dtype == torch.float32 else 0.1)


def test_kernel_option_requires_the_kernel(monkeypatch):
    monkeypatch.setattr(cpu_lib, "load", lambda: False)
    monkeypatch.setattr(cpu_lib, "load_error", lambda: "no compiler here")
    model = tiny_model("llama", dtype=torch.bfloat16)
    out, calls, report = _decode(model, "auto")  # falls back to Inductor's loops
    assert calls == 0 and report.matches["decode_gemv"] == 4 * LAYERS + 1
    with pytest.raises(Exception, match="no compiler here"):
        _decode(model, "kernel")


def test_graphs_that_need_gradients_keep_the_loops():
    """The op has no backward: a single-row linear compiled with gradients on stays Inductor's loop
    (and trains), while the same linear under no_grad takes the kernel."""
    lin = torch.nn.Linear(48, 24, dtype=torch.bfloat16)
    x = torch.randn(1, 48, dtype=torch.bfloat16)
    compiled = torch.compile(lin, backend="fastflow", options={"on_error": "raise"})
    assert _kernel_calls(lambda: compiled(x).float().sum().backward()) == 0
    expected = torch.ones(24, 1, dtype=torch.bfloat16) @ x  # d(sum(x W^T + b))/dW
    torch.testing.assert_close(lin.weight.grad, expected)
    torch._dynamo.reset()
    with torch.no_grad():
        assert _kernel_calls(lambda: torch.compile(lin, backend="fastflow", options={"on_error": "raise"})(x)) >= 1



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_int8_few_rows_take_the_kernel(dtype):
    """Eager `fastflow.int8_linear` on up to MAX_ROWS rows runs the kernel (fp32 math: the reference's
    numerics); more rows, and plain Inductor graphs, keep torch's int8 kernel."""
    from ffl_backend import numerics as P
    from ffl_backend.kernels.quant_linear import int8_linear_ref

    w, b = torch.randn(40, 96, dtype=dtype), torch.randn(40, dtype=dtype)
    q, s = P.quantize_int8(w)
    one, three = torch.randn(1, 1, 96, dtype=dtype), torch.randn(1, 3, 96, dtype=dtype)
    many = torch.randn(cpu_gemv.MAX_ROWS + 1, 96, dtype=dtype)
    op = torch.ops.fastflow.int8_linear
    for x in (one, three):
        assert _kernel_calls(lambda: op(x, q, s, b)) == 1
        assert_matches_reference(op(x, q, s, b), int8_linear_ref, (x, q, s, b), interpreted=False)
    assert _kernel_calls(lambda: op(many, q, s, b)) == 0
    cpu_scale = s.to(torch.bfloat16)  # what quantized modules pass (Inductor's int8pack lowering needs it)
    compiled = torch.compile(lambda x: op(x, q, s, b, cpu_scale), backend="inductor")
    compiled(one)
    assert _kernel_calls(lambda: compiled(one)) == 0


def test_grouping_hoists_a_later_members_constant_weight():
    """Two linears on one row whose second weight is a constant defined after the first linear (as a
    fused weight can be): the grouped call goes before the first, so that constant moves up."""
    import torch.fx as fx

    from ffl_backend.patterns.decode_gemv_calls import KernelGemv, emit_kernel_calls

    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    gm.w1, gm.w2 = torch.randn(8, 16).bfloat16(), torch.randn(4, 16).bfloat16()
    g = gm.graph
    x = g.placeholder("x")
    lin1 = g.call_function(torch.nn.functional.linear, (x, g.get_attr("w1")))
    lin2 = g.call_function(torch.nn.functional.linear, (x, g.get_attr("w2")))
    g.output((lin1, lin2))
    members = [KernelGemv(lin, x, lin.args[1], torch.bfloat16, rows, None, None)
               for lin, rows in ((lin1, 8), (lin2, 4))]
    emit_kernel_calls(gm, members)
    g.lint()
    gm.recompile()
    row = torch.randn(1, 16, dtype=torch.bfloat16)
    for out, w in zip(gm(row), (gm.w1, gm.w2)):
        assert_matches_reference(out, cpu_gemv.gemv_ref, (row, [w]), interpreted=False)


def test_takes_states_what_the_op_accepts():
    """`cpu_gemv.takes`, shared by decode_gemv and the eager int8 path: each refusal, one at a time."""
    x, w, s = torch.randn(1, 1, 32), torch.randint(-5, 5, (8, 32), dtype=torch.int8), torch.rand(8)
    assert cpu_gemv.takes(x, w, s, None)
    assert cpu_gemv.takes(torch.randn(cpu_gemv.MAX_ROWS, 32), w, s)           # a small batch
    assert not cpu_gemv.takes(torch.randn(cpu_gemv.MAX_ROWS + 1, 32), w, s)   # more rows
    assert not cpu_gemv.takes(x.to(torch.float64), w, s)                      # activation dtype
    assert not cpu_gemv.takes(x, torch.randn(8, 32), s)                       # fp32 weight
    assert not cpu_gemv.takes(x, torch.randint(-5, 5, (32, 8), dtype=torch.int8).T, s)  # not contiguous
    assert not cpu_gemv.takes(x, w, torch.rand(7))                            # vector length
    assert not cpu_gemv.takes(x, w, torch.ones(8, dtype=torch.int32))         # integer vector
    assert not cpu_gemv.takes(x.clone().requires_grad_(), w, s)               # needs a backward
    with torch.no_grad():
        assert cpu_gemv.takes(x.clone().requires_grad_(), w, s)
