"""How often `optimize()`'s bf16 and quantized SmolLM2 pick the same greedy tokens as bf16 eager, and
whether the rounding model of tests/test_smollm2_variants.py explains every place they part.

For each variant -- bf16 weights ("bf16"), bf16 weights over an int8 or fp8 KV cache ("kv-int8",
"kv-fp8"), int8 and int4 weights ("int8", "int4-all") -- over PROMPTS (ffl_backend/bench/agreement.py):
- agreement: the share of NEW_TOKENS new tokens equal to unpatched bf16 eager's (HF defaults), and
  where each row first leaves eager's path;
- divergences: every position where the variant's token is not eager's argmax on the variant's own
  prefix, with eager's gap there, the shift its quantized weights predict, the sigma of its bf16 /
  KV-cache rounding and the number of sigmas needed (ffl_backend/bench/divergence.py);
- calibration: the same model checked at every position of eager's own tokens fed through the
  variant (`divergence.calibration`): the standard deviation and the largest magnitude of the
  unexplained change of eager's top-2 gap, in sigmas.

    .venv/bin/python benchmarks/greedy_agreement.py --out greedy_agreement_smollm2_cpu_<cpu>

Writes benchmarks/results/<--out>.json with machine and versions. A measurement, not a test: the test
(tests/test_smollm2_variants.py) keeps the bars and the rule.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"bf16": {}, "kv-int8": {"kv_cache_dtype": "int8"}, "kv-fp8": {"kv_cache_dtype": "fp8"},
            "int8": {"quant": "int8"}, "int4-all": {"quant": "int4-all"}}
KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def measure(variant: str, eager, rows: list, reference: list, calibrate: bool) -> dict:
    import ffl_backend
    from ffl_backend.bench.agreement import first_divergence, greedy_rows
    from ffl_backend.bench.divergence import RoundingModel, calibration, divergences

    settings = VARIANTS[variant]
    model, _ = ffl_backend.load_smollm2(torch.bfloat16)
    # mode "default": optimize()'s kernels and numerics ("reduce-overhead" adds the C++ wrapper only)
    ffl_backend.optimize(model, max_seq_len=64, mode="default", **settings)
    fast = greedy_rows(model, rows)
    same = sum(int((a == b).sum()) for a, b in zip(fast, reference))
    rounding = RoundingModel(eager, model if "quant" in settings else None,
                             kv_dtype=KV_DTYPES.get(settings.get("kv_cache_dtype")))
    found = list(divergences(eager, rows, fast, rounding))
    result = {"variant": variant, "agreement": round(same / sum(len(e) for e in reference), 3),
              "agreeing_tokens": same, "tokens": sum(len(e) for e in reference),
              "first_divergences": [first_divergence(f, e) for f, e in zip(fast, reference)],
              "divergences": [{"row": d.row, "index": d.index, "gap": round(d.gap, 4), "shift": round(d.shift, 4),
                               "sigma": round(d.sigma, 4), "sigmas": round(d.z, 2)} for d in found]}
    if calibrate:
        z = calibration(eager, model, rows, reference, rounding)
        result["calibration"] = {"positions": len(z), "std_sigmas": round(statistics.pstdev(z), 3),
                                 "max_abs_sigmas": round(max(abs(v) for v in z), 2)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results file name under benchmarks/results/ (no suffix)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--no-calibration", action="store_true", help="skip the per-position check (a backward "
                        "pass per position: minutes)")
    args = parser.parse_args()
    import ffl_backend
    from ffl_backend.bench.agreement import NEW_TOKENS, PROMPTS, greedy_rows
    from ffl_backend.bench.divergence import K_SIGMA
    from ffl_backend.bench.grid import environment

    eager, tokenizer = ffl_backend.load_smollm2(torch.bfloat16)
    rows = [tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
    reference = greedy_rows(eager, rows)
    results = []
    for variant in args.variants:
        results.append(measure(variant, eager, rows, reference, not args.no_calibration))
        r = results[-1]
        worst = max((d["sigmas"] for d in r["divergences"]), default=None)
        print(f"{variant:<9} agreement {r['agreement']:.2f} ({r['agreeing_tokens']}/{r['tokens']}); "
              f"{len(r['divergences'])} divergences, worst {worst} sigma"
              + (f"; calibration std {r['calibration']['std_sigmas']}, max |z| {r['calibration']['max_abs_sigmas']}"
                 if "calibration" in r else ""), flush=True)
    out = ROOT / "benchmarks" / "results" / f"{args.out}.json"
    command = "python benchmarks/greedy_agreement.py " + " ".join(
        [f"--out {args.out}", *(["--no-calibration"] if args.no_calibration else [])])
    out.write_text(json.dumps({"environment": environment(), "model": "SmolLM2-135M", "reference": "bf16 eager",
                               "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "k_sigma": K_SIGMA,
                               "command": command, "results": results}, indent=1))


if __name__ == "__main__":
    main()
