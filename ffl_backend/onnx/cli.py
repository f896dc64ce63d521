"""ffl-export-onnx MODEL OUT [--quant int8|int4|int4-all|...]: a Hugging Face model folder (or a bundled
model's name: smollm2, gemma3) as an ONNX Runtime / ONNX Runtime GenAI folder (docs/onnx.md)."""
from __future__ import annotations

import argparse
import logging
import resource
import sys
import time

PROG = "ffl-export-onnx"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Export a causal LM (optionally quantized by fastflow) as "
                                "one ONNX decoder with KV-cache inputs and outputs, for ONNX Runtime and GenAI.")
    p.add_argument("model", help="Hugging Face model folder, or a bundled model: smollm2, gemma3")
    p.add_argument("out", help="output folder (model.onnx, config, tokenizer, genai_config.json)")
    p.add_argument("--quant", default=None, help="fastflow scheme applied first: int8, int4 (int4-g32...), "
                   "int8-all, int4-all (embedding and lm_head too); written as MatMulNBits")
    p.add_argument("--calibration-text", default=None,
                   help="UTF-8 text whose tokens weigh int4 rounding (as quantize(calibration_data=...))")
    p.add_argument("--max-seq-len", type=int, default=None, help="context length for genai_config.json")
    p.add_argument("--opset", type=int, default=21)
    p.add_argument("--accuracy-level", type=int, default=4, choices=[0, 1, 4],
                   help="MatMulNBits' accuracy_level: 4 (default) int8 activations per block, ONNX Runtime's fast "
                        "CPU path; 0/1 float32 activations (exact, much slower for int8 weights)")
    p.add_argument("--no-check", action="store_true", help="skip the logits check after export")
    return p


def _load(name: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models import BUNDLED

    if name in BUNDLED:
        return BUNDLED[name].load(dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError) as exc:  # export_onnx copies the folder's tokenizer files instead
        logging.getLogger("ffl_backend.onnx").warning("no tokenizer loaded from %s (%s)", name, exc)
        tokenizer = None
    return model, tokenizer


def _calibration(tokenizer, path: str | None, rows: int = 8, length: int = 512):
    if path is None:
        return None
    if tokenizer is None:
        raise SystemExit(f"{PROG}: --calibration-text needs the model's tokenizer")
    with open(path, encoding="utf-8") as fh:
        ids = tokenizer(fh.read(), return_tensors="pt").input_ids[0]
    return [ids[i:i + length][None] for i in range(0, min(len(ids), rows * length), length)]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from .export import export_onnx

    start = time.perf_counter()
    model, tokenizer = _load(args.model)
    calibration = _calibration(tokenizer, args.calibration_text)
    try:
        path = export_onnx(model, args.out, quant=args.quant, calibration_data=calibration,
                           max_seq_len=args.max_seq_len, opset=args.opset, check=not args.no_check,
                           accuracy_level=args.accuracy_level, tokenizer=tokenizer)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{path}: {time.perf_counter() - start:.1f} s (load included), peak RSS {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
