"""How long `quantize()` takes per int4 grid, on a bundled model (bf16), one process, nothing else running:

- int4, [min, max] grid (`grid="minmax"`);
- int4, fitted grid without calibration data (the default of `quantize(model, "int4")`);
- int4, fitted grid weighted by 2,048 calibration tokens (what `ffl-eval-ppl` does);
- "int4-mixed" with the same calibration tokens (per-layer costs measured, then quantized).

    .venv/bin/python benchmarks/quantize_time.py --model gemma3 --out quantize_time_gemma3_<cpu>

Each configuration quantizes a fresh copy of the model loaded once; writes benchmarks/results/<--out>.json
with machine and versions.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "prideprejudice.txt"
CALIB_TOKENS = 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3", choices=("smollm2", "gemma3"))
    parser.add_argument("--out", required=True, help="results file name under benchmarks/results/ (no suffix)")
    args = parser.parse_args()
    import ffl_backend
    from ffl_backend.bench.grid import environment
    from ffl_backend.models import BUNDLED
    from ffl_backend.quant.cli import _calibration, _tokens

    base, tokenizer = BUNDLED[args.model].load(dtype=torch.bfloat16)
    ids, bos = _tokens(tokenizer, str(TEXT))
    calib = _calibration(ids, 0, CALIB_TOKENS, bos=bos)
    configs = [("int4 minmax", {"scheme": "int4", "grid": "minmax"}, None),
               ("int4 fitted, no calibration data", "int4", None),
               (f"int4 fitted, {CALIB_TOKENS} calibration tokens", "int4", calib),
               (f"int4-mixed, {CALIB_TOKENS} calibration tokens", "int4-mixed", calib)]
    rows = []
    for label, config, data in configs:
        model = copy.deepcopy(base)
        start = time.perf_counter()
        ffl_backend.quantize(model, config, calibration_data=data)
        rows.append({"config": label, "seconds": round(time.perf_counter() - start, 2)})
        print(f"{label:<45} {rows[-1]['seconds']:7.2f} s", flush=True)
        del model
    out = ROOT / "benchmarks" / "results" / f"{args.out}.json"
    out.write_text(json.dumps({"environment": environment(), "model": args.model, "dtype": "bfloat16",
                               "command": f"python benchmarks/quantize_time.py --model {args.model} --out {args.out}",
                               "results": rows}, indent=1))


if __name__ == "__main__":
    main()
