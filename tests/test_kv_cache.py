"""optimize(kv_cache_dtype=...): a static cache of int8 / fp8 rows (attention/kv_quant.py) on tiny
models of every architecture: greedy tokens equal transformers' own generate over the same
quantized-then-dequantized K/V, the cache really holds packed rows, kv_cache_bytes counts them."""
import pytest
import torch

import ffl_backend
from ffl_backend.api import kv_cache_bytes
from ffl_backend.attention.kv_quant import packed_width
from ffl_backend.kv_cache import QuantizedWrites
from tests.helpers import fake_quant_kv_attention
from tests.tiny_models import ARCHS, COMMON, SLIDING_KINDS, sliding_model, tiny_model

pytestmark = pytest.mark.usefixtures("no_fallbacks")

FAST = {"inductor": False}  # Dynamo + fastflow's passes, no C++ compile (test_optimize covers Inductor)
NEW = 10
KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _greedy(model, ids, **kw):
    return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kw)


def _reference(model, ids, kv_dtype, **kw):
    """transformers' generate (dynamic cache) with SDPA over fake-quantized K/V."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(fake_quant_kv_attention(kv_dtype))
    try:
        return _greedy(model, ids, **kw)
    finally:
        model.set_attn_implementation(previous)


def _quantized_layers(model):
    loop = model.generate.__wrapped__
    return [layer for cache in loop._caches.values() for layer in cache.layers]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_every_architecture_generates_as_over_fake_quantized_kv(arch, kv):
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(1))
    expected = _reference(model, ids, KV_DTYPES[kv])
    ffl_backend.optimize(model, max_seq_len=48, kv_cache_dtype=kv, **FAST)
    assert torch.equal(_greedy(model, ids), expected)
    layers = _quantized_layers(model)
    assert layers and all(isinstance(layer, QuantizedWrites) for layer in layers)
    width = packed_width(model.config.hidden_size // model.config.num_attention_heads)
    assert all(layer.keys.dtype == torch.int8 and layer.keys.shape[-1] == width for layer in layers)


@pytest.mark.parametrize("kind", SLIDING_KINDS)
def test_sliding_window_models_with_a_quantized_cache(kind, no_fallbacks):
    if kind.startswith("gemma2"):
        no_fallbacks.unfused_ok = ("tanh",)  # the final logits' soft-capping is no fastflow pattern
    model = sliding_model(kind)
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    expected = _reference(model, ids, torch.int8)
    ffl_backend.optimize(model, max_seq_len=40, kv_cache_dtype="int8", **FAST)
    assert torch.equal(_greedy(model, ids), expected)


def test_left_padded_batch_and_transformers_loop_use_the_quantized_cache():
    """A padded batch through the decode loop, and beam search through transformers' own loop (the
    per-instance static cache): both equal the fake-quantized reference."""
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2, 8), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    padded = _reference(model, ids, torch.int8, attention_mask=mask, pad_token_id=0)
    beams = _reference(model, ids[1:], torch.int8, num_beams=2)
    ffl_backend.optimize(model, max_batch_size=2, max_seq_len=40, kv_cache_dtype="int8", **FAST)
    assert torch.equal(_greedy(model, ids, attention_mask=mask, pad_token_id=0), padded)
    assert torch.equal(_greedy(model, ids[1:], num_beams=2), beams)
    hf_cache = model._prepare_static_cache("static", 1, 40, None, {})  # what transformers' loop builds
    assert all(isinstance(layer, QuantizedWrites) for layer in hf_cache.layers)


def test_compiled_decode_with_inductor_and_no_recompiles():
    ffl_backend.clear_reports()  # recompiles() looks at every graph of the process
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    expected = _reference(model, ids, torch.float8_e4m3fn)
    ffl_backend.optimize(model, max_seq_len=48, kv_cache_dtype="fp8")
    assert torch.equal(_greedy(model, ids), expected)
    longer = torch.randint(3, 128, (1, 13), generator=torch.Generator().manual_seed(5))
    _greedy(model, longer)
    assert ffl_backend.recompiles() == []


def test_kv_cache_bytes_of_quantized_rows():
    config = tiny_model("llama").config  # 4 heads x 16 dims; kv heads from COMMON
    kv_heads, head_dim = config.num_key_value_heads, COMMON["hidden_size"] // COMMON["num_attention_heads"]
    per_token = 2 * config.num_hidden_layers * kv_heads
    assert kv_cache_bytes(config, 3, 100, torch.bfloat16) == per_token * 3 * 100 * head_dim * 2
    for kv in ("int8", "fp8", torch.int8):
        assert kv_cache_bytes(config, 3, 100, kv) == per_token * 3 * 100 * packed_width(head_dim)


def test_bad_kv_cache_dtype_and_attention_fail_early():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        ffl_backend.optimize(model, kv_cache_dtype="int4", **FAST)
    with pytest.raises(ValueError, match="needs attention='fastflow'"):
        ffl_backend.optimize(model, kv_cache_dtype="int8", attention="sdpa", **FAST)
