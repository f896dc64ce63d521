"""`export_onnx`: a causal LM (optionally quantized by fastflow first) as one ONNX decoder with KV-cache
I/O, its config, tokenizer and `genai_config.json` beside it, checked against PyTorch after export.

The graph comes from `torch.onnx.export(dynamo=True)` of the model's own eager forward (decoder.py),
so every architecture detail (biases, QK-norm, partial rotary, soft-capping, sliding masks) is the
model's code; int8/int4 linears become `com.microsoft.MatMulNBits` (nbits.py).
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch

from .. import progress
from . import decoder, nbits
from .check import check_export
from .genai import write_genai_config

logger = logging.getLogger("ffl_backend.onnx")

MODEL_FILE = "model.onnx"
# Bumped whenever the graph written for the same model changes: cached exports (ffl-bench) key on it.
FORMAT_VERSION = 2
EXTERNAL_DATA_ABOVE = 1 << 30  # bytes of weights beyond which they go to model.onnx.data (protobuf caps at 2 GB)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")
UNEXPORTABLE_SCHEMES = ("w8a8", "fp8")


def export_onnx(model, out_dir, *, quant=None, calibration_data=None, max_seq_len: int | None = None,
                opset: int = 21, check: bool = True, accuracy_level: int = 4, fuse: bool = True,
                tokenizer=None) -> Path:
    """Write `model` to `out_dir` as ONNX Runtime's decoder; returns the model.onnx path.

    quant: None (the model as it is, quantized or not), or what `ffl_backend.quantize` takes
    ("int8", "int4", "int8-all", a QuantConfig...), applied to `model` in place first with
    `calibration_data`. int8/int4 layers are written as MatMulNBits from their own codes; W8A8 and
    FP8 layers have no ONNX Runtime weight format and are refused. max_seq_len: the context length
    written to genai_config.json (default: the model's max_position_embeddings). accuracy_level:
    MatMulNBits' (0 = fp32 math as fastflow; 4 = int8 activations, faster and less exact).
    fuse: rewrite the graph for ONNX Runtime (onnxscript's ort_fusions: RMSNorm and skip-RMSNorm,
    rotary, attention as contrib ops; kept only if the check passes). check: run the export on a
    prompt and two decode steps and compare logits with PyTorch's (always on for a fused graph).
    tokenizer: saved beside the model; default: tokenizer files copied from the model's folder."""
    why = _refusal(model, quant)
    if why is not None:
        raise ValueError(f"cannot export to ONNX: {why}")
    with progress.timed("ONNX export") as phase:  # a bar over its phases, then their seconds in one line
        if quant is not None:
            from ..quant.quantizer import quantize

            with phase("quantize"):  # its own bar counts the linears
                quantize(model, quant, calibration_data=calibration_data)
        return _export_checked(model, Path(out_dir), tokenizer, max_seq_len, opset, check, accuracy_level, fuse, phase)


def _export_checked(model, out: Path, tokenizer, max_seq_len, opset, check, accuracy_level, fuse, phase) -> Path:
    """export_onnx after quantizing: phases export, fuse, write, check, each counted on the bar (the
    tracing and the check cannot report finer progress)."""
    started = time.perf_counter()
    bad = nbits.unexportable_layers(model)
    if bad:
        raise ValueError(f"cannot export to ONNX: {len(bad)} W8A8/FP8 layers ({bad[0]}, ...) have no ONNX Runtime "
                         "weight format; quantize with int8 or int4")
    out.mkdir(parents=True, exist_ok=True)
    path = out / MODEL_FILE
    phase.count_phases(3 + int(fuse) + int(check or fuse))  # export, [fuse], write, write, [check]
    with torch.no_grad(), nbits.as_matmul_nbits(model, accuracy_level) as swapped:
        fused = _export_graph(model, path, opset, fuse, phase)
    with phase("write"):  # config, tokenizer, genai_config.json: the folder GenAI loads
        _write_side_files(model, out, tokenizer, max_seq_len)
    level = accuracy_level if swapped else 0
    logger.info("fastflow: exported %s (%d MatMulNBits layers%s) in %.1f s", path, swapped,
                f", {fused}" if fused else "", time.perf_counter() - started)
    if fused:
        try:
            with phase("check"):
                print(check_export(model, out, level))
            return path
        except Exception as exc:  # a fusion ONNX Runtime rejects or that changed the result: the plain graph
            logger.warning("fastflow: the fused ONNX graph failed its check (%s: %s); writing it unfused",
                           type(exc).__name__, str(exc).splitlines()[0][:200])
        phase.count_phases(3)  # export, write, check again
        with torch.no_grad(), nbits.as_matmul_nbits(model, accuracy_level):
            _export_graph(model, path, opset, False, phase)
    if check or fused:
        with phase("check"):
            print(check_export(model, out, level))
    return path


def _refusal(model, quant) -> str | None:
    why = decoder.unsupported(model)
    if why is not None:
        return why
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float32, torch.float16):
        return f"the model is {str(dtype).removeprefix('torch.')}; load it in float32 (float16 for GPU providers)"
    names = [quant] if isinstance(quant, str) else quant if isinstance(quant, (list, tuple)) else []
    named = [n for n in names if isinstance(n, str) and n.startswith(UNEXPORTABLE_SCHEMES)]
    scheme = getattr(quant, "scheme", None)
    if named or scheme in UNEXPORTABLE_SCHEMES:
        return f"quant {named[0] if named else scheme!r} has no ONNX Runtime weight format; use int8 or int4"
    return None


def _export_graph(model, path: Path, opset: int, fuse: bool, phase) -> str | None:
    """Export (and with `fuse`, rewrite for ONNX Runtime) to `path`, each step a phase of `phase`;
    returns what was fused, if anything."""
    layers = decoder.cache_geometry(model.config)[0]
    wrapper = decoder.KVDecoder(model).eval()
    with phase("export"):  # Dynamo's trace and the ONNX translation: one call, nothing to count inside
        program = torch.onnx.export(
            wrapper, decoder.example_inputs(model), dynamo=True, opset_version=opset, optimize=True,
            input_names=decoder.input_names(layers), output_names=decoder.output_names(layers),
            dynamic_shapes=decoder.dynamic_shapes(layers), custom_translation_table=nbits.onnx_translation(),
            verbose=False)
    fused = None
    if fuse:
        with phase("fuse"):
            fused = _fuse_for_ort(program.model)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    for stale in (path, path.with_name(path.name + ".data")):
        stale.unlink(missing_ok=True)
    with phase("write"):
        program.save(str(path), external_data=weights > EXTERNAL_DATA_ABOVE)
    return fused


def _fuse_for_ort(ir_model) -> str | None:
    """ONNX Runtime's contrib ops in place of the patterns onnxscript recognizes; a summary or None."""
    try:
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        _, counts = optimize_for_ort(ir_model)
    except Exception as exc:  # an optional speed-up: the unfused graph is complete and correct
        logger.warning("fastflow: ONNX Runtime fusions skipped (%s: %s)", type(exc).__name__, exc)
        return None
    done = {name: n for name, n in counts.items() if n}
    return "fused " + ", ".join(f"{n} {name}" for name, n in done.items()) if done else None


def _write_side_files(model, out: Path, tokenizer, max_seq_len: int | None) -> None:
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    else:
        source = Path(str(getattr(model.config, "_name_or_path", "") or "."))
        for name in TOKENIZER_FILES:
            if source.is_dir() and (source / name).is_file():
                shutil.copy2(source / name, out / name)
    write_genai_config(model.config, out, max_seq_len)
