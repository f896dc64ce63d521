"""ffl-bench's llamacpp rows: the GGUF writer (names, types, shapes, the Q/K row order; LLaMA, Qwen2, Gemma-3),
llama.cpp's greedy tokens against HF eager, the one-line skip without llama-cpp-python, and the rows end to end."""
import copy
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ffl_backend.bench import gguf_export, llamacpp
from tests.tiny_models import perturb_vectors

SEED, INIT = 22, 0.3  # a tiny model whose greedy logits keep their top two apart (checked where it matters)
QWEN2_SEED = 29  # the same for the tiny Qwen2
LLAMA3_SEED = 28  # the same for the tiny LLaMA with Llama-3 RoPE scaling
# Llama-3 RoPE scaling over a 16-position original context (head_dim 16: wavelengths 6.3, 20, 63, ...): one
# frequency kept (wavelength < 16 / 2), one smoothed, six divided by 8 (wavelength > 16 / 0.5); the prompt
# and its 16 new tokens run to position 31, twice the original context.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 0.5,
               "high_freq_factor": 2.0, "original_max_position_embeddings": 16}
PROMPT = list(range(3, 19))
NEW = 16
HAVE_LLAMA_CPP = llamacpp.import_error() is None
needs_llama_cpp = pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed")


def _bpe_tokenizer(folder):
    """A byte-level BPE tokenizer (llama.cpp's gpt2 vocabulary) of ~100 tokens, trained on the prompt text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ffl_backend.bench.session import DEFAULT_TEXT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([DEFAULT_TEXT], trainers.BpeTrainer(vocab_size=100, show_progress=False,
                                                                special_tokens=["<pad>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


def _tiny_saved(folder, config_cls, seed: int, tied: bool, **extra):
    """A tiny random model of `config_cls` (config keywords `extra` on top), fp32, saved with a BPE
    tokenizer; weights at std INIT (not 0.02) so the logits spread and greedy decoding moves between
    tokens; norms and biases (Qwen2's q/k/v, zero at init) perturbed so a dropped or misplaced one shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = config_cls(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
                        initializer_range=INIT, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
                        pad_token_id=0, **extra)
    model = perturb_vectors(AutoModelForCausalLM.from_config(config).eval(), 0.1)
    model.save_pretrained(folder)
    _bpe_tokenizer(folder)
    return model


def _tiny_llama(folder, tied: bool):
    from transformers import LlamaConfig

    return _tiny_saved(folder, LlamaConfig, SEED, tied)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tied")
    return folder, _tiny_llama(folder, tied=True)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    folder = tmp_path_factory.mktemp("untied")
    return folder, _tiny_llama(folder, tied=False)


def _tiny_llama3(folder):
    """Tied, as Llama-3.2-1B/3B, with Llama-3 RoPE scaling (LLAMA3_ROPE)."""
    from transformers import LlamaConfig

    return _tiny_saved(folder, LlamaConfig, LLAMA3_SEED, tied=True, rope_parameters=dict(LLAMA3_ROPE))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama3")
    return folder, _tiny_llama3(folder)


def _tiny_qwen2(folder):
    """Tied embeddings, as Qwen2-1.5B."""
    from transformers import Qwen2Config

    return _tiny_saved(folder, Qwen2Config, QWEN2_SEED, tied=True)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    return folder, _tiny_qwen2(folder)


def _reader(path):
    import gguf

    reader = gguf.GGUFReader(path)
    return reader, {t.name: t for t in reader.tensors}


def _field(reader, key):
    field = reader.fields[key]
    return field.contents()


def _assert_tiny_header(reader, arch: str, kind: str) -> None:
    """The metadata every tiny model's file carries: architecture, file type, shapes, rope, special ids."""
    import gguf

    assert _field(reader, "general.architecture") == arch
    assert _field(reader, "general.file_type") == gguf.LlamaFileType[f"MOSTLY_{kind}"]
    sizes = {"embedding_length": 64, "block_count": 2, "attention.head_count": 4, "attention.head_count_kv": 2,
             "feed_forward_length": 96, "context_length": 256, "rope.dimension_count": 16}
    expected = {**{f"{arch}.{k}": v for k, v in sizes.items()},
                "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    assert {k: _field(reader, k) for k in expected} == expected
    assert _field(reader, f"{arch}.rope.freq_base") == pytest.approx(10000.0)


def _weight(tensors, name):
    """A tensor of the file as float numbers, in HF's (out_features, in_features) order."""
    import gguf

    t = tensors[name]
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))


