"""A Hugging Face model folder with SmolLM2-135M's tokenizer and the architecture of a larger model
(a larger SmolLM2, Qwen2-1.5B, Llama-3.2-3B or Llama-3.1-8B), filled with random weights (bf16): for
measurements that depend on sizes, not on what the weights say -- peak RSS and decode speed of larger
models -- where no such checkpoint is available offline. Its greedy text is meaningless; never use it
for perplexity or agreement.

    python benchmarks/synthetic_model.py --arch smollm2-1.7b --out /tmp/smollm2-1.7b-random
    python benchmarks/synthetic_model.py --arch llama-3.1-8b --out ~/.cache/ffl_backend/llama-3.1-8b-random
    ffl-bench --model /tmp/smollm2-1.7b-random --backends fastflow --dtypes bfloat16 --quant none int8 ...

Vocabulary: the copied tokenizer is SmolLM2's (49152 tokens), so by default every architecture gets
SmolLM2's vocabulary and special ids instead of its published one (Qwen2: 151936; Llama-3: 128256).
That makes the embedding and the output head smaller than published: Llama-3.2-3B (tied) has 2.97B
parameters here instead of 3.21B (-243M), Llama-3.1-8B (untied) 7.38B instead of 8.03B (-648M), which
is 8% fewer weight bytes read per decode step. `--vocab 128256` builds the published sizes (token ids
above 49151 then exist only in the weights, never in a prompt; the GGUF export for the llama.cpp rows
pads its token list with placeholders to match). The printed line says which.

RoPE: Llama-3.x publish rope_type "llama3" (factor 32 for 3.2-3B, 8 for 3.1-8B; low/high frequency
factors 1 and 4; original context 8192), which transformers 5 reads from `rope_parameters` and this
script writes by default (the GGUF export for the llama.cpp rows writes it as llama.cpp's rope_freqs
tensor). `--rope default` writes plain RoPE of the same base instead. The weights do not depend on it:
`--config-only` rewrites config.json of a folder already built.

Memory: the model is built on the meta device and its weights are drawn and written one shard (~2 GB)
at a time, so building an 8B model (15 GB of bf16) holds about one shard, not the model.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

# The published configurations' sizes (huggingface.co/HuggingFaceTB/SmolLM2-*/config.json,
# huggingface.co/Qwen/Qwen2-1.5B/config.json, huggingface.co/meta-llama/Llama-3.2-3B/config.json,
# huggingface.co/meta-llama/Llama-3.1-8B/config.json). The SmolLM2 ones keep everything else (tied
# embeddings, norms, activation) from SmolLM2-135M; the others are their own model type (Qwen2: q/k/v
# biases) with SmolLM2-135M's vocabulary and special ids, so the copied tokenizer files fit.
ARCHITECTURES = {
    "smollm2-360m": {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                     "num_attention_heads": 15, "num_key_value_heads": 5},
    "smollm2-1.7b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "rope_theta": 130000},
    "qwen2-1.5b": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                   "num_attention_heads": 12, "num_key_value_heads": 2, "rope_theta": 1000000,
                   "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 32768},
    "llama-3.2-3b": {"model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
                     "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 131072},
    "llama-3.1-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 131072},
}
PUBLISHED_VOCAB = {"qwen2-1.5b": 151936, "llama-3.2-3b": 128256, "llama-3.1-8b": 128256}
SHARD_BYTES = 2 * 10**9  # what building holds at once (plus the runtime)


def make_config(arch: str, base, vocab: int | None = None, rope: str = "published"):
    """The configuration of `arch`, given SmolLM2-135M's folder (`base`); `vocab` replaces SmolLM2's
    vocabulary size; `rope` "default" drops a published RoPE scaling (keeping its base)."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    sizes = dict(ARCHITECTURES[arch])
    theta, scaling = sizes.pop("rope_theta", None), sizes.pop("rope_scaling", None)
    if theta is not None:  # transformers 5 reads only rope_parameters; a rope_theta attribute is ignored
        sizes["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta),
                                    **(scaling if scaling and rope == "published" else {})}
    model_type = sizes.pop("model_type", None)
    if model_type:
        # sizes go to the constructor: it validates RoPE against max_position_embeddings and derives
        # layer_types from num_hidden_layers there
        ids = {key: getattr(config, key) for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
        config = AutoConfig.for_model(model_type, **ids, **sizes)
    for key, value in sizes.items():
        setattr(config, key, value)
    if "head_dim" not in sizes:
        config.head_dim = config.hidden_size // config.num_attention_heads  # 128 for Qwen2-1.5B, as published
    if vocab is not None:
        config.vocab_size = vocab
    config.dtype = torch.bfloat16
    return config


def _random(name: str, param, generator, std: float):
    """What the model's own initializer draws: ones for norm weights, N(0, std) for the rest (biases
    too: initialization zeroes them; random ones are exercised like any weight)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(param.shape, dtype=param.dtype)
    return torch.empty(param.shape, dtype=param.dtype).normal_(0.0, std, generator=generator)


def _shards(params: list, limit: int) -> list[list]:
    """`params` ((name, tensor) in order) cut into runs of at most `limit` bytes (a larger tensor alone)."""
    shards, size = [[]], 0
    for name, p in params:
        nbytes = p.numel() * p.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, p))
        size += nbytes
    return shards


def build(arch: str, out: str, seed: int = 0, vocab: int | None = None, rope: str = "published",
          config_only: bool = False, shard_bytes: int = SHARD_BYTES) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from ffl_backend.models import smollm2_path

    base = smollm2_path()
    config = make_config(arch, base, vocab, rope)
    if config.vocab_size < 49152:
        raise SystemExit(f"--vocab {config.vocab_size} is smaller than the tokenizer's 49152 tokens")
    with torch.device("meta"):  # names and shapes only: no weight is allocated here
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    config.architectures = [type(model).__name__]
    folder = Path(out).expanduser()
    if config_only and json.loads((folder / "config.json").read_text())["vocab_size"] != config.vocab_size:
        raise SystemExit(f"--config-only: {folder}'s weights have another vocabulary than {config.vocab_size}")
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    params = list(model.named_parameters())  # a tied output head appears once, as the embedding
    count = sum(p.numel() for _, p in params)
    if not config_only:
        _write_weights(folder, params, torch.Generator().manual_seed(seed), config.initializer_range, shard_bytes,
                       save_file)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            if (base / name).exists():
                shutil.copy(base / name, folder / name)
    rope_type = config.rope_parameters.get("rope_type", "default")
    published = PUBLISHED_VOCAB.get(arch, 49152)
    heads = 1 if config.tie_word_embeddings else 2  # rows of the vocabulary: embedding, and an untied head
    extra = (published - config.vocab_size) * config.hidden_size * heads
    vocab_note = (f"vocabulary {config.vocab_size} (SmolLM2's tokenizer) instead of the published {published}: "
                  f"{extra / 1e6:+.0f}M parameters -> {(count + extra) / 1e9:.2f}B as published"
                  if extra else f"vocabulary {config.vocab_size}, as published")
    print(f"{arch}: {count / 1e9:.2f}B parameters ({2 * count / 1e9:.1f} GB bf16), {vocab_note}; RoPE {rope_type}; "
          f"{'config.json rewritten' if config_only else 'random bf16 weights'} in {folder}")


def _write_weights(folder: Path, params: list, generator, std: float, shard_bytes: int, save_file) -> None:
    """Draw and write the weights one shard at a time (Hugging Face's sharded layout and index)."""
    shards = _shards(params, shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for old in folder.glob("model*.safetensors*"):  # a previous build's other shard count
        old.unlink()
    weight_map, total = {}, 0
    for file, shard in zip(names, shards):
        tensors = {name: _random(name, p, generator, std) for name, p in shard}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors  # before the next shard is drawn
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), default="smollm2-1.7b")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, help="vocabulary size (default: the tokenizer's 49152; e.g. 128256 for "
                                             "Llama-3's published size)")
    p.add_argument("--rope", choices=("published", "default"), default="published",
                   help="published: the architecture's RoPE scaling (llama3 for Llama-3.x); default: plain RoPE "
                        "of the same base (what the llama.cpp rows' GGUF export supports)")
    p.add_argument("--config-only", action="store_true",
                   help="rewrite config.json only (e.g. another --rope for a folder already built)")
    args = p.parse_args(argv)
    build(args.arch, os.path.expanduser(args.out), args.seed, args.vocab, args.rope, args.config_only)


if __name__ == "__main__":
    main()
