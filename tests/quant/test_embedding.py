"""Opt-in int8 embeddings: `QuantConfig("int8", skip=())` quantizes the embedding and lm_head too, and
a tied pair shares one int8 table in memory, on disk reloads and through from_pretrained."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

import ffl_backend
from ffl_backend.generation import configure_generate
from ffl_backend.numerics import sqnr
from ffl_backend.quant import QuantConfig, load_quantized, save_quantized
from ffl_backend.quant.hf_integration import register_with_transformers
from ffl_backend.quant.modules import Int8Embedding, Int8Linear
from tests.tiny_models import COMMON, tiny_model

ALL_INT8 = QuantConfig("int8", skip=())


def _tied_llama(dtype=torch.float32):
    torch.manual_seed(0)
    config = LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, **COMMON)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _shares_table(model) -> bool:
    emb, head = model.model.embed_tokens, model.lm_head
    return (isinstance(emb, Int8Embedding) and isinstance(head, Int8Linear)
            and emb.qweight.data_ptr() == head.qweight.data_ptr() and emb.scale.data_ptr() == head.scale.data_ptr())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_embedding_and_head_share_one_int8_table(dtype):
    model = _tied_llama(dtype)
    ids = torch.randint(3, 128, (2, 11))
    with torch.no_grad():
        ref = model(ids).logits.float()
        ffl_backend.quantize(model, ALL_INT8)
        out = model(ids).logits.float()
    assert _shares_table(model)
    assert not any(p.shape[0] == model.config.vocab_size for p in model.parameters()), "float table left behind"
    assert sqnr(ref, out) > 30


def test_untied_embedding_rows_equal_the_dequantized_table():
    model = tiny_model("llama")
    emb = model.model.embed_tokens
    weight = emb.weight.detach().clone()
    ffl_backend.quantize(model, ALL_INT8)
    q = model.model.embed_tokens
    assert isinstance(q, Int8Embedding) and not _shares_table(model)
    ids = torch.tensor([[0, 5, 127], [3, 3, 64]])
    torch.testing.assert_close(q(ids), F.embedding(ids, q.dequantized_weight().to(q.dtype)), rtol=0, atol=0)
    assert sqnr(weight, q.dequantized_weight()) > 35


def test_other_schemes_keep_embeddings_with_a_reason():
    model = ffl_backend.quantize(tiny_model("llama"), QuantConfig("int4", group_size=32, skip=()))
    assert type(model.model.embed_tokens) is torch.nn.Embedding
    assert "int8 scheme only" in model._ffl_quant["kept"]["model.embed_tokens"]


def test_int8_all_preset_names_that_config():
    from ffl_backend.quant.schemes import resolve

    assert resolve("int8-all") == ALL_INT8


def test_save_load_and_from_pretrained_keep_the_table_shared(tmp_path):
    model = ffl_backend.quantize(_tied_llama(torch.bfloat16), "int8-all")
    ids = torch.randint(3, 128, (1, 9))
    with torch.no_grad():
        expected = model(ids).logits
    save_quantized(model, tmp_path)
    for loaded in (load_quantized(tmp_path), _from_pretrained(tmp_path)):
        assert _shares_table(loaded)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)


def test_int4_all_preset_keeps_int4_linears_and_an_int8_head_shared_with_the_embedding(tmp_path):
    from ffl_backend.quant.modules import Int4Linear

    model = ffl_backend.quantize(_tied_llama(torch.bfloat16), "int4-all")
    assert _shares_table(model)
    assert isinstance(model.model.layers[0].mlp.down_proj, Int4Linear)
    assert [c["scheme"] for c in model._ffl_quant["config"]] == ["int4", "int8"]
    ids = torch.randint(3, 128, (1, 9))
    with torch.no_grad():
        expected = model(ids).logits
    save_quantized(model, tmp_path)
    for loaded in (load_quantized(tmp_path), _from_pretrained(tmp_path)):
        assert _shares_table(loaded) and isinstance(loaded.model.layers[0].mlp.down_proj, Int4Linear)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)


def _from_pretrained(folder):
    register_with_transformers()
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def test_int8_embedding_model_compiles_and_decodes_like_eager():
    model = ffl_backend.quantize(_tied_llama(torch.bfloat16), ALL_INT8)
    ids = torch.randint(3, 128, (1, 7))
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    configure_generate(model, backend=None)
    eager = model.generate(ids, **kw)
    torch._dynamo.reset()
    configure_generate(model, backend="fastflow", options={"on_error": "raise"})
    assert torch.equal(model.generate(ids, **kw), eager)
