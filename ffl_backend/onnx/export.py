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

from . import decoder, nbits
from .genai import write_genai_config

logger = logging.getLogger("ffl_backend.onnx")

MODEL_FILE = "model.onnx"
EXTERNAL_DATA_ABOVE = 1 << 30  # bytes of weights beyond which they go to model.onnx.data (protobuf caps at 2 GB)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")
UNEXPORTABLE_SCHEMES = ("w8a8", "fp8")


def export_onnx(model, out_dir, *, quant=None, calibration_data=None, max_seq_len: int | None = None,
                opset: int = 21, check: bool = True, accuracy_level: int = 0, tokenizer=None) -> Path:
    """Write `model` to `out_dir` as ONNX Runtime's decoder; returns the model.onnx path.

    quant: None (the model as it is, quantized or not), or what `ffl_backend.quantize` takes
    ("int8", "int4", "int8-all", a QuantConfig...), applied to `model` in place first with
    `calibration_data`. int8/int4 layers are written as MatMulNBits from their own codes; W8A8 and
    FP8 layers have no ONNX Runtime weight format and are refused. max_seq_len: the context length
    written to genai_config.json (default: the model's max_position_embeddings). accuracy_level:
    MatMulNBits' (0 = fp32 math as fastflow; 4 = int8 activations, faster and less exact).
    check: run the export on a prompt and two decode steps and compare logits with PyTorch's.
    tokenizer: saved beside the model; default: tokenizer files copied from the model's folder."""
    why = _refusal(model, quant)
    if why is not None:
        raise ValueError(f"cannot export to ONNX: {why}")
    started = time.perf_counter()
    if quant is not None:
        from ..quant.quantizer import quantize

        quantize(model, quant, calibration_data=calibration_data)
    bad = nbits.unexportable_layers(model)
    if bad:
        raise ValueError(f"cannot export to ONNX: {len(bad)} W8A8/FP8 layers ({bad[0]}, ...) have no ONNX Runtime "
                         "weight format; quantize with int8 or int4")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / MODEL_FILE
    with torch.no_grad(), nbits.as_matmul_nbits(model, accuracy_level) as swapped:
        _export_graph(model, path, opset)
        logger.info("fastflow: exported %s (%d MatMulNBits layers) in %.1f s", path, swapped,
                    time.perf_counter() - started)
        _write_side_files(model, out, tokenizer, max_seq_len)
        if check:
            print(check_export(model, out))  # against the model ONNX Runtime should equal: same weights
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


def _export_graph(model, path: Path, opset: int) -> None:
    layers = decoder.cache_geometry(model.config)[0]
    wrapper = decoder.KVDecoder(model).eval()
    program = torch.onnx.export(
        wrapper, decoder.example_inputs(model), dynamo=True, opset_version=opset, optimize=True,
        input_names=decoder.input_names(layers), output_names=decoder.output_names(layers),
        dynamic_shapes=decoder.dynamic_shapes(layers), custom_translation_table=nbits.onnx_translation(),
        verbose=False)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    for stale in (path, path.with_name(path.name + ".data")):
        stale.unlink(missing_ok=True)
    program.save(str(path), external_data=weights > EXTERNAL_DATA_ABOVE)


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


def check_export(model, out: Path, prompt_len: int = 7, steps: int = 2) -> str:
    """Logits of the export on a prompt and `steps` greedy decode steps against PyTorch's; raises
    where they differ by more than fp32 rounding allows. Returns the one-line summary."""
    from .runtime import OnnxCausalLM

    session = OnnxCausalLM(out)
    vocab = decoder.text_config(model.config).vocab_size
    ids = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    torch_side = decoder.KVDecoder(model).eval()
    worst, bound = 0.0, 0.0
    past_t = past_o = None
    step_ids = ids
    for _ in range(steps + 1):
        ref, past_t = _torch_step(torch_side, step_ids, past_t)
        got, past_o = session.step(step_ids, past_o)
        got = torch.from_numpy(got)
        # fp32 rounding of a few thousand-term dot products over the layers, relative to the logits' size
        bound = max(bound, 1e-4 * (1.0 + float(ref.abs().max())))
        worst = max(worst, float((got - ref).abs().max()))
        step_ids = ref[:, -1:].argmax(-1)
    line = (f"ONNX export check: max |logits - PyTorch| = {worst:.3g} over a prompt and {steps} decode steps "
            f"(tolerance {bound:.3g})")
    if not worst <= bound:
        raise RuntimeError(line + ": the export does not compute the model")
    return line


def _torch_step(torch_side, ids, past):
    layers = torch_side.layers
    if past is None:
        kv_heads, head_dim = decoder.cache_geometry(torch_side.model.config)[1:]
        dtype = next(torch_side.model.parameters()).dtype
        past = [torch.zeros(ids.shape[0], kv_heads, 0, head_dim, dtype=dtype) for _ in range(2 * layers)]
    total = past[0].shape[2] + ids.shape[1]
    mask = torch.ones(ids.shape[0], total, dtype=torch.long)
    positions = torch.arange(past[0].shape[2], total).expand(ids.shape[0], -1)
    logits, *present = torch_side(ids, mask, positions, *past)
    return logits.float(), present
