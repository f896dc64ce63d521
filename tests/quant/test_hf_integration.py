"""AutoModelForCausalLM.from_pretrained on folders written by save_quantized (quant/hf_integration.py)."""
import copy
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import ffl_backend
from ffl_backend.quant import save_quantized
from ffl_backend.quant.hf_integration import FastflowQuantizationConfig, register_with_transformers
from ffl_backend.quant.quantizer import quantized_modules
from tests.tiny_models import tiny_model

CALIB = [torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(1))]
SCHEMES = {"int8": "int8", "int4": ffl_backend.QuantConfig("int4", group_size=32),
           "w8a8_static_smooth": ffl_backend.QuantConfig("w8a8", static=True, smoothquant_alpha=0.5),
           "fp8": "fp8"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_from_pretrained_loads_quantized_with_identical_logits(tmp_path, name, dtype):
    model = ffl_backend.quantize(tiny_model("llama", dtype=dtype), SCHEMES[name], calibration_data=CALIB)
    save_quantized(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert {n: type(m) for n, m in quantized_modules(loaded).items()} == \
        {n: type(m) for n, m in quantized_modules(model).items()}
    # every saved buffer comes back bit-equal and in its own dtype (w8a8 keeps fp32 scales in a bf16 model)
    expected = model.state_dict()
    for key, value in loaded.state_dict().items():
        assert value.dtype == expected[key].dtype, key
        assert torch.equal(value, expected[key]), key
    ids = torch.randint(3, 128, (2, 12))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_tied_embeddings_stay_tied(tmp_path):
    from transformers import LlamaConfig

    from tests.tiny_models import COMMON

    torch.manual_seed(0)
    config = LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, **COMMON)
    model = ffl_backend.quantize(AutoModelForCausalLM.from_config(config).eval(), "int8")
    save_quantized(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(3, 128, (1, 7))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_quantize_on_load_equals_quantize(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    register_with_transformers()
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=FastflowQuantizationConfig(scheme="int8"))
    reference = ffl_backend.quantize(copy.deepcopy(model), "int8")
    assert len(quantized_modules(loaded)) == len(quantized_modules(reference)) > 0
    ids = torch.randint(3, 128, (1, 10))
    torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_save_pretrained_of_a_loaded_model_round_trips(tmp_path):
    model = ffl_backend.quantize(tiny_model("llama"), "int8")
    save_quantized(model, tmp_path / "a")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    loaded.save_pretrained(tmp_path / "b")  # transformers' own writer, our quantization_config
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    ids = torch.randint(3, 128, (1, 10))
    torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_config_naming_a_missing_layer_is_a_clear_error(tmp_path):
    model = ffl_backend.quantize(tiny_model("llama"), "int8")
    save_quantized(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    modules = config["quantization_config"]["modules"]
    modules["model.layers.9.mlp.up_proj"] = modules.pop("model.layers.1.mlp.up_proj")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj, absent"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_config_needs_modules_or_a_scheme():
    with pytest.raises(ValueError, match="needs either saved `modules` or a `scheme`"):
        FastflowQuantizationConfig()


def test_registration_is_explicit_not_an_import_side_effect(tmp_path):
    save_quantized(ffl_backend.quantize(tiny_model("llama"), "int8"), tmp_path)
    code = ("import ffl_backend, transformers.quantizers.auto as a; before = 'fastflow' in a.AUTO_QUANTIZER_MAPPING; "
            "ffl_backend.quant.register_with_transformers(); "
            "from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}); "
            "print(before, type(m.model.layers[0].mlp.up_proj).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "Int8Linear"]
