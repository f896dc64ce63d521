"""Horizontal fusion: correctness, and no weight copy once storage is shared."""
import torch

import ffl_backend
from ffl_backend.patterns import horizontal
from ffl_backend.quant.weight_layout import share_fused_storage
from tests.tiny_models import LAYERS, tiny_model


def _compile_and_run(model, ids):
    torch._dynamo.reset()
    ffl_backend.clear_reports()
    compiled = torch.compile(model, backend="fastflow", options={"inductor": False, "on_error": "raise"})
    with torch.no_grad():
        return compiled(ids).logits


def test_share_fused_storage_keeps_values_and_avoids_copies(monkeypatch):
    model = tiny_model("qwen2")  # q/k/v with biases, gate/up without
    ids = torch.randint(3, 128, (1, 7))
    with torch.no_grad():
        ref = model(ids).logits
    params_before = {n: p for n, p in model.named_parameters()}
    assert share_fused_storage(model) == 2 * LAYERS
    assert {n: p for n, p in model.named_parameters()}.keys() == params_before.keys()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=0)

    fused = []
    real_fuse = horizontal._fuse_tensors

    def spy(tensors):
        out = real_fuse(tensors)
        fused.append(out.untyped_storage().data_ptr() == tensors[0].untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(horizontal, "_fuse_tensors", spy)
    out = _compile_and_run(model, ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert ffl_backend.last_report().matches["horizontal"] == 2 * LAYERS
    assert len(fused) == 3 * LAYERS and all(fused), "fused weights were copied although storage is shared"
    # in-place updates through the original parameters reach the fused weight
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight.mul_(0.5)
        ref2 = model(ids).logits
    torch.testing.assert_close(_compile_and_run(model, ids), ref2, rtol=1e-5, atol=1e-5)


def test_unshared_weights_are_concatenated_once(monkeypatch):
    model = tiny_model("llama")
    fused = []
    real_fuse = horizontal._fuse_tensors
    monkeypatch.setattr(horizontal, "_fuse_tensors", lambda ts: fused.append(1) or real_fuse(ts))
    ids = torch.randint(3, 128, (1, 7))
    with torch.no_grad():
        ref = model(ids).logits
    torch.testing.assert_close(_compile_and_run(model, ids), ref, rtol=1e-5, atol=1e-5)
    assert ffl_backend.last_report().matches["horizontal"] == 2 * LAYERS
    assert len(fused) == 2 * LAYERS  # one concatenation per group, at compile time


def test_shared_storage_model_still_saves_and_reloads(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    share_fused_storage(model)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 128, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)
