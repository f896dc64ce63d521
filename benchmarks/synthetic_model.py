"""A Hugging Face model folder with SmolLM2-135M's tokenizer and the architecture of a larger
SmolLM2, filled with random weights (bf16): for measurements that depend on sizes, not on what the
weights say -- peak RSS and decode speed of larger models -- where no such checkpoint is available
offline. Its greedy text is meaningless; never use it for perplexity or agreement.

    python benchmarks/synthetic_model.py --arch smollm2-1.7b --out /tmp/smollm2-1.7b-random
    ffl-bench --model /tmp/smollm2-1.7b-random --backends fastflow --dtypes bfloat16 --quant none int8 ...
"""
from __future__ import annotations

import argparse
import shutil

# The published configurations' sizes (huggingface.co/HuggingFaceTB/SmolLM2-*/config.json); everything
# else (vocabulary, tied embeddings, norms, activation) is SmolLM2-135M's.
ARCHITECTURES = {
    "smollm2-360m": {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                     "num_attention_heads": 15, "num_key_value_heads": 5},
    "smollm2-1.7b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "rope_theta": 130000},
}


def build(arch: str, out: str, seed: int = 0) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ffl_backend.models import smollm2_path

    base = smollm2_path()
    config = AutoConfig.from_pretrained(base)
    for key, value in ARCHITECTURES[arch].items():
        setattr(config, key, value)
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
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
