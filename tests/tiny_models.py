"""Tiny random-weight configs of every supported architecture (no real weights exist here for
most of them; these exercise structure, pattern matching and numerics against eager)."""
from __future__ import annotations

import torch

LAYERS = 2
VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
              intermediate_size=96, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)


def tiny_config(arch: str):
    import transformers as T

    if arch == "llama":
        return T.LlamaConfig(num_key_value_heads=2, **COMMON)
    if arch == "mistral":
        return T.MistralConfig(num_key_value_heads=2, sliding_window=None, **COMMON)
    if arch == "qwen2":
        return T.Qwen2Config(num_key_value_heads=2, **COMMON)
    if arch == "qwen3":
        return T.Qwen3Config(num_key_value_heads=2, head_dim=16, **COMMON)
    if arch == "gemma":
        return T.GemmaConfig(num_key_value_heads=2, head_dim=16, **COMMON)
    if arch == "phi3":
        return T.Phi3Config(num_key_value_heads=2, partial_rotary_factor=0.5, **COMMON)
    if arch == "gpt2":
        return T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=256,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "gpt_neox":
        return T.GPTNeoXConfig(rotary_pct=0.25, **COMMON)
    raise ValueError(arch)


ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "gpt_neox")


def tiny_model(arch: str, dtype=torch.float32, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return perturb_vectors(AutoModelForCausalLM.from_config(tiny_config(arch), dtype=dtype).eval())


def perturb_vectors(model, scale: float = 0.1):
    """Random init leaves norm weights at exactly 1 (and Gemma's at 0); add noise to every 1-D
    parameter so a wrong cast order or a dropped weight would show in the logits. Returns model."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * scale)
    return model



SLIDING_KINDS = ("mistral", "gemma2", "gemma2_softcap", "gemma3")


def sliding_model(kind: str, window: int = 6, seed: int = 0):
    """A tiny model with sliding-window layers: Mistral (every layer sliding), Gemma-2 (sliding and
    full layers alternate; "_softcap" adds its attention and final logit soft-capping), Gemma-3
    (five sliding layers per global one, QK-norm, one KV head), 1-D weights perturbed."""
    import transformers as T

    torch.manual_seed(seed)
    small = dict(COMMON, num_key_value_heads=2)
    if kind == "mistral":
        config = T.MistralConfig(sliding_window=window, **small)
    elif kind.startswith("gemma2"):
        capped = kind == "gemma2_softcap"
        config = T.Gemma2Config(head_dim=16, sliding_window=window, query_pre_attn_scalar=16,
                                attn_logit_softcapping=5.0 if capped else None,
                                final_logit_softcapping=3.0 if capped else None, **small)
    elif kind == "gemma3":
        config = T.Gemma3TextConfig(**dict(small, num_hidden_layers=6, num_key_value_heads=1), head_dim=16,
                                    query_pre_attn_scalar=16, sliding_window=window)
    else:
        raise ValueError(kind)
    return perturb_vectors(T.AutoModelForCausalLM.from_config(config).eval())

def save_tiny_folder(folder, arch: str = "llama"):
    """A tiny random model with a word-level tokenizer over the benchmark's default text, saved as a
    Hugging Face folder (no download): what `ffl-bench --model` and `ffl-serve --model` load."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ffl_backend.bench.session import DEFAULT_TEXT

    words = ["<pad>", "<s>", "</s>", "<unk>"] + sorted(set(DEFAULT_TEXT.split()))
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    tiny_model(arch).save_pretrained(folder)  # vocab 128 > the words above; 256 positions
    return folder
