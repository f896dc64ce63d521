"""Quantizing a big model end to end, and loading the saved checkpoint: seconds and peak RSS.

    # once: quantize a high-precision folder (timed: quantize() alone, end to end) and save it
    .venv/bin/python benchmarks/load_time.py make --source ~/.cache/ffl_backend/llama-3.2-3b-random \
        --scheme int4-all --checkpoint ~/.cache/ffl_backend/llama-3.2-3b-int4-all-ckpt --out quantize_3b_int4_<cpu>
    # then, each in a fresh process: load_quantized's seconds and peak RSS above the runtime
    .venv/bin/python benchmarks/load_time.py load --checkpoint ~/.cache/ffl_backend/llama-3.2-3b-int4-all-ckpt \
        --out load_3b_int4_<cpu>

`load` runs in its own process and measures there: RSS right after `import torch, transformers,
ffl_backend` (the runtime), the wall time of `load_quantized` (file pages warm in the page cache: a
first read after boot also waits for the disk, as llama.cpp's would), and the peak RSS of the process
(VmHWM, what `/usr/bin/time -v` reports as "Maximum resident set size"), above the runtime, against
the checkpoint's weight bytes (model.safetensors less its header). `--warm-imports` first imports
what a first load imports (ffl_backend.quant with its ops -- torch.library.triton_op imports
torch._inductor -- transformers' quantizer registry and the model's modeling code; ~1.5-2 s here),
timed apart, so that load_s is the load itself. `--generate N` then decodes N
greedy tokens (eager) as a smoke check that the loaded model runs, and reports the RSS after it.
`--repeats` loads that many times in the one process, the first load's figures being the ones that
count for memory (a later load's peak includes the model before it).

`make` quantizes with `ffl_backend.quantize(model, scheme)` after `from_pretrained` (bf16, mapped):
seconds per billion quantized weights, end to end (every quantized module's build, the sibling
sharing, the page-outs), then `save_quantized`. Hold one big model at a time: the machine this ran
on has 24 GiB, other work beside it.

Writes benchmarks/results/<--out>.json with machine and versions.
"""
from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status(field: str) -> int:
    """A /proc/self/status memory field in bytes (VmRSS, VmHWM, RssFile, RssAnon)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _weight_bytes(checkpoint: Path) -> int:
    path = checkpoint / "model.safetensors"
    with open(path, "rb") as fh:
        header = int.from_bytes(fh.read(8), "little")
    return path.stat().st_size - 8 - header


def _quantized_weights(model) -> int:
    """Weights quantized: every quantized module's, a tied embedding (reading its head's table) once."""
    from ffl_backend.quant.modules import Int8Embedding
    from ffl_backend.quant.quantizer import quantized_modules

    modules = quantized_modules(model).values()
    linears = [m for m in modules if not isinstance(m, Int8Embedding)]
    tables = {m.qweight.untyped_storage().data_ptr() for m in linears}
    return (sum(m.in_features * m.out_features for m in linears)
            + sum(m.num_embeddings * m.embedding_dim for m in modules
                  if isinstance(m, Int8Embedding) and m.qweight.untyped_storage().data_ptr() not in tables))


def make(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import ffl_backend
    from ffl_backend.quant import save_quantized

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.bfloat16).eval()
    loaded_s = time.perf_counter() - start
    start = time.perf_counter()
    ffl_backend.quantize(model, args.scheme)
    quantize_s = time.perf_counter() - start
    weights = _quantized_weights(model)
    peak = _status("VmHWM")
    start = time.perf_counter()
    save_quantized(model, args.checkpoint)
    save_s = time.perf_counter() - start
    row = {"source": str(args.source), "scheme": args.scheme, "from_pretrained_s": round(loaded_s, 2),
           "quantize_s": round(quantize_s, 2), "billion_weights_quantized": round(weights / 1e9, 3),
           "quantize_s_per_billion": round(quantize_s / weights * 1e9, 2), "save_s": round(save_s, 2),
           "peak_rss_gb_through_quantize": round(peak / 1e9, 3), "checkpoint": str(args.checkpoint),
           "checkpoint_weight_gb": round(_weight_bytes(Path(args.checkpoint)) / 1e9, 3)}
    print(json.dumps(row), flush=True)
    return row


def load(args) -> dict:
    import torch
    import transformers  # noqa: F401  (the runtime, as a user has it before loading)

    import ffl_backend

    runtime = _status("VmRSS")
    imports_s = None
    if args.warm_imports:  # what a first load imports (ffl_backend.quant and its ops, the model's code)
        start = time.perf_counter()
        from transformers import AutoConfig, AutoModelForCausalLM

        from ffl_backend.quant import register_with_transformers

        assert callable(ffl_backend.load_quantized)  # ffl_backend's lazy attribute: imports quant/ and its ops
        register_with_transformers()
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.checkpoint))
        imports_s = round(time.perf_counter() - start, 3)
    rows = []
    model = None
    for _ in range(args.repeats):
        del model
        start = time.perf_counter()
        model = ffl_backend.load_quantized(args.checkpoint)
        rows.append(round(time.perf_counter() - start, 3))
    peak = max(_status("VmHWM"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    weight = _weight_bytes(Path(args.checkpoint))
    row = {"checkpoint": str(args.checkpoint), "load_s": rows, "imports_before_load_s": imports_s,
           "runtime_rss_gb": round(runtime / 1e9, 3),
           "peak_rss_gb": round(peak / 1e9, 3), "peak_above_runtime_gb": round((peak - runtime) / 1e9, 3),
           "checkpoint_weight_gb": round(weight / 1e9, 3),
           "peak_above_runtime_over_weight_bytes": round((peak - runtime) / weight, 3),
           "rss_after_load_gb": round(_status("VmRSS") / 1e9, 3), "rss_file_after_load_gb": round(
               _status("RssFile") / 1e9, 3)}
    if args.generate:
        ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.generate, do_sample=False)
        peak = _status("VmHWM")
        row.update(generate_s=round(time.perf_counter() - start, 2), tokens=out[0, ids.shape[1]:].tolist(),
                   rss_after_generate_gb=round(_status("VmRSS") / 1e9, 3),
                   peak_above_runtime_through_generate_gb=round((peak - runtime) / 1e9, 3),
                   peak_through_generate_over_weight_bytes=round((peak - runtime) / weight, 3))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    m = sub.add_parser("make")
    m.add_argument("--source", required=True)
    m.add_argument("--scheme", default="int4-all")
    m.add_argument("--checkpoint", required=True)
    lo = sub.add_parser("load")
    lo.add_argument("--checkpoint", required=True)
    lo.add_argument("--repeats", type=int, default=1)
    lo.add_argument("--generate", type=int, default=0, help="greedy tokens to decode after loading (0: none)")
    lo.add_argument("--warm-imports", action="store_true",
                    help="import what a first load imports before timing it (timed apart as imports_before_load_s)")
    for p in (m, lo):
        p.add_argument("--out", help="results file name under benchmarks/results/ (no suffix); none: print only")
    args = parser.parse_args()
    args.checkpoint = Path(args.checkpoint).expanduser()
    row = make(args) if args.what == "make" else load(args)
    if args.out:
        from ffl_backend.bench.outputs import write_script_results

        write_script_results(ROOT / "benchmarks" / "results" / f"{args.out}.json", "benchmarks/load_time.py",
                             results=row)

if __name__ == "__main__":
    main()
