"""`ffl_backend.quantize` on tiny Llama models: module swap, quality per scheme, configs, errors."""
import copy
import logging

import pytest
import torch

import ffl_backend
from ffl_backend import numerics as P
from ffl_backend.quant import modules as M
from ffl_backend.quant.quantizer import quantized_modules
from tests.tiny_models import tiny_model

# Logit SQNR floors of the quantized tiny Llama vs its float model (measured minus ~3 dB).
LOGIT_FLOORS = {"int8": 38.0, "int4": 15.0, "w8a8": 35.0, "fp8": 24.0}
LINEARS_PER_LAYER = 7


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _ids(n=16, batch=2):
    return torch.randint(3, 128, (batch, n))


def _calib():
    return [torch.randint(3, 128, (1, 32)) for _ in range(2)]


@pytest.mark.parametrize("scheme", ["int8", "int4", "w8a8", "fp8"])
def test_scheme_name_swaps_every_decoder_linear(llama, scheme):
    ids = _ids()
    model = ffl_backend.quantize(copy.deepcopy(llama), scheme)
    swapped = quantized_modules(model)
    assert len(swapped) == LINEARS_PER_LAYER * llama.config.num_hidden_layers
    assert all(m.scheme == scheme for m in swapped.values())
    assert type(model.lm_head) is torch.nn.Linear  # mixed precision by default
    assert not any(isinstance(m, torch.nn.Linear) for n, m in model.named_modules() if n.startswith("model.layers"))
    assert P.sqnr(llama(ids).logits, model(ids).logits) > LOGIT_FLOORS[scheme]


def test_int4_name_with_a_group_size(llama):
    model = ffl_backend.quantize(copy.deepcopy(llama), "int4-g32")
    assert {m.group_size for m in quantized_modules(model).values()} == {32}
    for bad in ("int4-gx", "int8-g32"):
        with pytest.raises(ValueError, match="unknown quantization scheme"):
            ffl_backend.quantize(copy.deepcopy(llama), bad)


def test_original_weights_are_freed(llama):
    model = copy.deepcopy(llama)
    q_proj = model.model.layers[0].self_attn.q_proj
    import weakref

    ref = weakref.ref(q_proj.weight)
    del q_proj
    ffl_backend.quantize(model, "int8")
    assert ref() is None


