"""Perplexity through the decode path: the bundled text fed one token per step over a static cache,
the step compiled with fastflow -- so every linear runs the decode GEMV kernels, which `ffl-eval-ppl`
(whole windows at once: the prompt path) never calls. Rows: bf16, and int8 with each value of the
option int8_activations ("float": fp32 FMAs; "int16": activations quantized per row, gemv_q16).

    python benchmarks/ppl_decode_path.py [--tokens 1024] [--window 512] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from ffl_backend.bench.grid import report_row

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "prideprejudice.txt"
ROWS = [("bf16", None, {}), ("int8", "int8", {"int8_activations": "float"}),
        ("int8", "int8", {"int8_activations": "int16"})]


def decode_nll(step, cache_kw: str, cache, ids: torch.Tensor) -> tuple[float, int]:
    """Sum of next-token NLLs over `ids` (1-D), one token per compiled step into `cache` (reset first)."""
    total = 0.0
    with torch.inference_mode():  # the cache's tensors are created in it, so reset there too
        cache.reset()
        for t in range(ids.numel() - 1):
            out = step(input_ids=ids[t:t + 1][None], cache_position=torch.tensor([t]), **{cache_kw: cache})
            total += torch.nn.functional.cross_entropy(out.logits[0, -1].float()[None], ids[t + 1:t + 2]).item()
    return total, ids.numel() - 1


def run_row(name: str, quant, options: dict, ids: torch.Tensor, window: int) -> dict:
    from transformers import StaticCache

    from ffl_backend.generation import cache_kwarg
    from ffl_backend.models import load_smollm2
    from ffl_backend.quant import quantize

    torch._dynamo.reset()
    model, _ = load_smollm2(dtype=torch.bfloat16)
    if quant:
        quantize(model, quant)
    step = torch.compile(model, backend="fastflow", options={"on_error": "raise", **options})
    cache = StaticCache(config=model.config, max_cache_len=window)
    start = time.perf_counter()
    nll, count = 0.0, 0
    for begin in range(0, ids.numel() - 1, window):
        part = decode_nll(step, cache_kwarg(model), cache, ids[begin:begin + window])
        nll, count = nll + part[0], count + part[1]
    return {"row": name, "quant": quant or "none", "options": options, "tokens_scored": count,
            "ppl": round(math.exp(nll / count), 4), "seconds": round(time.perf_counter() - start, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=str(TEXT), help="text file (default: the bundled Pride and Prejudice)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of the text scored")
    p.add_argument("--window", type=int, default=512, help="tokens per static cache fill")
    p.add_argument("--out", help="JSON file to append the result to")
    args = p.parse_args()
    from ffl_backend.models import load_smollm2

    _, tok = load_smollm2(dtype=torch.bfloat16)
    with open(args.text, encoding="utf-8") as fh:
        ids = tok(fh.read(), return_tensors="pt").input_ids[0][:args.tokens]
    rows = [run_row(name, quant, options, ids, args.window) for name, quant, options in ROWS]
    base = rows[0]["ppl"]
    for r in rows:
        r["vs_bf16_pct"] = round(100 * (r["ppl"] / base - 1), 3)
        print(f"{r['row']:5s} {r['options'] or ''}: ppl {r['ppl']} ({r['vs_bf16_pct']:+.3f}%)", file=sys.stderr)
    report_row({"tokens": args.tokens, "window": args.window, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
