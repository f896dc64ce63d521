"""Quantized models under torch.compile(backend="fastflow"): one graph, eager-quantized logits,
and plain generate() through configure_generate."""
import pytest
import torch

import ffl_backend
from ffl_backend.backend import fastflow
from ffl_backend.generation import configure_generate
from tests.tiny_models import tiny_model

OPS = {"int8": "fastflow.int8_linear", "int4": "fastflow.int4_linear", "w8a8": "fastflow.w8a8_linear"}  # one per linear


def _quantized(scheme, dtype=torch.float32):
    cfg = ffl_backend.QuantConfig("int4", group_size=32) if scheme == "int4" else scheme
    return ffl_backend.quantize(tiny_model("llama", dtype=dtype), cfg)


# One scheme in the fast suite; each compile costs ~15 s of Inductor C++ builds on 2 cores.
@pytest.mark.parametrize("scheme,dtype", [("int8", torch.float32),
                                          pytest.param("int4", torch.bfloat16, marks=pytest.mark.slow),
                                          pytest.param("w8a8", torch.float32, marks=pytest.mark.slow)])
def test_fullgraph_compile_matches_eager_quantized(scheme, dtype):
    torch._dynamo.reset()
    model = _quantized(scheme, dtype)
    ids = torch.randint(3, 128, (1, 12))
    seen = []

    def fastflow_counting(gm, example_inputs):  # the fastflow backend, recording the Dynamo graph's ops
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return fastflow(gm, example_inputs)

    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, backend=fastflow_counting, fullgraph=True)(ids).logits
    # Inductor's packed-GEMM templates round in another order than the aten kernels (a bf16 ulp
    # per layer); that is the whole difference.
    tol = 3e-2 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(compiled, eager, rtol=tol, atol=tol)
    assert seen.count(OPS[scheme]) == 7 * model.config.num_hidden_layers


def test_generate_with_configure_generate():
    torch._dynamo.reset()
    model = _quantized("int8")
    ids = torch.randint(3, 128, (1, 6))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    configure_generate(model, backend=None, max_cache_len=32)  # static cache, eager decode
    eager = model.generate(ids, **kwargs)
    configure_generate(model, max_cache_len=32)
    compiled = model.generate(ids, **kwargs)
    assert compiled.shape == eager.shape == (1, 11)
    # random tiny weights give near-tied logits; the first new tokens must agree
    assert torch.equal(compiled[0, :8], eager[0, :8])
