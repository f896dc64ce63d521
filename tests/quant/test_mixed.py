"""The "int4-mixed" preset: a format per linear under a bits-per-weight budget, chosen by measured
error (the model's last hidden state with calibration data, the layer's weight without)."""
import copy

import pytest
import torch

import ffl_backend
from ffl_backend.quant.mixed import TIERS, MixedPrecision, _allocate
from ffl_backend.quant.quantizer import STATE_ATTR, quantized_modules
from tests.tiny_models import tiny_model


def _calib(n=3, length=24):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 128, (1, length), generator=gen) for _ in range(n)]


def _stored_bpw(model) -> float:
    bits = params = 0
    for name, m in quantized_modules(model).items():
        if "embed" in name:
            continue
        bits += 8 * sum(t.numel() * t.element_size() for k, t in m.state_dict().items() if k != "bias")
        params += m.in_features * m.out_features
    return bits / params


def test_allocation_takes_the_best_error_drop_per_bit_within_budget():
    costs = {  # (bits per weight, error) per tier, cheapest first
        "a": [(4.0, 1.0), (5.0, 0.2), (8.0, 0.0)],
        "b": [(4.0, 0.3), (5.0, 0.25), (8.0, 0.0)],
    }
    params = {"a": 100, "b": 100}
    assert _allocate(costs, params, 4.0) == {"a": 0, "b": 0}
    assert _allocate(costs, params, 4.5) == {"a": 1, "b": 0}  # a's drop per bit is 16x b's
    # then b straight to int8 (0.3 over 4 bits) beats a to int8 (0.2 over 3) and b's small step (0.05 over 1)
    assert _allocate(costs, params, 6.5) == {"a": 1, "b": 2}
    assert _allocate(costs, params, 8.0) == {"a": 2, "b": 2}


@pytest.mark.parametrize("calibrated", [True, False])
def test_int4_mixed_meets_its_budget_and_records_the_plan(calibrated):
    model = tiny_model("llama", dtype=torch.bfloat16)  # bf16 scales, as the budget assumes
    ids = torch.randint(3, 128, (1, 12))
    with torch.no_grad():
        ref = model(ids).logits
    q = ffl_backend.quantize(copy.deepcopy(model), "int4-mixed", calibration_data=_calib() if calibrated else None)
    plan = getattr(q, STATE_ATTR)["mixed"]
    assert plan["budget_bpw"] == 5.0 and plan["bpw"] <= 5.0
    assert plan["error"] == ("model" if calibrated else "weight")
    assert abs(_stored_bpw(q) - plan["bpw"]) < 1e-3  # the plan's bits are what the modules store
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert sorted(plan["formats"]) == sorted(linears)
    assert {type(m).__name__ for n, m in quantized_modules(q).items()} <= {"Int4Linear", "Int8Linear"}
    with torch.no_grad():
        out = q(ids).logits
    assert torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.99


def test_budget_extremes():
    """A budget above int8's bits puts everything in int8; one at the cheapest bits keeps every layer
    in its cheapest format (down_proj's 96 inputs take groups of 32 at most)."""
    model = tiny_model("llama", dtype=torch.bfloat16)  # bf16 scales, as the budget assumes
    rich = ffl_backend.quantize(copy.deepcopy(model), MixedPrecision(budget_bpw=16.0), calibration_data=_calib())
    assert set(getattr(rich, STATE_ATTR)["mixed"]["formats"].values()) == {"int8"}
    poor = ffl_backend.quantize(copy.deepcopy(model), MixedPrecision(budget_bpw=1.0), calibration_data=_calib())
    formats = getattr(poor, STATE_ATTR)["mixed"]["formats"]
    assert all(v == ("int4-g32" if "down_proj" in n else "int4-g64") for n, v in formats.items())
    assert [label for label, _ in TIERS] == ["int4-g128", "int4-g64", "int4-g32", "int8"]
