"""save_quantized / load_quantized: identical logits without re-quantizing, clear errors."""
import copy
import json

import pytest
import torch

import ffl_backend
from ffl_backend.quant import save_quantized
from ffl_backend.quant.quantizer import quantized_modules
from tests.tiny_models import tiny_model

CONFIGS = {"int8": "int8", "int4": ffl_backend.QuantConfig("int4", group_size=32),
           "w8a8_static_smooth": ffl_backend.QuantConfig("w8a8", static=True, smoothquant_alpha=0.5),
           "fp8": "fp8"}


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_identical_logits(llama, tmp_path, name):
    ids = torch.randint(3, 128, (2, 12))
    calib = [torch.randint(3, 128, (1, 32))]
    model = ffl_backend.quantize(copy.deepcopy(llama), CONFIGS[name], calibration_data=calib)
    save_quantized(model, tmp_path)
    loaded = ffl_backend.load_quantized(tmp_path)
    assert set(quantized_modules(loaded)) == set(quantized_modules(model))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight or not llama.config.tie_word_embeddings
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    # safetensors views sit at arbitrary file offsets; torch's int8 kernel segfaults on those
    assert all(b.data_ptr() % 64 == 0 for m in quantized_modules(loaded).values() for b in m.buffers())


def test_bf16_round_trip_keeps_dtype(tmp_path):
    # built in bf16 (not .to(bf16), which would also round the rotary inv_freq buffer)
    model = ffl_backend.quantize(tiny_model("llama", dtype=torch.bfloat16), "int8")
    save_quantized(model, tmp_path)
    loaded = ffl_backend.load_quantized(tmp_path)
    ids = torch.randint(3, 128, (1, 9))
    assert loaded.model.layers[0].mlp.up_proj.scale.dtype == torch.bfloat16
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.fixture
def saved(llama, tmp_path):
    save_quantized(ffl_backend.quantize(copy.deepcopy(llama), "int8"), tmp_path)
    return tmp_path


def test_truncated_weights_are_a_clear_error(saved):
    path = saved / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        ffl_backend.load_quantized(saved)


def test_mismatched_manifest_is_a_clear_error(saved):
    manifest = json.loads((saved / "ffl_quant.json").read_text())
    manifest["modules"]["model.layers.0.mlp.up_proj"]["scheme"] = "fp8"
    (saved / "ffl_quant.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="does not match"):
        ffl_backend.load_quantized(saved)


def test_manifest_naming_an_absent_layer_is_a_clear_error(saved):
    manifest = json.loads((saved / "ffl_quant.json").read_text())
    manifest["modules"]["model.layers.7.mlp.up_proj"] = manifest["modules"]["model.layers.0.mlp.up_proj"]
    (saved / "ffl_quant.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="absent from the model"):
        ffl_backend.load_quantized(saved)


def test_missing_or_truncated_manifest(saved):
    text = (saved / "ffl_quant.json").read_text()
    (saved / "ffl_quant.json").write_text(text[:40])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        ffl_backend.load_quantized(saved)
    (saved / "ffl_quant.json").unlink()
    with pytest.raises(FileNotFoundError, match="ffl_quant.json is missing"):
        ffl_backend.load_quantized(saved)


def test_saving_an_unquantized_model_is_an_error(llama, tmp_path):
    with pytest.raises(ValueError, match="no quantized layers"):
        save_quantized(llama, tmp_path)
