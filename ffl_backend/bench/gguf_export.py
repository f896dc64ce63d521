"""A GGUF file llama.cpp can run, written from a Hugging Face LLaMA, Qwen2 or Gemma-3 folder, for
ffl-bench's llamacpp rows.

The llama.cpp rows must time the very weights the torch rows load, so the file is written here from
the folder's safetensors rather than taken from elsewhere. Written with the `gguf` package
(gguf.GGUFWriter, gguf.quants); names, metadata keys and the Q/K row order follow what llama.cpp's
`llama`, `qwen2` and `gemma3` architectures read (src/llama-model.cpp, src/llama-vocab.cpp). Qwen2 is
LLaMA with q/k/v biases and NeoX RoPE (rotate_half, as Hugging Face's), so its Q/K rows keep their
order; llama.cpp's qwen2 has no sliding window and shapes Q and O hidden x hidden, so a model with a
window or another head_dim is refused. Gemma-3 differs more:
four norms per layer (q/k norms, post-attention, pre/post-feedforward), each stored as 1 + w because
llama.cpp multiplies by the weight where Hugging Face's Gemma multiplies by 1 + w; NeoX RoPE, so Q/K
rows keep their order; an SPM-style vocabulary (`llama` tokenizer model); llama.cpp hard-codes its
sliding-window layout (every sixth layer global, local RoPE base 10000), so other layouts are refused.
RoPE is plain, or for LLaMA also Llama-3's frequency scaling (rope_type "llama3", Llama-3.1/3.2): llama.cpp
has no metadata key for it but reads a `rope_freqs.weight` tensor (F32, head_dim / 2 values) by which it
divides each rotary frequency (llama3_rope_factors); other scalings are refused.

Types (GGUF_TYPES): norms and biases are always F32, as llama.cpp keeps them.
    F16   every matrix F16 (bfloat16/float16 rows; bf16 -> f16 rounds no SmolLM2-135M weight, checked).
    Q8_0  every matrix Q8_0, the token embedding included (what llama.cpp's own q8_0 export does).
    Q4_0  the linears Q4_0; the token embedding and output head Q8_0. llama-quantize gives the output
          head (the tied embedding, for SmolLM2) Q6_K, or Q8_0 where rows are not a multiple of 256
          (576 in SmolLM2, so Q8_0 there), and an untied embedding Q4_0; Q8_0 for both matches our
          int4-all preset (int4 linears, int8 embedding and lm_head), the row it is compared with.
          For SmolLM2 the file is byte for byte what llama.cpp's own quantizer (llama_model_quantize)
          makes of our F16 file.
A matrix whose rows are not a multiple of the 32-value block is written F16 (llama-quantize refuses it).

The file is written one tensor at a time (tensor infos from the safetensors headers first, then each
tensor read, converted and written): a model larger than the memory left beside it still exports.

Files are cached under $FFL_CACHE_DIR/gguf/ (paths.cache_dir), keyed by the folder's config,
the sizes and mtimes of its weight and tokenizer files, the type and EXPORT_VERSION.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from .. import paths

GGUF_TYPES = ("F16", "Q8_0", "Q4_0")
EXPORT_VERSION = 2  # part of the cache key: bump when what is written changes
BLOCK = 32  # values per Q8_0/Q4_0 block

# Hugging Face parameter names -> llama.cpp's ("{i}": the layer), per model_type.
_COMMON_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_LAYER_NAMES = {
    "llama": {**_COMMON_LAYER_NAMES, "post_attention_layernorm": "ffn_norm"},
    "qwen2": {**_COMMON_LAYER_NAMES, "post_attention_layernorm": "ffn_norm"},
    "gemma3_text": {**_COMMON_LAYER_NAMES, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                    "post_feedforward_layernorm": "post_ffw_norm"},
}
_BIASES = {"qwen2": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}  # the only biases written
_NAMES = {model_type: {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                       "lm_head.weight": "output.weight",
                       **{f"model.layers.{{i}}.{hf}.weight": f"blk.{{i}}.{ours}.weight" for hf, ours in layers.items()},
                       **{f"model.layers.{{i}}.{hf}.bias": f"blk.{{i}}.{layers[hf]}.bias"
                          for hf in _BIASES.get(model_type, ())}}
          for model_type, layers in _LAYER_NAMES.items()}
_ARCH = {"llama": "LLAMA", "qwen2": "QWEN2", "gemma3_text": "GEMMA3"}  # gguf.MODEL_ARCH members


def unsupported(folder: str | os.PathLike) -> str | None:
    """Why the folder cannot be written as a llama.cpp model, or None. Read from the raw config.json
    and tokenizer.json, so the grid can skip such rows before loading anything."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in _ARCH:
        names = [repr(t) for t in _ARCH]
        return f"GGUF export supports model_type {', '.join(names[:-1])} and {names[-1]} only, not {model_type!r}"
    if config.get("attention_bias") or config.get("mlp_bias"):  # Qwen2's q/k/v biases are no config option
        return "GGUF export writes no bias tensors but Qwen2's q/k/v ones"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    ropes = rope.values() if model_type == "gemma3_text" else [rope]
    allowed = ("default", "llama3") if model_type == "llama" else ("default",)
    if any(r.get("rope_type", r.get("type", "default")) not in allowed for r in ropes):
        return "GGUF export supports plain RoPE, and Llama-3 RoPE scaling for LLaMA, only"
    if any(r.get("partial_rotary_factor", 1.0) != 1.0 for r in ropes):
        return "GGUF export rotates whole heads (partial_rotary_factor must be 1)"
    if model_type == "gemma3_text" and (issue := _gemma3_layout_issue(config)):
        return issue
    if model_type == "qwen2" and (issue := _qwen2_layout_issue(config)):
        return issue
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.exists() or json.loads(tokenizer.read_text())["model"]["type"] != "BPE":
        return "GGUF export needs a BPE tokenizer.json (llama.cpp's gpt2 vocabulary)"
    return None


