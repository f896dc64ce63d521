"""`genai_config.json`: what ONNX Runtime GenAI (0.18) needs to load an exported folder unchanged.

The decoder's present is past + new tokens (no shared fixed buffer), so `past_present_share_buffer`
must be false; GenAI refuses unknown keys, so only its own fields are written.
"""
from __future__ import annotations

import json
from pathlib import Path

from . import decoder

# GenAI's C++ model class by HF model_type; types it lacks run its generic decoder path.
GENAI_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
               "gemma2": "gemma2", "gemma3_text": "gemma3_text", "gemma3": "gemma3_text", "phi3": "phi3"}


def genai_config(config, max_seq_len: int | None = None) -> dict:
    text = decoder.text_config(config)
    layers, kv_heads, head_dim = decoder.cache_geometry(config)
    context = max_seq_len or getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", 2048)
    heads = getattr(text, "num_attention_heads", None) or text.n_head
    model = {
        "type": GENAI_TYPES.get(text.model_type, "decoder"),
        "context_length": int(context),
        "vocab_size": int(text.vocab_size),
        **_special_ids(config, text),
        "decoder": {
            "filename": "model.onnx",
            "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
            "head_size": head_dim,
            "hidden_size": getattr(text, "hidden_size", None) or text.n_embd,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "num_hidden_layers": layers,
            "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                       "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
            "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                        "present_value_names": "present.%d.value"},
        },
    }
    search = {"do_sample": False, "max_length": int(context), "min_length": 0, "num_beams": 1,
              "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
              "temperature": 1.0, "top_k": 1, "top_p": 1.0}
    return {"model": model, "search": search}


def _special_ids(config, text) -> dict:
    ids = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(text, key, None)
        if value is None:
            value = getattr(config, key, None)
        if value is not None:
            ids[key] = list(value) if key == "eos_token_id" and isinstance(value, (list, tuple)) else value
    if "eos_token_id" in ids and not isinstance(ids["eos_token_id"], list):
        ids["eos_token_id"] = [ids["eos_token_id"]]
    if "pad_token_id" not in ids and "eos_token_id" in ids:
        ids["pad_token_id"] = ids["eos_token_id"][0]
    return ids


def write_genai_config(config, out: Path, max_seq_len: int | None = None) -> Path:
    path = Path(out) / "genai_config.json"
    path.write_text(json.dumps(genai_config(config, max_seq_len), indent=2) + "\n")
    return path