def test_rotary_row_order_turns_rotate_half_into_adjacent_pairs():
    """RoPE the HF way (dimension i with i + d/2) then reorder == reorder then RoPE the llama.cpp way
    (dimension 2i with 2i+1): so q.k, and attention, are the same after the export's reordering."""
    heads, d, pos = 3, 8, 5.0
    freqs = 10000.0 ** (-np.arange(d // 2) * 2 / d)
    cos, sin = np.cos(pos * freqs), np.sin(pos * freqs)
    q = np.random.default_rng(0).standard_normal((heads, d))

    x1, x2 = q[:, : d // 2], q[:, d // 2:]
    hf = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1)
    order = gguf_export.rotary_row_order(heads, d)
    p = q.reshape(-1)[order].reshape(heads, d)
    ours = np.empty_like(p)
    ours[:, 0::2] = p[:, 0::2] * cos - p[:, 1::2] * sin
    ours[:, 1::2] = p[:, 1::2] * cos + p[:, 0::2] * sin
    np.testing.assert_allclose(hf.reshape(-1)[order].reshape(heads, d), ours, atol=1e-12)


@pytest.mark.parametrize("kind", gguf_export.GGUF_TYPES)
def test_writer_names_types_shapes_and_metadata(tied, untied, tmp_path, kind):
    import gguf

    layers = {f"blk.{i}.{n}.weight" for i in range(2) for n in ("attn_norm", "attn_q", "attn_k", "attn_v",
                                                                  "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                                                                  "ffn_down")}
    for (folder, model), head in ((tied, set()), (untied, {"output.weight"})):
        reader, tensors = _reader(gguf_export.export(folder, kind, tmp_path))
        assert set(tensors) == {"token_embd.weight", "output_norm.weight"} | layers | head
        hf = {gguf_export.gguf_name(n): p for n, p in model.state_dict().items()}
        for name, t in tensors.items():
            # GGUF lists dimensions innermost first: (in_features, out_features) for a linear.
            assert tuple(t.shape) == tuple(reversed(hf[name].shape)), name
            want = gguf_export.tensor_type(name, tuple(hf[name].shape), kind)
            assert t.tensor_type.name == want, name
        assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
        assert tensors["blk.0.ffn_down.weight"].tensor_type.name == kind
        embd = "Q8_0" if kind == "Q4_0" else kind  # Q4_0 files keep embedding and head at Q8_0
        assert tensors["token_embd.weight"].tensor_type.name == embd
        assert tensors.get("output.weight", tensors["token_embd.weight"]).tensor_type.name == embd

    _assert_tiny_header(reader, "llama", kind)
    assert _field(reader, "tokenizer.ggml.model") == "gpt2" and _field(reader, "tokenizer.ggml.pre") == "gpt-2"
    tokens, types = _field(reader, "tokenizer.ggml.tokens"), _field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == 128 and tokens[1] == "<s>" and tokens[127] == "[PAD127]"
    assert types[1] == gguf.TokenType.CONTROL and types[127] == gguf.TokenType.UNUSED
    assert len(_field(reader, "tokenizer.ggml.merges")) > 0


def test_tensor_types_follow_llama_quantize():
    kind = gguf_export.tensor_type
    assert kind("blk.0.attn_norm.weight", (64,), "Q4_0") == "F32"
    assert kind("blk.0.attn_q.weight", (64, 64), "Q4_0") == "Q4_0"
    assert kind("token_embd.weight", (128, 64), "Q4_0") == kind("output.weight", (128, 64), "Q4_0") == "Q8_0"
    assert kind("token_embd.weight", (128, 64), "Q8_0") == "Q8_0"
    assert kind("blk.0.ffn_down.weight", (64, 100), "Q4_0") == "F16"  # rows not in whole 32-value blocks


def test_f16_weights_are_the_hf_weights_with_q_and_k_rows_reordered(untied, tmp_path):
    folder, model = untied
    _, tensors = _reader(gguf_export.export(folder, "F16", tmp_path))
    sd = {k: v.numpy() for k, v in model.state_dict().items()}

    def weight(name):
        return _weight(tensors, name)

    q_order, k_order = gguf_export.rotary_row_order(4, 16), gguf_export.rotary_row_order(2, 16)
    close = dict(rtol=1e-3, atol=1e-3)  # f16 rounding
    np.testing.assert_allclose(weight("blk.1.attn_q.weight"), sd["model.layers.1.self_attn.q_proj.weight"][q_order],
                               **close)
    np.testing.assert_allclose(weight("blk.1.attn_k.weight"), sd["model.layers.1.self_attn.k_proj.weight"][k_order],
                               **close)
    assert not np.allclose(weight("blk.1.attn_q.weight"), sd["model.layers.1.self_attn.q_proj.weight"], **close)
    for ours, theirs in (("blk.1.attn_v.weight", "model.layers.1.self_attn.v_proj.weight"),
                         ("output.weight", "lm_head.weight"), ("blk.0.ffn_norm.weight",
                                                               "model.layers.0.post_attention_layernorm.weight")):
        np.testing.assert_allclose(weight(ours), sd[theirs], **close)


@pytest.mark.parametrize("kind", gguf_export.GGUF_TYPES)
def test_qwen2_writer_names_biases_and_metadata(qwen2, tmp_path, kind):
    """Qwen2: LLaMA's names plus the q/k/v biases (F32, exact), no output head (tied), qwen2 metadata;
    Q/K rows keep HF's order (llama.cpp's qwen2 rotates halves, as HF does)."""

    folder, model = qwen2
    reader, tensors = _reader(gguf_export.export(folder, kind, tmp_path))
    layer = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
    biases = {f"blk.{i}.{n}.bias" for i in range(2) for n in ("attn_q", "attn_k", "attn_v")}
    assert set(tensors) == ({"token_embd.weight", "output_norm.weight"} | biases
                            | {f"blk.{i}.{n}.weight" for i in range(2) for n in layer})
    hf = {gguf_export.gguf_name(n, "qwen2"): p.numpy() for n, p in model.state_dict().items()}
    for name, t in tensors.items():
        assert tuple(t.shape) == tuple(reversed(hf[name].shape)), name
        assert t.tensor_type.name == gguf_export.tensor_type(name, hf[name].shape, kind), name
    for name in biases:
        assert tensors[name].tensor_type.name == "F32"
        np.testing.assert_array_equal(np.asarray(tensors[name].data), hf[name])
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == kind
    if kind == "F16":
        for name in ("blk.1.attn_q.weight", "blk.1.attn_k.weight"):
            np.testing.assert_allclose(_weight(tensors, name), hf[name], rtol=1e-3, atol=1e-3)

    _assert_tiny_header(reader, "qwen2", kind)
    assert _field(reader, "qwen2.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)


def test_qwen2_biases_change_the_greedy_tokens(qwen2):
    """So the greedy comparison below would catch a dropped bias."""
    _, model = qwen2
    unbiased = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in unbiased.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
    assert _hf_greedy(unbiased)[0] != _hf_greedy(model)[0]


def test_cache_is_keyed_by_weights_and_type_and_never_half_written(tied, tmp_path, monkeypatch):
    folder, _ = tied
    first = gguf_export.export(folder, "Q8_0", tmp_path)
    assert first.parent == tmp_path / "gguf" and first.name.startswith(f"{folder.name}-Q8_0-")
    stamp = first.stat().st_mtime_ns
    assert gguf_export.export(folder, "Q8_0", tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert gguf_export.cached_path(folder, "Q4_0", tmp_path) != first
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert gguf_export.cached_path(folder, "Q8_0", tmp_path) != first

    def fail(folder, kind, path):
        open(path, "wb").write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_export, "write_gguf", fail)
    with pytest.raises(KeyboardInterrupt):
        gguf_export.export(folder, "F16", tmp_path)
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == [first.name]


def test_other_architectures_are_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'llama', 'qwen2' and 'gemma3_text' only, not 'gpt2'"):
        gguf_export.write_gguf(tmp_path, "F16", tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_qwen2_layouts_llama_cpp_lacks_are_refused(qwen2, tmp_path):
    """Qwen2's q/k/v biases pass; a sliding window, another head_dim (llama.cpp's qwen2 shapes Q as
    hidden x hidden) and LLaMA biases do not."""
    folder, _ = qwen2
    assert gguf_export.unsupported(folder) is None
    (tmp_path / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    for change, reason in (({"use_sliding_window": True}, "no sliding-window"),
                           ({"layer_types": ["full_attention", "sliding_attention"]}, "no sliding-window"),
                           ({"head_dim": 32}, "head_dim * num_attention_heads"),
                           ({"model_type": "llama", "attention_bias": True}, "no bias tensors")):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        assert reason in gguf_export.unsupported(tmp_path), change


def _plain_rope_inv_freq(head_dim: int = 16, theta: float = 10000.0):
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


@pytest.mark.parametrize("kind", gguf_export.GGUF_TYPES)
def test_llama3_rope_scaling_is_written_as_rope_freqs(llama3, tmp_path, kind):
    """Llama-3 RoPE scaling: a rope_freqs.weight tensor (F32, head_dim / 2) by which llama.cpp divides each
    rotary frequency, equal to HF's plain / scaled inverse frequencies: 1 kept, 1 smoothed, 6 divided by
    the factor. No other tensor or shape changes."""
    folder, model = llama3
    assert gguf_export.unsupported(folder) is None
    reader, tensors = _reader(gguf_export.export(folder, kind, tmp_path))
    freqs = tensors["rope_freqs.weight"]
    assert freqs.tensor_type.name == "F32" and tuple(freqs.shape) == (8,)
    want = (_plain_rope_inv_freq() / model.model.rotary_emb.inv_freq.double()).numpy()
    np.testing.assert_allclose(np.asarray(freqs.data), want, rtol=1e-6)
    assert want[0] == 1.0 and 1.0 < want[1] < 8.0 and np.allclose(want[2:], 8.0)
    hf = {gguf_export.gguf_name(n): p for n, p in model.state_dict().items()}
    assert set(tensors) - {"rope_freqs.weight"} == set(hf) - {"output.weight"}  # tied: no output head
    _assert_tiny_header(reader, "llama", kind)


def test_llama3_rope_factors_follow_hf_at_llama_3_2_scale():
    """Llama-3.2's own parameters (theta 500000, factor 32, 8192 original positions, head_dim 128)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(vocab_size=32, hidden_size=512, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=8, max_position_embeddings=131072, rope_parameters=dict(rope))
    scaled = LlamaForCausalLM(config).model.rotary_emb.inv_freq.double()
    factors = gguf_export.llama3_rope_factors(rope, 128)
    assert factors.dtype == np.float32 and factors.shape == (64,)
    np.testing.assert_allclose(factors, (_plain_rope_inv_freq(128, 500000.0) / scaled).numpy(), rtol=1e-6)


def test_other_rope_scalings_are_refused(llama3, qwen2, tmp_path):
    """Llama-3 scaling for LLaMA only (llama.cpp's qwen2 reads no rope_freqs); linear / YaRN / partial
    rotary not at all."""
    for (folder, _), change, reason in (
            (llama3, {"rope_type": "linear", "factor": 2.0}, "plain RoPE"),
            (llama3, {"rope_type": "yarn"}, "plain RoPE"),
            (llama3, {"partial_rotary_factor": 0.5}, "whole heads"),
            (qwen2, LLAMA3_ROPE, "plain RoPE")):
        (tmp_path / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
        config = json.loads((folder / "config.json").read_text())
        rope = {**config["rope_parameters"], **change}
        (tmp_path / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
        assert reason in gguf_export.unsupported(tmp_path), change


def test_llama3_rope_scaling_changes_the_greedy_tokens(llama3):
    """So the greedy comparison below would catch a missing or wrong rope_freqs tensor."""
    _, model = llama3
    plain = copy.deepcopy(model)
    with torch.no_grad():
        plain.model.rotary_emb.inv_freq.copy_(_plain_rope_inv_freq())
    ref, plain_tokens = _hf_greedy(model)[0], _hf_greedy(plain)[0]
    assert sum(a == b for a, b in zip(ref, plain_tokens)) <= 2, (ref, plain_tokens)


def _tiny_gemma3(folder):
    """A tiny random Gemma-3: six layers (the sixth global), a window of 8 that a 16-token prompt
    overruns, one KV head, q/k norms, every norm perturbed (they are written as 1 + w)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    torch.manual_seed(SEED)
    config = Gemma3TextConfig(vocab_size=128, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                              num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, intermediate_size=96,
                              sliding_window=8, max_position_embeddings=256, initializer_range=INIT,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = perturb_vectors(AutoModelForCausalLM.from_config(config).eval(), 0.3)
    model.save_pretrained(folder)
    _bpe_tokenizer(folder)
    return model


def test_gemma3_names_norms_and_window(tmp_path):
    """Gemma-3's extra norms get llama.cpp's names and 1 + w, Q/K rows keep their order, the window is
    in the metadata; a layout llama.cpp hard-codes otherwise is refused."""
    folder = tmp_path / "gemma3"
    model = _tiny_gemma3(folder)
    gguf_export.write_gguf(folder, "F16", tmp_path / "g.gguf")
    reader, tensors = _reader(tmp_path / "g.gguf")
    assert _field(reader, "general.architecture") == "gemma3" and _field(reader, "gemma3.attention.sliding_window") == 8
    state = model.state_dict()
    for hf, ours in (("self_attn.q_norm", "attn_q_norm"), ("post_feedforward_layernorm", "post_ffw_norm"),
                     ("pre_feedforward_layernorm", "ffn_norm"), ("post_attention_layernorm", "post_attention_norm")):
        np.testing.assert_allclose(np.asarray(tensors[f"blk.3.{ours}.weight"].data),
                                   state[f"model.layers.3.{hf}.weight"].numpy() + 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(tensors["blk.0.attn_q.weight"].data, dtype=np.float32),
                               state["model.layers.0.self_attn.q_proj.weight"].numpy(), rtol=1e-3, atol=1e-3)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config,
                                                    "layer_types": ["sliding_attention", "full_attention"] * 3}))
    assert "every sixth layer global" in gguf_export.unsupported(folder)


@needs_llama_cpp
def test_llama_cpp_gemma3_greedy_tokens_follow_hf_eager(tmp_path):
    """Past the sliding window, with GQA to one KV head: F16 tokens equal HF fp32 eager's."""
    folder = tmp_path / "gemma3"
    model = _tiny_gemma3(folder)
    ref, margin = _hf_greedy(model)
    assert margin > 0.05, "near-tied logits: choose another SEED"
    _, ctx, n_vocab = llamacpp.load(str(gguf_export.export(folder, "F16", tmp_path)), 2, 64)
    assert llamacpp.time_generate(ctx, PROMPT, NEW, n_vocab)["tokens"] == ref


def _hf_greedy(model):
    """HF eager fp32 greedy tokens, and the smallest gap between the top two logits (in logit stds)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        logits = model(out).logits[0, len(PROMPT) - 1:-1]
    top = logits.topk(2).values
    return out[0, len(PROMPT):].tolist(), ((top[:, 0] - top[:, 1]) / logits.std(-1)).min().item()


@needs_llama_cpp
@pytest.mark.parametrize("fixture", ["tied", "qwen2", "llama3"])
def test_llama_cpp_greedy_tokens_follow_hf_eager(fixture, request, tmp_path):
    """F16: every token equal. Q8_0: fed eager's tokens (so one early difference cannot carry
    forward), its next-token choice agrees at most positions. Q4_0 runs."""
    folder, model = request.getfixturevalue(fixture)
    ref, margin = _hf_greedy(model)
    assert margin > 0.05, "near-tied logits: choose another SEED"
    assert len(set(ref)) > NEW // 2  # greedy decoding moves between tokens

    def run(kind):
        _, ctx, n_vocab = llamacpp.load(str(gguf_export.export(folder, kind, tmp_path)), 2, 64)
        free = llamacpp.time_generate(ctx, PROMPT, NEW, n_vocab)
        llamacpp.time_generate(ctx, PROMPT, 1, n_vocab)  # clears the cache: teacher forcing starts afresh
        forced = [llamacpp._next_token(ctx, [t], n_vocab) for t in ref[:-1]]
        return free, [free["tokens"][0]] + forced

    f16, _ = run("F16")
    assert f16["tokens"] == ref and f16["decode_tok_s"] > 0 and 0 < f16["ttft_s"] <= f16["generate_s"]
    _, q8 = run("Q8_0")
    assert sum(a == b for a, b in zip(q8, ref)) >= 12, (q8, ref)
    q4, _ = run("Q4_0")
    assert len(q4["tokens"]) == NEW and all(0 <= t < 128 for t in q4["tokens"])


@needs_llama_cpp
def test_grid_maps_and_skips_llamacpp_rows(tied):
    from ffl_backend.bench.grid import configurations, label, speedups

    folder, _ = tied
    todo, skipped = configurations(str(folder), ["llamacpp"], ["float32", "bfloat16"],
                                   ["none", "int8", "int4-all", "w8a8"], [1, 2], [16])
    assert sorted(label(c) for c in todo) == ["bfloat16 int4-all llamacpp(Q4_0) b1 p16",
                                              "bfloat16 int8 llamacpp(Q8_0) b1 p16", "bfloat16 llamacpp(F16) b1 p16"]
    reasons = {label(s): s["reason"] for s in skipped}
    assert "F16" in reasons["float32 llamacpp b1 p16"]
    assert reasons["bfloat16 w8a8 llamacpp b1 p16"].startswith("no GGUF type for w8a8")
    assert reasons["bfloat16 llamacpp(F16) b2 p16"] == "llamacpp rows time one sequence (batch 1)"

    # the paired ratio against unquantized Inductor of the same group, round by round
    rows = [{"backend": "inductor", "quant": "none", "dtype": "bfloat16", "batch": 1, "prompt_len": 16,
             "decode_tok_s": 10.0, "decode_tok_s_all": [10.0, 20.0]},
            {"backend": "llamacpp", "quant": "int8", "dtype": "bfloat16", "batch": 1, "prompt_len": 16,
             "decode_tok_s": 25.0, "decode_tok_s_all": [20.0, 30.0]}]
    speedups(rows, paired=True)
    assert rows[1]["speedup_vs_inductor_paired"] == pytest.approx(1.75)


def test_without_llama_cpp_the_rows_are_skipped_in_one_line(tied, monkeypatch, capsys):
    from ffl_backend.bench import cli
    from ffl_backend.bench.grid import configurations

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    folder, _ = tied
    todo, skipped = configurations(str(folder), ["eager", "llamacpp"], ["float32", "bfloat16"], ["none", "int8"],
                                   [1], [16])
    assert {c["backend"] for c in todo} == {"eager"}
    assert {s["reason"] for s in skipped if s["backend"] == "llamacpp"} == {llamacpp.MISSING}
    assert "pip install llama-cpp-python" in llamacpp.MISSING and "GGML_NATIVE=ON" in llamacpp.MISSING

    assert cli.main(["--model", str(folder), "--backends", "llamacpp", "--dtypes", "bfloat16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ffl-bench: error: ") and llamacpp.MISSING in err[0]
    assert cli.build_parser().parse_args([]).backends == ["eager", "inductor", "fastflow"]


def _bench(*args, cache, pythonpath=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # workers run real code paths
    env["FFL_CACHE_DIR"] = str(cache)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "ffl_backend.bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_eager_rows_run_when_llama_cpp_is_missing(tied, tmp_path):
    """A llama_cpp that fails to import (a stand-in module first on the path): one line, eager runs."""
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "llama_cpp.py").write_text("raise ImportError('no llama_cpp here')\n")
    folder, _ = tied
    proc = _bench("--model", str(folder), "--backends", "eager", "llamacpp", "--dtypes", "bfloat16",
                  "--new-tokens", "2", "--repeats", "1", "--prompt-lens", "4", "--no-progress",
                  "--out", str(tmp_path / "r"), cache=tmp_path, pythonpath=tmp_path / "shadow")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "llama-cpp-python" in line]
    assert len(lines) == 1 and "bfloat16 llamacpp(F16) b1 p4" in lines[0] and llamacpp.MISSING in lines[0]
    grid = json.loads((tmp_path / "r.json").read_text())
    assert [r["backend"] for r in grid["results"]] == ["eager"] and "llama_cpp" not in grid["environment"]


@needs_llama_cpp
@pytest.mark.slow
def test_llamacpp_rows_end_to_end(tied, tmp_path):
    folder, _ = tied
    out = tmp_path / "res"
    proc = _bench("--model", str(folder), "--backends", "eager", "llamacpp", "--dtypes", "bfloat16", "--quant",
                  "none", "int8", "--new-tokens", "4", "--repeats", "1", "--threads", "1", "--no-progress",
                  "--out", str(out), cache=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grid = json.loads(out.with_suffix(".json").read_text())
    rows = {r["backend"] + r["quant"]: r for r in grid["results"]}
    assert set(rows) == {"eagernone", "eagerint8", "llamacppnone", "llamacppint8"}
    for key, kind in (("llamacppnone", "F16"), ("llamacppint8", "Q8_0")):
        r = rows[key]
        assert "error" not in r and r["gguf_type"] == kind and r["threads"] == 1
        assert math.isfinite(r["decode_tok_s"]) and r["decode_tok_s"] > 0 and r["ttft_s"] > 0
        assert len(r["tokens"]) == 4 and len(r["prompt_ids"]) == 16
        assert r["compile_cold_s"] == 0.0 and r["compile_warm_s"] is None and r["recompiles"] == 0
        assert 0 < r["runtime_rss_mb"] < r["peak_rss_mb"] and r["weight_bytes"] > 0
        assert "matching_prefix" in r and len(r["decode_tok_s_all"]) == 1
        assert f"bfloat16{' int8' if kind == 'Q8_0' else ''} llamacpp({kind}) b1 p16" in proc.stdout
    # the worker held llama.cpp alone: no torch in its runtime
    assert rows["llamacppnone"]["runtime_rss_mb"] < rows["eagernone"]["runtime_rss_mb"]
    info = grid["environment"]["llama_cpp"]
    assert info["llama_cpp_python"] and "CPU" in info["system_info"]
    import llama_cpp
    assert info["path"] == os.path.dirname(os.path.abspath(llama_cpp.__file__))  # which build ran
    assert "*llamacpp* rows" in out.with_suffix(".md").read_text()
    assert "gguf_type" in out.with_suffix(".csv").read_text().splitlines()[0]


@needs_llama_cpp
@pytest.mark.slow
def test_gemma3_f16_file_decodes_like_fp32_eager(tmp_path):
    """The second real model: llama.cpp on the F16 file written from Gemma-3-270M's bf16 folder gives
    fp32 eager's 16 greedy tokens (prompt of 16 from the bundled text)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ffl_backend.bench.session import prompt_ids
    from ffl_backend.models import gemma3_path

    folder = gemma3_path()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = prompt_ids(tok, 16, os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                                           "prideprejudice.txt"))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)[0, 16:].tolist()
    _, ctx, n_vocab = llamacpp.load(str(gguf_export.export(folder, "F16", tmp_path)), 2, 40)
    assert llamacpp.time_generate(ctx, ids[0].tolist(), 16, n_vocab)["tokens"] == ref


@needs_llama_cpp
@pytest.mark.slow
def test_smollm2_f16_file_tokenizes_and_decodes_like_bf16_eager(tmp_path):
    """The real model: llama.cpp's tokenizer, from the written vocabulary, splits text as the HF
    tokenizer does; and its F16 greedy tokens follow bf16 eager's (21 of 24 leading tokens here, then
    a near-tie that bf16 and f16 arithmetic break differently)."""

    import llama_cpp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ffl_backend.bench.session import DEFAULT_TEXT, prompt_ids
    from ffl_backend.models import smollm2_path

    folder = smollm2_path()
    path = str(gguf_export.export(folder, "F16", tmp_path))
    tok = AutoTokenizer.from_pretrained(folder)

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    vocab = llama_cpp.llama_model_get_vocab(llama_cpp.llama_model_load_from_file(path.encode(), params))
    text = (DEFAULT_TEXT + " 12345 Ünïcode ☃ <|im_start|>").encode()
    out = (llama_cpp.llama_token * 256)()
    n = llama_cpp.llama_tokenize(vocab, text, len(text), out, len(out), False, True)
    assert list(out[:n]) == tok(text.decode()).input_ids

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ids = prompt_ids(tok, 16)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)[0, 16:].tolist()
    _, ctx, n_vocab = llamacpp.load(path, 2, 40)
    got = llamacpp.time_generate(ctx, ids[0].tolist(), 24, n_vocab)["tokens"]
    prefix = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
    assert prefix >= 12, (tok.decode(got), tok.decode(ref))
