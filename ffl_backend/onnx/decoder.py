"""The decoder as ONNX sees it: one forward for prompt and decode steps with the KV cache as plain
tensors in and out, under the names optimum and ONNX Runtime GenAI use.

Inputs: input_ids, attention_mask [batch, past + seq], position_ids, past_key_values.{i}.key/.value
[batch, kv_heads, past, head_dim]; outputs: logits, present.{i}.key/.value [batch, kv_heads,
past + seq, head_dim]. Every layer keeps its full length (no sliding-window crop), so all presents
grow alike; sliding windows are honoured by the attention mask the model's own code builds.
"""
from __future__ import annotations

import torch
from torch import nn

# Architectures whose HF forward exports with this wrapper (checked by tests/onnx on tiny models).
EXPORTABLE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2",
              "gpt_neox", "gemma3")


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def cache_geometry(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of the model's KV cache."""
    c = text_config(config)
    layers = getattr(c, "num_hidden_layers", None) or c.n_layer
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    hidden = getattr(c, "hidden_size", None) or c.n_embd
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    return layers, kv_heads, head_dim


def input_names(layers: int) -> list[str]:
    past = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past]


def output_names(layers: int) -> list[str]:
    return ["logits", *(f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value"))]


def unsupported(model) -> str | None:
    """One line saying why `model` cannot be exported, or None."""
    model_type = getattr(text_config(model.config), "model_type", None)
    if model_type not in EXPORTABLE:
        return (f"model_type {model_type!r} is not among the exportable architectures "
                f"({', '.join(EXPORTABLE)})")
    if getattr(model, "_fastflow_state", None) is not None:
        return "the model is optimize()d: export before optimize() or call ffl_backend.restore(model) first"
    return None


class KVDecoder(nn.Module):
    """`model` behind the ONNX signature; its forward runs the model's own eager code."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.layers = cache_geometry(model.config)[0]

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache()  # full-length layers only: see the module docstring
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        present = []
        for layer in out.past_key_values.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def example_inputs(model, batch: int = 2, seq: int = 3, past: int = 5) -> tuple:
    """Tracing inputs; sizes distinct so that no dimension is mistaken for another."""
    layers, kv_heads, head_dim = cache_geometry(model.config)
    dtype = next(model.parameters()).dtype
    vocab = text_config(model.config).vocab_size
    ids = torch.randint(0, vocab, (batch, seq))
    mask = torch.ones(batch, past + seq, dtype=torch.long)
    positions = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    kv = [torch.zeros(batch, kv_heads, past, head_dim, dtype=dtype) for _ in range(2 * layers)]
    return (ids, mask, positions, *kv)


def dynamic_shapes(layers: int) -> dict:
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence_length")
    past, total = torch.export.Dim("past_sequence_length"), torch.export.Dim("total_sequence_length")
    return {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: total},
            "position_ids": {0: batch, 1: seq}, "past": tuple({0: batch, 2: past} for _ in range(2 * layers))}
