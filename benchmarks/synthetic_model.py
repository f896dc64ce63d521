"""A Hugging Face model folder with SmolLM2-135M's tokenizer and the architecture of a larger model
(a larger SmolLM2, or Qwen2-1.5B), filled with random weights (bf16): for measurements that depend on
sizes, not on what the weights say -- peak RSS and decode speed of larger models -- where no such
checkpoint is available offline. Its greedy text is meaningless; never use it for perplexity or agreement.

    python benchmarks/synthetic_model.py --arch smollm2-1.7b --out /tmp/smollm2-1.7b-random
    ffl-bench --model /tmp/smollm2-1.7b-random --backends fastflow --dtypes bfloat16 --quant none int8 ...
"""
from __future__ import annotations

import argparse
import shutil

# The published configurations' sizes (huggingface.co/HuggingFaceTB/SmolLM2-*/config.json,
# huggingface.co/Qwen/Qwen2-1.5B/config.json). The SmolLM2 ones keep everything else (tied embeddings,
# norms, activation) from SmolLM2-135M; the Qwen2 one is a Qwen2 (q/k/v biases) with SmolLM2-135M's
# vocabulary and special ids instead of Qwen2's 151936 tokens, so the copied tokenizer files fit.
ARCHITECTURES = {
    "smollm2-360m": {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                     "num_attention_heads": 15, "num_key_value_heads": 5},
    "smollm2-1.7b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "rope_theta": 130000},
    "qwen2-1.5b": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                   "num_attention_heads": 12, "num_key_value_heads": 2, "rope_theta": 1000000,
                   "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 32768},
}


def make_config(arch: str, base):
    """The configuration of `arch`, given SmolLM2-135M's folder (`base`)."""
    from transformers import AutoConfig, Qwen2Config

    config = AutoConfig.from_pretrained(base)
    sizes = dict(ARCHITECTURES[arch])
    if "rope_theta" in sizes:  # transformers 5 reads only rope_parameters; a rope_theta attribute is ignored
        sizes["rope_parameters"] = {"rope_type": "default", "rope_theta": float(sizes.pop("rope_theta"))}
    if sizes.pop("model_type", "llama") == "qwen2":
        # sizes go to the constructor: Qwen2Config derives layer_types from num_hidden_layers there
        ids = {key: getattr(config, key) for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
        config = Qwen2Config(**ids, **sizes)
    for key, value in sizes.items():
        setattr(config, key, value)
    config.head_dim = config.hidden_size // config.num_attention_heads  # 128 for Qwen2-1.5B, as published
    return config


def build(arch: str, out: str, seed: int = 0) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from ffl_backend.models import smollm2_path

    base = smollm2_path()
    config = make_config(arch, base)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # initialization zeroes biases; random ones are exercised like any weight
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.02)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (base / name).exists():
            shutil.copy(base / name, f"{out}/{name}")
    params = sum(p.numel() for p in model.parameters())
    print(f"{arch}: {params / 1e6:.0f}M parameters, random bf16 weights, saved to {out}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), default="smollm2-1.7b")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    build(args.arch, args.out, args.seed)


if __name__ == "__main__":
    main()
