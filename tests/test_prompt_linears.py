"""optimize()'s PromptLinear (ffl_backend/prompt_linears.py): on CPUs without bf16 matrix instructions
a bf16 prompt's linears run fastflow_cpu::gemm, compiled decode steps keep their graphs, restore()
undoes it and quantize() still sees plain linears. The CPU check is forced here so every machine
runs the path (on AVX2 CPUs it is the real one)."""
import pytest
import torch
from torch import nn

import ffl_backend
from ffl_backend import prompt_linears
from ffl_backend.kernels import cpu_gemm, cpu_lib
from tests.helpers import NoFallbacks
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not cpu_lib.load(), reason=f"CPU kernels not built: {cpu_lib.load_error()}")


@pytest.fixture
def avx2_like(monkeypatch):
    """This process decides as a CPU without native bf16 matmul, and every prompt of 2+ rows takes the GEMM."""
    monkeypatch.setattr(cpu_gemm, "replaces_bf16_matmul", lambda: True)
    monkeypatch.setattr(cpu_gemm, "prompt_gemm_min_rows", lambda *a, **k: 2)


def _gemm_calls(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(e.count for e in prof.key_averages() if e.key == "fastflow_cpu::gemm")


def test_prompt_linears_take_the_gemm_and_decode_keeps_its_graph(avx2_like):
    model = tiny_model("llama", dtype=torch.bfloat16)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(ids).logits.float()
    linears = sum(type(m) is nn.Linear for m in model.modules())
    ffl_backend.optimize(model, max_seq_len=32, mode="default")
    assert sum(type(m) is prompt_linears.PromptLinear for m in model.modules()) == linears
    with torch.inference_mode():
        logits, calls = _gemm_calls(lambda: model(ids).logits.float())
        # the prompt's decoder linears (not lm_head: one row per sequence when logits_to_keep is used)
        assert calls >= linears - 1
        # fp32 sums instead of torch's bf16 GEMM: within a few bf16 roundings of the logits' scale
        torch.testing.assert_close(logits, expected, atol=0.05 * expected.abs().max().item(), rtol=0)
        with NoFallbacks():  # decode compiled through fastflow with every family applied
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 18)
    ffl_backend.restore(model)
    assert sum(type(m) is nn.Linear for m in model.modules()) == linears


def test_quantize_after_optimize_still_quantizes_the_linears(avx2_like):
    from ffl_backend.quant import quantize
    from ffl_backend.quant.modules import Int8Linear

    model = tiny_model("llama", dtype=torch.bfloat16)
    ffl_backend.optimize(model, max_seq_len=32, mode="default")
    quantize(model, "int8")
    assert any(isinstance(m, Int8Linear) for m in model.modules())
    assert not any(type(m) is prompt_linears.PromptLinear for m in model.model.layers.modules())


def test_nothing_is_patched_where_torch_multiplies_bf16_natively(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "replaces_bf16_matmul", lambda: False)
    model = tiny_model("llama", dtype=torch.bfloat16)
    ffl_backend.optimize(model, max_seq_len=32, mode="default")
    assert not any(type(m) is prompt_linears.PromptLinear for m in model.modules())


def test_gradients_take_f_linear(avx2_like):
    """The op has no backward: with gradients on, PromptLinear is plain F.linear."""
    layer = nn.Linear(16, 8, dtype=torch.bfloat16)
    layer.__class__ = prompt_linears.PromptLinear
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    _, calls = _gemm_calls(lambda: layer(x).sum().backward())
    assert calls == 0 and x.grad is not None
