"""Console scripts: `ffl-eval-ppl` (perplexity, high precision vs quantized) and `ffl-quant-report`.

Both load a Hugging Face causal LM folder (`--model`; default SmolLM2-135M via load_smollm2) and
read plain text from `--text`. Calibration data for w8a8 static / SmoothQuant / GPTQ is taken from the text
*after* the evaluated tokens, so perplexity is never measured on the calibration set.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time

import torch

from ..bench.grid import environment
from .schemes import config_class, registered_schemes

WINDOW = 512
# GPTQ's Hessians want more tokens than w8a8's ranges; beyond this many perplexity did not improve
# on SmolLM2 (docs/quantization.md).
GPTQ_CALIB_TOKENS = 8192


def perplexity(model, ids: torch.Tensor, window: int = WINDOW, bos: int | None = None) -> float:
    """exp(mean next-token NLL) over consecutive non-overlapping `window`-token windows of `ids` (1-D).

    With `bos`, every window starts with it (window - 1 text tokens each), as the model saw text in training
    (llama.cpp's perplexity does the same): Gemma without it in front loses its attention sink.
    """
    total_nll, total = 0.0, 0
    with torch.no_grad():
        for chunk in _windows(ids, window, bos):
            logits = model(input_ids=chunk, use_cache=False).logits.float()
            nll = torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum")
            total_nll += nll.item()
            total += chunk.shape[1] - 1
    return math.exp(total_nll / total)


def onnxruntime_perplexity(model, ids: torch.Tensor, window: int, bos: int | None, torch_ppl: float,
                           accuracy_level: int = 4) -> dict:
    """The same perplexity through `model` exported to ONNX (a temporary folder) in ONNX Runtime."""
    import tempfile

    from ..onnx import OnnxCausalLM, export_onnx

    with tempfile.TemporaryDirectory(prefix="ffl-onnx-ppl-") as folder:
        start = time.perf_counter()
        export_onnx(model, folder, accuracy_level=accuracy_level)
        export_s = time.perf_counter() - start
        ppl = perplexity(OnnxCausalLM(folder), ids, window, bos)
    return {"onnxruntime_ppl": ppl, "onnxruntime_vs_torch_pct": round(100.0 * (ppl / torch_ppl - 1.0), 4),
            "onnx_export_s": round(export_s, 1), "onnx_accuracy_level": accuracy_level}


def kv_cache_rows(model, ids: torch.Tensor, window: int, bos: int | None, kv_cache_dtypes: list) -> list[dict]:
    """Perplexity with the KV cache stored as each of `kv_cache_dtypes` ("int8", "fp8"), next to the
    model's own dtype through the same path: fastflow attention over a static cache that each window
    fills (the prompt attends over the cached, i.e. quantized, keys and values, as every decode step
    does). Also each quantized cache's top-1 agreement with the model-dtype cache at every position."""
    from .. import hf_attention as hf
    from ..attention.kv_quant import storage_dtype

    state = hf.install(model, hf.NAME)
    names = [None, *kv_cache_dtypes]
    nll, agree, total = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), 0
    try:
        with torch.no_grad():
            for chunk in _windows(ids, window, bos):
                base_top1 = None
                for name in names:
                    logits = _cached_logits(model, chunk, storage_dtype(name))[0, :-1].float()
                    nll[name] += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
                    top1 = logits.argmax(-1)
                    base_top1 = top1 if base_top1 is None else base_top1
                    agree[name] += int((top1 == base_top1).sum())
                total += chunk.shape[1] - 1
    finally:
        hf.uninstall(model, state)
    return [{"model": f"kv cache {name or str(model.dtype).replace('torch.', '')}", "ppl": math.exp(nll[name] / total),
             **({"top1_agreement_pct": round(100.0 * agree[name] / total, 2)} if name else {})} for name in names]


