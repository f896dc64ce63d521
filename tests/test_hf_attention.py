"""The "fastflow" transformers attention on tiny random models: greedy tokens equal HF's defaults
(dynamic cache, sdpa), left-padded batches equal single prompts, sliding windows decode without
recompiles, limits fail early, and `restore` gives the model back."""
import subprocess
import sys

import pytest
import torch

import ffl_backend
from ffl_backend.api import kv_cache_bytes, restore
from tests.tiny_models import COMMON, SLIDING_KINDS, sliding_model, tiny_model

pytestmark = pytest.mark.usefixtures("no_fallbacks")  # no pattern family fell back, no anchor left

# Dynamo + the fastflow passes with the graph run as traced: these tests are about attention and
# caching, and skip Inductor's C++ compile (test_optimize.py covers the Inductor path).
FAST = {"inductor": False}
NEW = 12


def _greedy(model, ids, **kw):
    return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kw)


def _graph_count():
    return len(ffl_backend.fusion_reports())


def test_registration_happens_in_optimize_not_at_import():
    code = ("import ffl_backend, ffl_backend.api, ffl_backend.hf_attention\n"
            "from transformers import AttentionInterface\n"
            "from transformers.masking_utils import AttentionMaskInterface\n"
            "assert 'fastflow' not in AttentionInterface._global_mapping\n"
            "assert 'fastflow' not in AttentionMaskInterface._global_mapping\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def _optimized_batch_matches_each_prompt_alone(model, lengths, max_seq_len):
    """Greedy tokens of each prompt alone (HF defaults, before optimize), then of all of them as one
    left-padded batch after optimize: row by row equal. Returns the prompts and their tokens."""
    prompts = [torch.randint(3, 128, (n,)) for n in lengths]
    alone = [_greedy(model, p[None])[0, len(p):] for p in prompts]
    ffl_backend.optimize(model, max_batch_size=len(prompts), max_seq_len=max_seq_len, **FAST)
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    batch = _greedy(model, ids, attention_mask=mask, pad_token_id=0)[:, width:]
    for row, expected in enumerate(alone):
        assert torch.equal(batch[row], expected), f"row {row} (prompt {len(prompts[row])} tokens) differs"
    return prompts, alone


def test_left_padded_batch_matches_each_prompt_alone():
    model = tiny_model("llama")
    prompts, alone = _optimized_batch_matches_each_prompt_alone(model, (5, 9, 3, 12), max_seq_len=64)
    for p, expected in zip(prompts, alone):  # and batch 1 through the same optimized model
        assert torch.equal(_greedy(model, p[None])[0, len(p):], expected)


@pytest.mark.parametrize("kind", SLIDING_KINDS)
def test_sliding_window_models_match_eager_without_recompiles(kind, no_fallbacks):
    if kind.startswith("gemma2"):  # its final logit soft-capping, tanh(x / cap) * cap: a tanh no family fuses
        no_fallbacks.unfused_ok = ("tanh",)
    model = sliding_model(kind)
    ids = torch.randint(3, 128, (1, 9))  # 9 + 12 tokens: well past the window of 6
    expected = _greedy(model, ids)
    ffl_backend.optimize(model, max_seq_len=48, **FAST)
    before = _graph_count()
    assert torch.equal(_greedy(model, ids), expected)
    _greedy(model, torch.randint(3, 128, (1, 4)))  # another prompt length: the same decode graph
    # One decode graph for both calls. (Its `recompile` flag may be set: Dynamo counts compiles per
    # code object, and Module.__call__ is shared with the models of earlier tests.)
    assert _graph_count() - before == 1, [r.summary() for r in ffl_backend.fusion_reports()[before:]]
    _assert_window_sized(model, window=6, max_seq_len=48)


def _assert_window_sized(model, window, max_seq_len):
    """The decode loop's static caches hold `window` slots for sliding layers, the full length
    for the others, and kv_cache_bytes says the same."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    from ffl_backend.api import kv_cache_bytes

    loop = model.generate.__wrapped__
    kinds, _ = get_layer_types_and_kwargs(model.config)
    for cache in loop._caches.values():
        lengths = [layer.keys.shape[2] for layer in cache.layers]
        assert lengths == [window if k == "sliding_attention" else max_seq_len for k in kinds]
        batch = cache.layers[0].keys.shape[0]
        nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        assert nbytes == kv_cache_bytes(model.config, batch, max_seq_len, model.dtype)


@pytest.mark.parametrize("kind", ["gemma3", "gemma2_softcap"])
def test_sliding_window_left_padded_batch_matches_each_prompt_alone(kind, no_fallbacks):
    """Rolling window caches with left padding: prompts shorter and longer than the window."""
    if kind.startswith("gemma2"):
        no_fallbacks.unfused_ok = ("tanh",)
    model = sliding_model(kind)
    _optimized_batch_matches_each_prompt_alone(model, (3, 9, 14, 5), max_seq_len=40)
    _assert_window_sized(model, window=6, max_seq_len=40)


def test_limits_fail_before_any_work():
    model = ffl_backend.optimize(tiny_model("llama"), max_seq_len=32, **FAST)
    before = _graph_count()
    with pytest.raises(ValueError, match="max_seq_len=32"):
        model.generate(torch.randint(3, 128, (1, 10)), max_new_tokens=30)
    with pytest.raises(ValueError, match="max_batch_size=1"):
        model.generate(torch.randint(3, 128, (2, 4)), max_new_tokens=4)
    with pytest.raises(ValueError, match="unknown option"):
        ffl_backend.optimize(model, fuse_everything=True)
    assert _graph_count() == before


def test_restore_gives_the_model_back():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 6))
    expected = _greedy(model, ids)
    impl, cache = model.config._attn_implementation, model.generation_config.cache_implementation
    ffl_backend.optimize(model, **FAST)
    assert model.config._attn_implementation == "fastflow"
    restore(model)
    assert model.config._attn_implementation == impl
    assert model.generation_config.cache_implementation == cache
    assert "generate" not in model.__dict__
    assert torch.equal(_greedy(model, ids), expected)


def test_restore_puts_back_dynamo_settings_once_no_optimized_model_is_left(monkeypatch):
    import weakref

    import torch._dynamo.config as dynamo_config

    from ffl_backend import generation

    # Models optimized by earlier tests may still be alive: start from no holder, Dynamo's defaults.
    monkeypatch.setattr(generation, "_fast_guard_models", weakref.WeakSet())
    monkeypatch.setattr(generation, "_saved_dynamo_config", {})
    defaults = {"use_recursive_dict_tags_for_guards": False, "max_saved_pointers_for_recursive_dict_tags_check": 256}
    assert set(defaults) == set(generation.FAST_GUARD_CONFIG)

    def current():
        return {key: getattr(dynamo_config, key) for key in defaults}

    with dynamo_config.patch(defaults):
        first, second = tiny_model("llama"), tiny_model("llama", seed=1)
        ffl_backend.optimize(first, **FAST)
        ffl_backend.optimize(second, **FAST)
        restore(first)
        assert current() == generation.FAST_GUARD_CONFIG  # the second model still relies on them
        restore(second)
        assert current() == defaults


def test_model_compile_path_composes_with_optimize():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 7))
    expected = _greedy(model, ids)
    ffl_backend.optimize(model, max_seq_len=64, **FAST)
    model.compile(backend="fastflow", options=FAST)
    before = _graph_count()
    assert torch.equal(_greedy(model, ids), expected)
    assert _graph_count() > before  # the prefill forward went through fastflow too


def test_kv_cache_bytes():
    import transformers as T

    smol = T.LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)
    assert kv_cache_bytes(smol, 1, 2048, torch.bfloat16) == 2 * 30 * 3 * 64 * 2048 * 2
    assert kv_cache_bytes(smol, 4, 100, "float32") == 2 * 30 * 4 * 3 * 64 * 100 * 4
    qwen3 = T.Qwen3Config(num_key_value_heads=2, head_dim=16, **COMMON)  # head_dim != hidden / heads
    assert kv_cache_bytes(qwen3, 1, 10) == 2 * 2 * 2 * 16 * 10 * 4
    mistral = T.MistralConfig(num_key_value_heads=2, sliding_window=6, **COMMON)
    assert kv_cache_bytes(mistral, 1, 100) == 2 * 2 * 2 * 16 * 6 * 4
    assert kv_cache_bytes(mistral, 1, 100, cap_sliding=False) == 2 * 2 * 2 * 16 * 100 * 4
    gemma2 = T.Gemma2Config(num_key_value_heads=2, head_dim=32, sliding_window=6, **COMMON)
    assert kv_cache_bytes(gemma2, 1, 100) == 2 * 2 * 32 * (6 + 100) * 4  # one sliding, one full layer


def test_optimize_quant_goes_through_quantize():
    if not hasattr(ffl_backend, "quantize"):
        with pytest.raises(RuntimeError, match="ffl_backend.quantize"):
            ffl_backend.optimize(tiny_model("llama"), quant="int8")
        return
    ids = torch.randint(3, 128, (1, 5))
    expected = _greedy(ffl_backend.quantize(tiny_model("llama", dtype=torch.bfloat16), "int8"), ids)  # eager int8
    model = ffl_backend.optimize(tiny_model("llama", dtype=torch.bfloat16), quant="int8", max_seq_len=64, **FAST)
    assert len(ffl_backend.quant.quantizer.quantized_modules(model)) == 7 * model.config.num_hidden_layers
    before = _graph_count()
    assert _greedy(model, ids).tolist() == expected.tolist()
    (report,) = ffl_backend.fusion_reports()[before:]  # one decode graph, int8 linears in it
    assert report.ops["int8_linear"] == 7 * model.config.num_hidden_layers, report.summary()