def _gemma3_layout_issue(config: dict) -> str | None:
    """What llama.cpp's gemma3 would compute differently from this config, or None."""
    types = config.get("layer_types") or []
    every_sixth = all((t == "full_attention") == (i % 6 == 5) for i, t in enumerate(types))
    if not types or not every_sixth or not config.get("sliding_window"):
        return "llama.cpp's gemma3 needs every sixth layer global and the others sliding"
    local = config["rope_parameters"].get("sliding_attention", {}).get("rope_theta")
    if local != 10000.0:
        return f"llama.cpp's gemma3 uses local RoPE base 10000, this model {local}"
    if config.get("query_pre_attn_scalar", config.get("head_dim")) != config.get("head_dim"):
        return "llama.cpp's gemma3 scales queries by head_dim ** -0.5 (query_pre_attn_scalar differs)"
    if config.get("attn_logit_softcapping") or config.get("final_logit_softcapping"):
        return "GGUF export does not write Gemma soft-capping"
    return None


def _qwen2_layout_issue(config: dict) -> str | None:
    """What llama.cpp's qwen2 would compute differently from this config, or cannot load, or None."""
    if config.get("use_sliding_window") or any(t != "full_attention" for t in config.get("layer_types") or []):
        return "llama.cpp's qwen2 has no sliding-window attention"
    head_dim = config.get("head_dim")
    if head_dim and head_dim * config["num_attention_heads"] != config["hidden_size"]:
        return "llama.cpp's qwen2 needs head_dim * num_attention_heads == hidden_size (its Q/O shapes)"
    return None


