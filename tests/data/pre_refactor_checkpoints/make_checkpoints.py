"""Write the pre-refactor quantized checkpoints and config dicts that
tests/quant/test_pre_refactor_checkpoints.py loads with the current code (README.md: how it was run).

Run against the tree *before* the change (PYTHONPATH at an extracted copy of that commit), so the files
are what that code saved: one folder per format (save_quantized: config.json with the transformers
`quantization_config`, ffl_quant.json, model.safetensors), reference.safetensors (the logits of each
model right after quantizing, on fixed input ids), configs.json (config dicts as that code wrote them).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

import ffl_backend
from ffl_backend.quant import save_quantized
from ffl_backend.quant.schemes import PRESETS, QuantConfig, resolve, resolve_steps

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
# A smaller tiny llama than tests/tiny_models.py (one layer, 64 tokens) keeps the files small; every
# width is a multiple of 32, so int4 in groups of 32 takes every linear.
SHAPE = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
IDS = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(7))
CALIB = [torch.randint(3, 64, (1, 48), generator=torch.Generator().manual_seed(1))]

CHECKPOINTS = {  # folder: (how quantize was called, model dtype)
    "int8": ("int8", torch.float32),
    "int8_bf16": ("int8", torch.bfloat16),
    "int4_g32": (QuantConfig("int4", group_size=32), torch.float32),
    "w8a8_static_smooth": (QuantConfig("w8a8", static=True, smoothquant_alpha=0.5), torch.float32),
    "w8a8_dynamic": ("w8a8", torch.float32),
    "fp8": ("fp8", torch.float32),
    "int4_all": ("int4-all", torch.float32),  # a list of two configs, int8 embedding and lm_head
}

CONFIGS = {  # config dicts as QuantConfig.to_dict() wrote them
    "int8": QuantConfig("int8"),
    "int8_all_layers": QuantConfig("int8", skip=(), include=("model.*", "lm_head")),
    "int8_gptq": QuantConfig("int8", algorithm="gptq"),
    "int4": QuantConfig("int4"),
    "int4_g64_sym_minmax": QuantConfig("int4", group_size=64, symmetric=True, grid="minmax"),
    "int4_g128_gptq": QuantConfig("int4", group_size=128, algorithm="gptq", skip=("lm_head", "*.down_proj")),
    "w8a8": QuantConfig("w8a8"),
    "w8a8_static": QuantConfig("w8a8", static=True, smoothquant_alpha=0.5, static_range_limit=4.0),
    "w8a8_searched": QuantConfig("w8a8", static=True, smoothquant_alpha="auto", clip_search=True,
                                 min_output_sqnr=22.0),
    "fp8": QuantConfig("fp8", include=("model.layers.*",)),
}
NAMES = ("int8", "int4", "int4-g32", "int4-g64", "int4-g128", "w8a8", "fp8", "int8-all", "w8a8-static", "w8a8-smooth")


def tiny_llama(dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.tiny_models import perturb_vectors

    torch.manual_seed(0)
    return perturb_vectors(AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), dtype=dtype).eval())


def main() -> None:
    logits = {"input_ids": IDS}
    for name, (config, dtype) in CHECKPOINTS.items():
        model = ffl_backend.quantize(tiny_llama(dtype), config, calibration_data=CALIB)
        with torch.no_grad():
            logits[f"{name}.logits"] = model(IDS).logits.contiguous()
        shutil.rmtree(OUT / name, ignore_errors=True)
        save_quantized(model, OUT / name)
    from safetensors.torch import save_file

    save_file(logits, str(OUT / "reference.safetensors"))
    dicts = {"configs": {k: c.to_dict() for k, c in CONFIGS.items()},
             "names": {n: resolve(n).to_dict() for n in NAMES},
             "presets": {p: [s.to_dict() for s in resolve_steps(p)] for p in PRESETS},
             "made_with": {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}}
    (OUT / "configs.json").write_text(json.dumps(dicts, indent=1) + "\n")


if __name__ == "__main__":
    main()
