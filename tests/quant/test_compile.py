"""Quantized models under torch.compile(backend="fastflow"): one graph, eager-quantized logits,
and plain generate() through configure_generate."""
import copy

import pytest
import torch

import ffl_backend
from ffl_backend.backend import fastflow
from ffl_backend.generation import configure_generate
from tests.helpers import ATOL, NoFallbacks
from tests.tiny_models import tiny_model

OPS = {"int8": "fastflow.int8_linear", "int4": "fastflow.int4_linear", "w8a8": "fastflow.w8a8_linear"}  # one per linear


def _quantized(scheme, dtype=torch.float32):
    cfg = ffl_backend.QuantConfig("int4", group_size=32) if scheme == "int4" else scheme
    return ffl_backend.quantize(tiny_model("llama", dtype=dtype), cfg)


def _float64_dequantized(model):
    """The quantized model's math in float64: a float64 copy in which every quantized linear is an
    nn.Linear holding its dequantized weight (what the int8/int4/w8a8 kernels approximate)."""
    ref = copy.deepcopy(model).to(torch.float64)
    for name, m in ffl_backend.quant.quantized_modules(model).items():
        lin = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=torch.float64)
        with torch.no_grad():
            lin.weight.copy_(m.dequantized_weight().double())
            if m.bias is not None:
                lin.bias.copy_(m.bias.double())
        parent, _, child = name.rpartition(".")
        setattr(ref.get_submodule(parent) if parent else ref, child, lin)
    return ref


# One scheme in the fast suite; each compile costs ~15 s of Inductor C++ builds on 2 cores.
@pytest.mark.parametrize("scheme,dtype", [("int8", torch.float32),
                                          pytest.param("int4", torch.bfloat16, marks=pytest.mark.slow),
                                          pytest.param("w8a8", torch.float32, marks=pytest.mark.slow)])
def test_fullgraph_compile_matches_eager_quantized(scheme, dtype):
    """Compiled logits against the float64 model of the dequantized weights: no further from it than
    2x the eager quantized model's own distance + ATOL (the CPU kernels compute in bf16 for every
    activation dtype, so eager's distance is bf16-sized even in fp32; Inductor's packed-GEMM
    templates round in another order, never worse)."""
    torch._dynamo.reset()
    model = _quantized(scheme, dtype)
    ids = torch.randint(3, 128, (2, 12))
    seen = []

    def fastflow_counting(gm, example_inputs):  # the fastflow backend, recording the Dynamo graph's ops
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return fastflow(gm, example_inputs)

    with torch.no_grad(), NoFallbacks():
        exact = _float64_dequantized(model)(ids).logits
        eager = model(ids).logits
        compiled = torch.compile(model, backend=fastflow_counting, fullgraph=True)(ids).logits
    eager_err = (eager.double() - exact).abs().max().item()
    err = (compiled.double() - exact).abs().max().item()
    assert compiled.dtype == eager.dtype == dtype
    bound = 2 * eager_err + ATOL[dtype]
    assert err <= bound, f"compiled error {err:.3g} > 2 x eager error {eager_err:.3g} + {ATOL[dtype]}"
    assert seen.count(OPS[scheme]) == 7 * model.config.num_hidden_layers


def test_generate_with_configure_generate():
    """24 greedy tokens (eos off) of the compiled static-cache decode equal the eager ones."""
    torch._dynamo.reset()
    model = _quantized("int8")
    ids = torch.randint(3, 128, (1, 6))
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    configure_generate(model, backend=None, max_cache_len=32)  # static cache, eager decode
    eager = model.generate(ids, **kwargs)
    configure_generate(model, max_cache_len=32)
    with NoFallbacks():
        compiled = model.generate(ids, **kwargs)
    assert compiled.shape == eager.shape == (1, 30)
    assert compiled[0].tolist() == eager[0].tolist()