def cached_path(folder: str | os.PathLike, gguf_type: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the file for `folder` in `gguf_type` is cached; a change to the folder's config, weights or
    tokenizer (size or mtime) gives a new name, so a stale file is never reused."""
    folder = Path(folder)
    files = sorted(p for p in folder.iterdir() if p.suffix == ".safetensors" or p.name == "tokenizer.json")
    key = json.dumps({"config": (folder / "config.json").read_text(), "type": gguf_type, "version": EXPORT_VERSION,
                      "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]})
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir or paths.cache_dir()) / "gguf" / f"{folder.name}-{gguf_type}-{digest}.gguf"


def export(folder: str | os.PathLike, gguf_type: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached GGUF file of `folder` in `gguf_type`, written first if missing."""
    path = cached_path(folder, gguf_type, cache_dir)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # a crash never leaves a half file under the name
        try:
            write_gguf(folder, gguf_type, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def write_gguf(folder: str | os.PathLike, gguf_type: str, path: str | os.PathLike) -> None:
    """Write `folder` (a Hugging Face LLaMA, Qwen2 or Gemma-3 folder) as a GGUF file of `gguf_type` at `path`."""
    import gguf
    import numpy as np
    from transformers import AutoConfig

    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"gguf_type must be one of {GGUF_TYPES}, got {gguf_type!r}")
    reason = unsupported(folder)
    if reason:
        raise ValueError(f"{folder}: {reason}")
    config = AutoConfig.from_pretrained(folder)  # transformers' defaults, as the torch rows see them
    writer = gguf.GGUFWriter(os.fspath(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[_ARCH[config.model_type]]])
    _add_hparams(writer, config, Path(folder).name, gguf_type)
    if config.model_type == "gemma3_text":
        _add_spm_vocab(writer, Path(folder), config)
    else:
        _add_vocab(writer, Path(folder), config)
    # One tensor in memory at a time: every tensor's info (name, shape, type, bytes) goes into the header
    # first, from the safetensors headers alone; then each tensor is read, converted and written in turn.
    plan = list(_tensors(Path(folder), config))
    for name, shape, _ in plan:
        qtype = gguf.GGMLQuantizationType[tensor_type(name, shape, gguf_type)]
        writer.add_tensor_info(name, shape, np.float32, _nbytes(shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, _, load in plan:
        writer.write_tensor_data(_encode(name, load(), gguf_type)[0])
    writer.close()


def _add_hparams(writer, config, name: str, gguf_type: str) -> None:
    import gguf

    heads, head_dim = config.num_attention_heads, _head_dim(config)
    writer.add_name(name)
    writer.add_file_type({"F16": gguf.LlamaFileType.MOSTLY_F16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[gguf_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"] if "full_attention" in rope else rope["rope_theta"])
    if config.model_type == "gemma3_text":
        writer.add_sliding_window(config.sliding_window)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // heads:  # llama.cpp assumes hidden / heads otherwise
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _head_dim(config) -> int:
    """Qwen2's config may leave head_dim out (None): Hugging Face then uses hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _add_vocab(writer, folder: Path, config) -> None:
    """A gpt2 (byte-level BPE) vocabulary: llama.cpp refuses a file without one. ffl-bench feeds token
    ids itself, so it only has to load and agree with the HF tokenizer; ids the tokenizer does not
    use (the embedding is often padded past it) become unused placeholder tokens."""
    import gguf

    spec = json.loads((folder / "tokenizer.json").read_text())
    tokens = {i: (text, gguf.TokenType.NORMAL) for text, i in spec["model"]["vocab"].items()}
    for added in spec.get("added_tokens", []):
        tokens[added["id"]] = (added["content"], gguf.TokenType.CONTROL if added["special"]
                               else gguf.TokenType.USER_DEFINED)
    if max(tokens) >= config.vocab_size:
        raise ValueError(f"tokenizer ids reach {max(tokens)}, past the model's vocab_size {config.vocab_size}")
    texts, types = zip(*(tokens.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED)) for i in range(config.vocab_size)))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(spec))
    writer.add_token_list(list(texts))
    writer.add_token_types(list(types))
    # Newer tokenizer.json files store a merge as a pair, older ones as "a b"; GGUF wants "a b".
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    _add_special_ids(writer, config)


def _add_spm_vocab(writer, folder: Path, config) -> None:
    """A SentencePiece-style vocabulary (`llama` tokenizer model: "▁" for spaces, <0xXX> byte tokens),
    as llama.cpp's gemma3 expects; scores are all 0 (ffl-bench feeds token ids, never text)."""
    import gguf

    spec = json.loads((folder / "tokenizer.json").read_text())
    texts = [f"[PAD{i}]" for i in range(config.vocab_size)]
    types = [gguf.TokenType.UNUSED] * config.vocab_size
    for text, i in spec["model"]["vocab"].items():
        texts[i] = text
        is_byte = len(text) == 6 and text.startswith("<0x") and text.endswith(">")
        types[i] = gguf.TokenType.BYTE if is_byte else gguf.TokenType.NORMAL
    for added in spec.get("added_tokens", []):
        types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    writer.add_tokenizer_model("llama")
    writer.add_token_list(texts)
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_types(types)
    _add_special_ids(writer, config)


def _add_special_ids(writer, config) -> None:
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        value = getattr(config, key, None)
        value = value[0] if isinstance(value, list) else value
        if isinstance(value, int):
            add(value)


def _pre_tokenizer(spec: dict) -> str:
    """llama.cpp's name for the tokenizer's pre-split: GPT-2's regex for a plain byte-level one, else
    llama.cpp's default (it only matters to llama.cpp's own tokenizer, which ffl-bench does not use)."""
    pre = spec.get("pre_tokenizer") or {}
    return "gpt-2" if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) else "default"


def _tensors(folder: Path, config):
    """(llama.cpp name, HF shape, load) of every tensor to write, in file order; load() reads it as a
    float32 array: for `llama` Q and K rows reordered for llama.cpp's RoPE (qwen2 and gemma3 rotate as HF
    does), for Gemma-3 norms as 1 + w. The output head is left out when tied to the embedding (llama.cpp
    then reads token_embd). Llama-3 RoPE scaling adds rope_freqs.weight first (as llama.cpp's converter)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    rope = _rope(config)
    if rope.get("rope_type", "default") == "llama3":
        factors = llama3_rope_factors(rope, _head_dim(config))
        yield "rope_freqs.weight", factors.shape, lambda: factors
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    heads = heads if config.model_type == "llama" else {}
    for file in files:
        with safe_open(file, framework="pt") as fh:
            for hf_name in fh.keys():
                name = gguf_name(hf_name, config.model_type)
                if name is None:
                    raise ValueError(f"{file.name}: no llama.cpp name for tensor {hf_name!r}")
                if name == "output.weight" and config.tie_word_embeddings:
                    continue
                kind = name.split(".")[-2]
                order = rotary_row_order(heads[kind], _head_dim(config)) if kind in heads else None
                plus_one = config.model_type == "gemma3_text" and kind.endswith("norm")
                yield name, tuple(fh.get_slice(hf_name).get_shape()), _loader(file, hf_name, order, plus_one)


def _loader(file: Path, hf_name: str, order, plus_one: bool):
    """A function reading one safetensors tensor as float32, rows reordered by `order`, plus 1 if asked."""
    def load():
        from safetensors import safe_open

        with safe_open(file, framework="pt") as fh:
            array = fh.get_tensor(hf_name).float().numpy()
        if order is not None:
            array = array[order]
        return array + 1.0 if plus_one else array
    return load


def _rope(config) -> dict:
    """The RoPE parameters llama.cpp's full-attention layers use (transformers' rope_parameters)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("full_attention", rope)


def llama3_rope_factors(rope: dict, head_dim: int):
    """Llama-3's RoPE scaling as llama.cpp applies it: one divisor per rotary frequency (head_dim / 2,
    float32), the `rope_freqs.weight` tensor.

    Hugging Face scales the inverse frequency f_i = theta ** (-2i / head_dim) by its wavelength
    w_i = 2 pi / f_i against L = original_max_position_embeddings: kept where w_i < L / high_freq_factor,
    divided by `factor` where w_i > L / low_freq_factor, and in between
    f_i * ((1 - s) / factor + s) with s = (L / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor).
    llama.cpp divides f_i by the tensor's value, so the value is 1 / (what f_i is multiplied by)."""
    import numpy as np

    theta, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    context = float(rope["original_max_position_embeddings"])
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (context / wavelen - low) / (high - low) if high != low else np.zeros_like(wavelen)
    scale = np.where(wavelen < context / high, 1.0,
                     np.where(wavelen > context / low, 1.0 / factor, (1.0 - smooth) / factor + smooth))
    return (1.0 / scale).astype(np.float32)


def gguf_name(hf_name: str, model_type: str = "llama") -> str | None:
    """llama.cpp's name for a Hugging Face parameter, or None for one it has no place for."""
    names = _NAMES[model_type]
    parts = hf_name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        template = ".".join(parts[:2] + ["{i}"] + parts[3:])
        return names[template].format(i=parts[2]) if template in names else None
    return names.get(hf_name)


def rotary_row_order(n_heads: int, head_dim: int):
    """Row indices that turn HF's Q/K layout into llama.cpp's.

    HF rotates dimension i of a head with dimension i + head_dim/2 (rotate_half); llama.cpp's `llama`
    architecture rotates adjacent pairs (2i, 2i+1). So new row 2i of each head is old row i, and new
    row 2i+1 is old row i + head_dim/2."""
    import numpy as np

    j = np.arange(head_dim)
    within = j // 2 + (j % 2) * (head_dim // 2)
    return (np.arange(n_heads)[:, None] * head_dim + within).reshape(-1)


def tensor_type(name: str, shape: tuple, gguf_type: str) -> str:
    """The GGML type `name` is stored in, in a file of `gguf_type` (see the module docstring)."""
    if len(shape) == 1:
        return "F32"
    wanted = "Q8_0" if gguf_type == "Q4_0" and name in ("token_embd.weight", "output.weight") else gguf_type
    return wanted if wanted == "F16" or shape[-1] % BLOCK == 0 else "F16"


def _nbytes(shape: tuple, qtype) -> int:
    """Bytes a tensor of HF `shape` takes in GGML type `qtype`."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(math.prod(shape)) // block * size


def _encode(name: str, array, gguf_type: str):
    """(data, GGML type) for GGUFWriter.add_tensor: quantized types as bytes, others as numbers."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[tensor_type(name, array.shape, gguf_type)]
    if qtype == gguf.GGMLQuantizationType.F32:
        return array.astype(np.float32), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array, qtype), qtype


def weight_bytes(path: str | os.PathLike) -> int:
    """Bytes of tensor data one decode step reads: every tensor but the token embedding, which is
    only looked up -- unless it is also the output head (no output.weight), which reads all of it."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")
