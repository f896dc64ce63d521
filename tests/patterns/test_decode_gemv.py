"""decode_gemv family: single-row CPU linears become multiply + sum under Inductor, and fp32 weights
that are exact bf16 values are read from a bf16 copy; everything else is left alone."""
import pytest
import torch
import torch.nn.functional as F

import ffl_backend
from ffl_backend.generation import configure_generate
from ffl_backend.kernels import cpu_gemv, cpu_lib, packed_linear, weight_cache
from ffl_backend.patterns.decode_gemv import is_bf16_exact, linear_rowwise
from tests.helpers import assert_matches_reference
from tests.tiny_models import LAYERS, tiny_model


def _linear_model(n, k, dtype, bias, exact=False):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=bias).to(dtype)
    if exact:  # a bf16 checkpoint loaded in fp32
        with torch.no_grad():
            for p in lin.parameters():
                p.copy_(p.to(torch.bfloat16).to(dtype))
    return lin.eval()


def _compiled(module, **options):
    torch._dynamo.reset()
    ffl_backend.clear_reports()
    return torch.compile(module, backend="fastflow", options={"on_error": "raise", **options})


@pytest.mark.parametrize("dtype,exact", [(torch.bfloat16, False), (torch.float32, True)])
@pytest.mark.parametrize("xshape,n", [((1, 576), 960), ((1, 1, 123), 77), ((123,), 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_single_row_linear_is_rewritten_and_matches_reference(dtype, exact, xshape, n, bias):
    lin = _linear_model(n, xshape[-1], dtype, bias, exact)
    x = torch.randn(xshape, dtype=dtype)
    with torch.no_grad():
        out = _compiled(lin)(x)
    assert ffl_backend.last_report().matches["decode_gemv"] == 1
    assert_matches_reference(out, F.linear, (x, lin.weight.detach(), None if lin.bias is None else lin.bias.detach()),
                             interpreted=False)


def test_prompt_rows_and_inexact_fp32_and_eager_graphs_are_left_alone():
    lin_bf16 = _linear_model(64, 48, torch.bfloat16, True)
    with torch.no_grad():
        _compiled(lin_bf16)(torch.randn(cpu_gemv.MAX_ROWS + 1, 48, dtype=torch.bfloat16))  # prefill-like
        rep = ffl_backend.last_report()
        # packed where oneDNN packs bf16 on this CPU (AVX-512 or AVX-NE-CONVERT); declined, F.linear, elsewhere
        packs = packed_linear.cpu_packs(torch.bfloat16)
        assert rep.matches["decode_gemv"] == 0 and rep.ops.get("packed_linear", 0) == int(packs)

        lin_fp32 = _linear_model(64, 48, torch.float32, True)  # random fp32: not bf16 values
        x = torch.randn(1, 48)
        torch.testing.assert_close(_compiled(lin_fp32)(x), lin_fp32(x))
        assert ffl_backend.last_report().matches["decode_gemv"] == 0

        exact = _linear_model(64, 48, torch.float32, True, exact=True)
        torch.testing.assert_close(_compiled(exact, bf16_exact_weights=False)(x), exact(x))
        assert ffl_backend.last_report().matches["decode_gemv"] == 0

        torch.testing.assert_close(_compiled(lin_bf16, inductor=False)(x.bfloat16()), lin_bf16(x.bfloat16()))
        assert ffl_backend.last_report().matches["decode_gemv"] == 0


@pytest.mark.parametrize("rows", [2, 4])
def test_bf16_linear_of_a_few_rows_takes_the_kernel(rows):
    if not cpu_lib.load():
        pytest.skip(f"CPU GEMV kernel unavailable: {cpu_lib.load_error()}")
    lin = _linear_model(64, 48, torch.bfloat16, True)
    x = torch.randn(rows, 48, dtype=torch.bfloat16)
    with torch.no_grad():
        out = _compiled(lin)(x)
        assert ffl_backend.last_report().matches["decode_gemv"] == 1
        assert_matches_reference(out, F.linear, (x, lin.weight, lin.bias), interpreted=False)
        out = _compiled(lin, cpu_gemv="loops")(x)  # without the kernel several rows keep oneDNN
        assert ffl_backend.last_report().matches["decode_gemv"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,with_kernel,expected", [(1, True, 1), (3, True, 1), (8, True, 1), (9, True, 0),
                                                       (1, False, 1), (3, False, 0)])
def test_int8_linear_few_rows_are_rewritten_and_match_reference(dtype, rows, with_kernel, expected):
    """One row: the kernel, or multiply + sum without it; up to cpu_gemv.MAX_ROWS rows (a small batch's
    decode step): the kernel only; more rows keep torch's int8 kernel. The float kernel, held to the
    fp32 bound (int16 activations: tests/kernels/test_cpu_gemv_q16.py)."""
    from ffl_backend.kernels.quant_linear import int8_linear_ref
    from ffl_backend.quant.modules import Int8Linear
    from ffl_backend.quant.schemes import QuantConfig

    if with_kernel and not cpu_lib.load():
        pytest.skip(f"CPU GEMV kernel unavailable: {cpu_lib.load_error()}")
    q = Int8Linear.from_linear(_linear_model(77, 123, dtype, True), QuantConfig("int8")).eval()
    x = torch.randn(1, rows, 123, dtype=dtype)
    with torch.no_grad():
        out = _compiled(q, cpu_gemv="auto" if with_kernel else "loops", int8_activations="float")(x)
    assert ffl_backend.last_report().matches["decode_gemv"] == expected
    if expected:  # the other graphs keep the ATen kernel, held to the reference elsewhere
        assert_matches_reference(out, int8_linear_ref, (x, q.qweight, q.scale, q.bias), interpreted=False)


def test_bf16_exact_detects_low_mantissa_bits():
    w = torch.randn(32, 16)
    assert not is_bf16_exact(w)
    assert is_bf16_exact(w.bfloat16().float())
    assert not is_bf16_exact(w.bfloat16())  # already bf16: nothing to compact
    w2 = w.bfloat16().float()
    w2[3, 5] = w2[3, 5].nextafter(torch.tensor(1e9))  # one value with a low bit set
    assert not is_bf16_exact(w2)


def test_compact_copy_is_shared_across_compiles_and_rebuilt_after_an_update():
    w = torch.randn(16, 8).bfloat16().float()
    make = lambda t: t.to(torch.bfloat16)  # noqa: E731
    first = weight_cache.derived("bf16_exact", w, make)
    assert weight_cache.derived("bf16_exact", w, make) is first
    with torch.no_grad():
        w.mul_(2)
    second = weight_cache.derived("bf16_exact", w, make)
    assert second is not first and torch.equal(second, w.to(torch.bfloat16))


def test_rowwise_expression_equals_linear_in_eager():
    x, w, b = torch.randn(1, 1, 40), torch.randn(24, 40), torch.randn(24)
    torch.testing.assert_close(linear_rowwise(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("cpu_gemv_option", ["auto", "loops"])
def test_bf16_exact_fp32_model_decodes_like_eager(cpu_gemv_option):
    """A tiny Llama whose fp32 weights are bf16 values: every decode linear runs on a bf16 copy, and
    greedy tokens equal eager's. The loops read fused q/k/v and gate/up (4 linears per layer: qkv, o,
    gate_up, down); the kernel reads all 7 from their own weights, unfused (no fused copy)."""
    if cpu_gemv_option == "auto" and not cpu_lib.load():
        pytest.skip(f"CPU GEMV kernel unavailable: {cpu_lib.load_error()}")
    model = tiny_model("llama")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    ids = torch.randint(3, 128, (1, 9))
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    configure_generate(model, backend=None)
    eager = model.generate(ids, **kw)
    torch._dynamo.reset()
    ffl_backend.clear_reports()
    configure_generate(model, backend="fastflow", options={"on_error": "raise", "cpu_gemv": cpu_gemv_option})
    fast = model.generate(ids, **kw)
    assert torch.equal(fast.sequences, eager.sequences)
    for a, b in zip(fast.logits, eager.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    rep = ffl_backend.last_report()
    expected = {"auto": (0, 7 * LAYERS + 1), "loops": (2 * LAYERS, 4 * LAYERS + 1)}[cpu_gemv_option]
    assert (rep.matches["horizontal"], rep.matches["decode_gemv"]) == expected
    assert "packed_linear" not in rep.ops


@pytest.mark.slow
def test_a_graph_without_kernel_linears_needs_no_library():
    """Nothing for the kernel in a process that never loaded the library (an inexact fp32 model):
    the pass leaves the graph alone without touching the library's ops, so no family falls back."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import torch, ffl_backend\n"
            "from tests.tiny_models import tiny_model\n"
            "model = tiny_model('llama')\n"
            "step = torch.compile(lambda ids: model(input_ids=ids).logits, backend='fastflow')\n"
            "with torch.no_grad():\n"
            "    step(torch.randint(3, 100, (1, 1)))\n"
            "print(repr(ffl_backend.last_report().fallbacks))\n")
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "{}"
