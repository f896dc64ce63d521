"""How often `optimize()`'s bf16 and quantized SmolLM2 pick the same greedy tokens as bf16 eager.

For each variant -- bf16 weights ("bf16"), bf16 weights over an int8 or fp8 KV cache ("kv-int8",
"kv-fp8"), int8 and int4 weights ("int8", "int4-all") -- the share of NEW_TOKENS new tokens after each
of PROMPTS (ffl_backend/bench/agreement.py) that equal unpatched bf16 eager's (HF defaults), and where
each row first leaves eager's path, with eager's own top-2 logit margin there (a small margin: a tie
that any rounding may break).

    .venv/bin/python benchmarks/greedy_agreement.py --out greedy_agreement_smollm2_cpu_<cpu>

Writes benchmarks/results/<--out>.json with machine and versions. This is a measurement, not a test:
tests/test_optimize.py keeps the bf16 and kv-int8 rows as a check whose tolerance comes from their
rounding; the quantized rows' agreement depends on the model and the text, so it lives here.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"bf16": {}, "kv-int8": {"kv_cache_dtype": "int8"}, "kv-fp8": {"kv_cache_dtype": "fp8"},
            "int8": {"quant": "int8"}, "int4-all": {"quant": "int4-all"}}


def measure(variant: str, load, reference: tuple) -> dict:
    import ffl_backend
    from ffl_backend.bench.agreement import first_divergence, greedy_rows

    rows, eager, logits = reference
    model, _ = load(torch.bfloat16)
    # mode "default": optimize()'s kernels and numerics ("reduce-overhead" adds the C++ wrapper only)
    ffl_backend.optimize(model, max_seq_len=64, mode="default", **VARIANTS[variant])
    fast = greedy_rows(model, rows)
    same = sum(int((a == b).sum()) for a, b in zip(fast, eager))
    divergences = []
    for f, e, lg in zip(fast, eager, logits):
        i = first_divergence(f, e)
        margin = None if i == len(e) else round(float(lg[i, e[i]] - lg[i, f[i]]), 4)
        divergences.append({"first_divergence": i, "eager_margin_there": margin})
    return {"variant": variant, "agreement": round(same / sum(len(e) for e in eager), 3), "agreeing_tokens": same,
            "tokens": sum(len(e) for e in eager), "rows": divergences}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results file name under benchmarks/results/ (no suffix)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    import ffl_backend
    from ffl_backend.bench.agreement import NEW_TOKENS, PROMPTS, reference_rows
    from ffl_backend.bench.grid import environment

    reference = reference_rows(*ffl_backend.load_smollm2(torch.bfloat16))
    results = []
    for variant in args.variants:
        results.append(measure(variant, ffl_backend.load_smollm2, reference))
        r = results[-1]
        print(f"{variant:<9} agreement {r['agreement']:.2f} ({r['agreeing_tokens']}/{r['tokens']}); first "
              f"divergences {[row['first_divergence'] for row in r['rows']]}", flush=True)
    out = ROOT / "benchmarks" / "results" / f"{args.out}.json"
    command = f"python benchmarks/greedy_agreement.py --out {args.out}"
    out.write_text(json.dumps({"environment": environment(), "model": "SmolLM2-135M", "reference": "bf16 eager",
                               "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "command": command,
                               "results": results}, indent=1))


if __name__ == "__main__":
    main()