def _cached_logits(model, chunk: torch.Tensor, kv_dtype):
    from transformers import StaticCache

    from ..generation import cache_kwarg
    from ..hf_attention import unroll_sliding_layers
    from ..kv_cache import quantize_layers

    cache = StaticCache(config=model.config, max_cache_len=chunk.shape[1])
    cache = quantize_layers(unroll_sliding_layers(cache, chunk.shape[1]), kv_dtype)
    return model(input_ids=chunk, use_cache=True, **{cache_kwarg(model): cache}).logits


def _windows(ids: torch.Tensor, window: int, bos: int | None):
    """The (1, n) token windows perplexity() evaluates."""
    step = window - (bos is not None)
    for start in range(0, ids.numel() - 1, step):
        chunk = _with_bos(ids[start:start + step], bos)[None]
        if chunk.shape[1] < 2:
            return
        yield chunk


def _with_bos(tokens: torch.Tensor, bos: int | None) -> torch.Tensor:
    return tokens if bos is None else torch.cat([tokens.new_tensor([bos]), tokens])


def _load(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models import BUNDLED

    dtype = getattr(torch, args.dtype)
    if args.model is None or args.model in BUNDLED:
        return BUNDLED[args.model or "smollm2"].load(dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(args.model)


def _config(args, scheme: str):
    from .handlers import handler_for
    from .mixed import MIXED_PRESETS
    from .schemes import DEFAULT_SKIP, PRESETS, QuantConfig, WeightOnlyConfig, resolve_steps, scheme_name_fields

    gptq = getattr(args, "gptq", False)
    if scheme in PRESETS and gptq:
        # GPTQ for the preset's weight-only linears, but not for a step that also quantizes embeddings (the
        # int8 head of "int4-all"): a tied embedding reads the head's table, which GPTQ rounds for the head's
        # inputs only; that step stays round-to-nearest.
        return [dataclasses.replace(s, algorithm="gptq")
                if isinstance(s, WeightOnlyConfig) and handler_for(s).quantize_embedding is None else s
                for s in resolve_steps(scheme)]
    if scheme in PRESETS or scheme in MIXED_PRESETS:  # "int8-all", "int4-all", "int4-mixed": used as defined
        return scheme
    skip = (() if args.quantize_embeddings else DEFAULT_SKIP) + tuple(args.skip)
    named = scheme_name_fields(scheme)  # fields the name gives ("int4-g64") win over the options'
    options = {field: getattr(args, _dest(flag)) for flag, field, _ in config_class(named["scheme"]).cli_options}
    kwargs = {**options, **named, "skip": skip}
    if gptq:
        kwargs["algorithm"] = "gptq"
    return QuantConfig(**kwargs)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _tokens(tokenizer, path: str) -> tuple[torch.Tensor, int | None]:
    """The text's tokens without a leading BOS, and that BOS id when the tokenizer starts texts with one."""
    with open(path, encoding="utf-8") as fh:
        ids = tokenizer(fh.read(), return_tensors="pt").input_ids[0]
    bos = tokenizer.bos_token_id
    if bos is not None and ids.numel() and ids[0].item() == bos:
        return ids[1:], bos
    return ids, None


def _calibration(ids: torch.Tensor, start: int, n_tokens: int, window: int = WINDOW, bos: int | None = None):
    calib = ids[start:start + n_tokens]
    if calib.numel() < 2:
        calib = ids[:n_tokens]  # a text too short for a disjoint calibration slice
    step = window - (bos is not None)
    return [_with_bos(calib[i:i + step], bos)[None] for i in range(0, calib.numel(), step)]


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF model folder, or a bundled model: smollm2 (the default) or gemma3")
    parser.add_argument("--text", required=True, help="UTF-8 text file")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    added = set()
    for scheme in registered_schemes():  # each scheme's own options (its config's cli_options)
        for flag, _field, options in config_class(scheme).cli_options:
            if flag not in added:  # schemes may share one (a group size)
                parser.add_argument(flag, **options)
                added.add(flag)
    parser.add_argument("--calib-tokens", type=int, default=2048,
                        help="calibration tokens taken after the evaluated ones (ffl-eval-ppl: 0 = quantize "
                             "without calibration data, as quantize(model, scheme) does)")
    parser.add_argument("--skip", nargs="*", default=[],
                        help="more fnmatch patterns of layers to keep in high precision (e.g. from the report)")
    parser.add_argument("--quantize-embeddings", action="store_true",
                        help="also quantize the embedding and lm_head (int8: a tied pair shares one int8 table)")
    parser.add_argument("--json", help="write the results here as JSON")


def _mixed_summary(model) -> dict:
    """For "int4-mixed": the average stored bits per weight and the layers per format."""
    from .quantizer import STATE_ATTR

    plan = getattr(model, STATE_ATTR, {}).get("mixed")
    if plan is None:
        return {}
    formats: dict[str, int] = {}
    for label in plan["formats"].values():
        formats[label] = formats.get(label, 0) + 1
    return {"bpw": plan["bpw"], "budget_bpw": plan["budget_bpw"], "formats": formats, "ranked_by": plan["error"]}


def _linear_counts(model) -> dict:
    """How many linears ended up in each form: per scheme, w8a8 split into static and dynamic
    activation scales, and "high precision" for those quantize kept (embeddings not counted)."""
    from torch import nn

    from .quantizer import STATE_ATTR, quantized_modules

    counts: dict[str, int] = {}
    for m in quantized_modules(model).values():
        counts[m.form()] = counts.get(m.form(), 0) + 1
    kept = getattr(model, STATE_ATTR, {}).get("kept", {})
    counts["high precision"] = sum(isinstance(model.get_submodule(n), nn.Linear) for n in kept)
    return counts


def _quantized(model, config, calibration_data, args):
    """`model` quantized as quantize() does, or with --optimize as optimize(model, quant=...) does."""
    if args.optimize:
        from ..api import optimize

        return optimize(model, quant=config, calibration_data=calibration_data, max_seq_len=args.window)
    from .quantizer import quantize

    return quantize(model, config, calibration_data=calibration_data)


def eval_ppl_main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Perplexity of a causal LM, high precision vs quantized")
    _common(parser)
    parser.add_argument("--schemes", nargs="*", default=["int8"],
                        help="int8, int4 (or int4-g32/-g64/-g128), w8a8, fp8, or a preset: int8-all, int4-all, "
                             "int4-mixed (a format per layer by measured error, <= 5.0 bits per weight)")
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=WINDOW)
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=[], choices=["int8", "fp8"],
                        help="also the unquantized model with its KV cache stored in these formats (and, for "
                             "comparison, in the model's dtype), through fastflow attention over a static cache")
    parser.add_argument("--gptq", action="store_true",
                        help="int4/int8: GPTQ rounding calibrated on the --calib-tokens tokens after the evaluated "
                             f"ones (default {GPTQ_CALIB_TOKENS} with --gptq)")
    parser.add_argument("--backend", choices=["torch", "onnxruntime"], default="torch",
                        help="onnxruntime: also export each model (export_onnx, float32 only) and measure the same "
                             "windows through ONNX Runtime, next to PyTorch's figure")
    parser.add_argument("--onnx-accuracy-level", type=int, default=4, choices=[0, 1, 4],
                        help="MatMulNBits' accuracy_level of the exports (4: int8 activations, the default)")
    parser.add_argument("--optimize", action="store_true",
                        help="quantize through ffl_backend.optimize(model, quant=..., calibration_data=...) and "
                             "measure that model (fastflow attention on a static cache) instead of quantize()'s")
    parser.set_defaults(calib_tokens=None)  # 2048, or GPTQ_CALIB_TOKENS with --gptq
    args = parser.parse_args(argv)
    if args.backend == "onnxruntime" and args.dtype != "float32":
        parser.error("--backend onnxruntime needs --dtype float32 (ONNX Runtime's CPU kernels have no bfloat16)")
    calib_tokens = args.calib_tokens if args.calib_tokens is not None else (GPTQ_CALIB_TOKENS if args.gptq else 2048)
    base, tokenizer = _load(args)
    ids, bos = _tokens(tokenizer, args.text)
    eval_ids = ids[:args.max_tokens]
    calib = _calibration(ids, eval_ids.numel(), calib_tokens, args.window, bos) if calib_tokens else None
    results = [{"model": f"high precision ({args.dtype})", "ppl": perplexity(base, eval_ids, args.window, bos)}]
    if args.backend == "onnxruntime":
        results[0].update(onnxruntime_perplexity(base, eval_ids, args.window, bos, results[0]["ppl"],
                                                 args.onnx_accuracy_level))
    if args.kv_cache_dtypes:
        results += kv_cache_rows(base, eval_ids, args.window, bos, args.kv_cache_dtypes)
    for scheme in args.schemes:
        start = time.perf_counter()
        model = _quantized(copy.deepcopy(base), _config(args, scheme), calib, args)
        ppl = perplexity(model, eval_ids, args.window, bos)
        results.append({"model": scheme + (" gptq" if args.gptq else "") + (" via optimize()" if args.optimize else ""),
                        "ppl": ppl,
                        "seconds": round(time.perf_counter() - start, 1), "linears": _linear_counts(model)})
        results[-1].update(_mixed_summary(model))
        if args.backend == "onnxruntime":
            results[-1].update(onnxruntime_perplexity(model, eval_ids, args.window, bos, ppl,
                                                         args.onnx_accuracy_level))
        del model
    ref = results[0]["ppl"]
    print(f"{eval_ids.numel()} tokens, {args.window}-token windows" + (", each starting with BOS" if bos else ""))
    for r in results:
        r["delta_pct"] = round(100.0 * (r["ppl"] / ref - 1.0), 3)
        counts = ", ".join(f"{n} {k}" for k, n in r.get("linears", {}).items())
        print(f"{r['model']:<28} ppl {r['ppl']:8.3f}  ({r['delta_pct']:+.2f}%)"
              + (f"  top-1 = model-dtype cache: {r['top1_agreement_pct']}%" if "top1_agreement_pct" in r else "")
              + (f"  linears: {counts}" if counts else "") + (f"  {r['bpw']} bits/weight" if "bpw" in r else "")
              + (f"  onnxruntime ppl {r['onnxruntime_ppl']:.3f} ({r['onnxruntime_vs_torch_pct']:+.3f}% of "
                 f"PyTorch's)" if "onnxruntime_ppl" in r else ""))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": environment(), "command": " ".join(["ffl-eval-ppl", *sys.argv[1:]]),
                       "tokens": eval_ids.numel(), "window": args.window,
                       "bos_per_window": bos is not None, "results": results}, fh, indent=1)
    return 0


def quant_report_main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Per-layer quantization error report (worst first)")
    _common(parser)
    parser.add_argument("--scheme", default="int8", help="int8, int4 (or int4-g32...), w8a8, fp8")
    parser.add_argument("--target", type=float, default=25.0, help="target output SQNR in dB")
    parser.add_argument("--max-tokens", type=int, default=256, help="calibration rows kept per layer")
    parser.add_argument("--limit", type=int, default=None, help="print only the worst N layers")
    args = parser.parse_args(argv)
    from .layer_report import format_table, report

    model, tokenizer = _load(args)
    ids, bos = _tokens(tokenizer, args.text)
    rep = report(model, _config(args, args.scheme), _calibration(ids, 0, args.calib_tokens, bos=bos),
                 target_sqnr=args.target, max_tokens=args.max_tokens)
    print(format_table(rep, args.limit))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": environment(), **rep}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(eval_ppl_main())