def test_skip_and_include_patterns(llama):
    cfg = ffl_backend.QuantConfig("int8", include=("model.layers.1.*",), skip=("*.down_proj",))
    model = ffl_backend.quantize(copy.deepcopy(llama), cfg)
    names = set(quantized_modules(model))
    assert names == {f"model.layers.1.{p}" for p in
                     ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj")}


def test_int4_group_not_dividing_keeps_layer_with_warning(llama, caplog):
    # intermediate_size 96: down_proj (in_features 96) cannot take 64-wide groups
    with caplog.at_level(logging.WARNING, logger="ffl_backend"):
        model = ffl_backend.quantize(copy.deepcopy(llama), ffl_backend.QuantConfig("int4", group_size=64))
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert isinstance(model.model.layers[0].mlp.up_proj, M.Int4Linear)
    assert "does not divide in_features 96" in caplog.text
    assert "model.layers.0.mlp.down_proj" in model._ffl_quant["kept"]


def test_int4_default_group_is_the_smallest_that_divides(llama):
    model = ffl_backend.quantize(copy.deepcopy(llama), "int4")
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.group_size == 32 and layer.mlp.down_proj.group_size == 32  # K 64, 96
    assert ffl_backend.QuantConfig("int4").group_for(48) is None  # no group divides 48: kept
    assert not model._ffl_quant["kept"]


def test_static_w8a8_needs_calibration_data(llama):
    for cfg in (ffl_backend.QuantConfig("w8a8", static=True), ffl_backend.QuantConfig("w8a8", smoothquant_alpha=0.5)):
        with pytest.raises(ValueError, match="needs calibration_data"):
            ffl_backend.quantize(copy.deepcopy(llama), cfg)


def test_static_w8a8_with_smoothquant_folds_into_norms(llama):
    ids = _ids()
    model = copy.deepcopy(llama)
    norm_before = model.model.layers[0].input_layernorm.weight.clone()
    cfg = ffl_backend.QuantConfig("w8a8", static=True, smoothquant_alpha=0.5)
    ffl_backend.quantize(model, cfg, calibration_data=_calib())
    layer = model.model.layers[0]
    assert not torch.equal(layer.input_layernorm.weight, norm_before)
    # q/k/v and gate/up read a norm output: smoothing folded there; o_proj/down_proj scale their input
    for name in ("q_proj", "k_proj", "v_proj"):
        m = getattr(layer.self_attn, name)
        assert m.smooth is None and m.x_scale is not None
    assert layer.self_attn.o_proj.smooth is not None and layer.mlp.down_proj.smooth is not None
    assert P.sqnr(llama(ids).logits, model(ids).logits) > 25.0


def test_static_w8a8_falls_back_to_per_token_on_token_outliers(llama, caplog):
    calib = _calib()
    static = ffl_backend.quantize(copy.deepcopy(llama), ffl_backend.QuantConfig(
        "w8a8", static=True, static_range_limit=float("inf")), calibration_data=calib)
    assert all(m.x_scale is not None for m in quantized_modules(static).values())
    with caplog.at_level(logging.WARNING, logger="ffl_backend"):
        mixed = ffl_backend.quantize(copy.deepcopy(llama), ffl_backend.QuantConfig(
            "w8a8", static=True, static_range_limit=1.0), calibration_data=calib)
    assert any(m.x_scale is None for m in quantized_modules(mixed).values())
    assert "dynamic per-token activation scales" in caplog.text


def test_gemma_norm_is_not_folded():
    """Gemma scales by 1 + w: dividing w by s is wrong there, so the modules smooth themselves."""
    gemma = tiny_model("gemma")
    ids = _ids()
    model = ffl_backend.quantize(copy.deepcopy(gemma), ffl_backend.QuantConfig("w8a8", smoothquant_alpha=0.5),
                                 calibration_data=_calib())
    assert model.model.layers[0].self_attn.q_proj.smooth is not None
    assert P.sqnr(gemma(ids).logits, model(ids).logits) > 25.0


def test_int4_defaults_to_zero_points(llama):
    model = ffl_backend.quantize(copy.deepcopy(llama), ffl_backend.QuantConfig("int4", group_size=32))
    assert not torch.all(model.model.layers[0].mlp.up_proj.zero == 8)
    model = ffl_backend.quantize(copy.deepcopy(llama), ffl_backend.QuantConfig("int4", group_size=32, symmetric=True))
    assert torch.all(model.model.layers[0].mlp.up_proj.zero == 8)


def test_bad_configs_are_errors():
    cases = [dict(scheme="int3"), dict(scheme="int4", group_size=48), dict(scheme="int8", symmetric=False),
             dict(scheme="int8", static=True), dict(scheme="w8a8", smoothquant_alpha=1.5)]
    for kwargs in cases:
        with pytest.raises(ValueError):
            ffl_backend.QuantConfig(**kwargs)
    with pytest.raises(ValueError, match="unknown QuantConfig field"):
        ffl_backend.quant.resolve({"scheme": "int8", "group": 32})
    with pytest.raises(TypeError):
        ffl_backend.quant.resolve(8)


def test_unsupported_dtype_is_an_error(llama):
    with pytest.raises(TypeError, match="not supported"):
        ffl_backend.quantize(copy.deepcopy(llama).double(), "int8")


def test_bad_calibration_data_is_an_error(llama):
    with pytest.raises(ValueError, match="integer"):
        ffl_backend.quantize(copy.deepcopy(llama), ffl_backend.QuantConfig("w8a8", static=True),
                             calibration_data=[torch.randn(1, 8)])


def test_bf16_model_keeps_bf16_scales(llama):
    model = ffl_backend.quantize(copy.deepcopy(llama).to(torch.bfloat16), "int8")
    m = model.model.layers[0].mlp.up_proj
    assert m.scale.dtype == torch.bfloat16 and m.cpu_scale is None
    assert model(_ids()).logits.dtype == torch.bfloat16
