"""Export time and peak RSS of `ffl-export-onnx` per model and scheme, each in a fresh process (load,
quantize, export, fusions and the check included; the loaded model's own RSS included).

    python benchmarks/onnx_export_time.py --models smollm2 gemma3 --quant none int4-all \
        --out benchmarks/results/onnx_export_time_cpu_<cpu>.json
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import time


def export_once(model: str, quant: str) -> dict:
    """One export in a child process: wall seconds and the peak RSS the command reports (MiB)."""
    with tempfile.TemporaryDirectory(prefix="ffl-onnx-time-") as out:
        cmd = [sys.executable, "-m", "ffl_backend.onnx.cli", model, out]
        cmd += [] if quant == "none" else ["--quant", quant]
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        lines = done.stdout.splitlines()
        check = next((line for line in lines if line.startswith("ONNX export check")), None)
        peak = re.search(r"peak RSS (\d+) MiB", done.stdout)
        return {"model": model, "quant": quant, "seconds": round(seconds, 1), "returncode": done.returncode,
                "peak_rss_mib": int(peak.group(1)) if peak else None, "check": check,
                "error": done.stderr.strip().splitlines()[-1] if done.returncode else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--quant", nargs="+", default=["none"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for model in args.models:
        for quant in args.quant:
            rows.append(export_once(model, quant))
            print(rows[-1])
    import onnxruntime
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    result = {"cpu": cpu, "cores": torch.get_num_threads(), "torch": torch.__version__,
              "onnxruntime": onnxruntime.__version__, "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(["python", *sys.argv]), "rows": rows}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
