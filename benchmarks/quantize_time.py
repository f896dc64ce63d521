"""How long quantizing takes, in seconds per billion weights (--shapes) or per bundled model (--model).

--shapes llama-3.2-3b llama-3.1-8b: random bf16 weights shaped like those models' linears, per scheme
  - int8: every decoder linear int8 per row (the embedding and head stay bf16, the "int8" default);
  - int4 minmax: every decoder linear int4 in groups of 32 on its [min, max] grid;
  - int4-all: what `optimize(quant="int4-all")` does: decoder linears int4 g32 on fitted grids (no
    calibration data), then the head -- and an untied embedding -- int8.
  To keep memory low, one decoder layer's seven linears and the head are timed and the model's time
  is scaled from them by parameter count (layers x the layer + the head and embedding as the scheme
  quantizes them); the file says so. Two figures per scheme: the quantizers alone (kernels/
  cpu_quantize.py) and the modules as quantize() builds them (`from_linear`: quantizing, packing,
  the CPU kernels' forms). Outputs are checked against the pure-torch reference before timing.
  --busy: one CPU-bound process (a Python busy loop) runs beside it throughout.
  --reference: the same with the pure-torch reference (the path before the C++ quantizers), once.
--model smollm2|gemma3: seconds `quantize()` takes on a bundled model (bf16): int4 [min, max], int4
  fitted without and with 2,048 calibration tokens, int4-mixed.

    .venv/bin/python benchmarks/quantize_time.py --shapes llama-3.2-3b llama-3.1-8b --out quantize_time_llama_<cpu>
    .venv/bin/python benchmarks/quantize_time.py --model gemma3 --out quantize_time_gemma3_<cpu>

Writes benchmarks/results/<--out>.json with machine and versions.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "prideprejudice.txt"
CALIB_TOKENS = 2048
# hidden, intermediate, decoder layers, q / kv heads, head dim, vocabulary, tied embedding (the published configs)
SHAPES = {"llama-3.2-3b": dict(hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8, head_dim=128,
                               vocab=128256, tied=True),
          "llama-3.1-8b": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
                               vocab=128256, tied=False)}
SCHEMES = ("int8", "int4 minmax", "int4-all")


def layer_linears(s: dict) -> dict:
    """(out, in) of one decoder layer's linears."""
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    return {"q_proj": (q, s["hidden"]), "k_proj": (kv, s["hidden"]), "v_proj": (kv, s["hidden"]),
            "o_proj": (s["hidden"], q), "gate_proj": (s["intermediate"], s["hidden"]),
            "up_proj": (s["intermediate"], s["hidden"]), "down_proj": (s["hidden"], s["intermediate"])}


def _plan(scheme: str, s: dict) -> tuple[str, int]:
    """What the scheme does to the decoder linears, and how many (vocab, hidden) tables it makes int8:
    int4-all quantizes the head, and an untied embedding as a second table (a tied one reads the head's)."""
    if scheme == "int4-all":
        return "int4 fit", 1 if s["tied"] else 2
    return ("int8" if scheme == "int8" else "int4 minmax"), 0


def _quantizer(kind: str):
    """weight -> the quantizer's outputs (the functions quantize() ends in)."""
    from ffl_backend.kernels import cpu_quantize as Q

    return {"int8": Q.quantize_int8, "int4 fit": lambda w: Q.quantize_int4_fitted(w, 32),
            "int4 minmax": lambda w: Q.quantize_int4(w, 32)}[kind]


def _on_weight(kind: str):
    quantize = _quantizer(kind)
    return lambda linear: quantize(linear.weight.detach())


def _module(kind: str):
    from ffl_backend.quant.modules import Int4Linear, Int8Linear
    from ffl_backend.quant.schemes import QuantConfig

    if kind == "int8":
        config = QuantConfig(scheme="int8")
        return lambda linear: Int8Linear.from_linear(linear, config)
    config = QuantConfig(scheme="int4", group_size=32, grid="fit" if kind == "int4 fit" else "minmax")
    return lambda linear: Int4Linear.from_linear(linear, config)


def _seconds(fn, linears) -> float:
    start = time.perf_counter()
    for linear in linears:
        fn(linear)
    return time.perf_counter() - start


@contextlib.contextmanager
def _reference_path(on: bool):
    """With `on`, every quantizer takes its pure-torch reference (the path before the C++ ops)."""
    from ffl_backend.kernels import cpu_quantize

    applies = cpu_quantize.applies
    if on:
        cpu_quantize.applies = lambda w: False
    try:
        yield
    finally:
        cpu_quantize.applies = applies


def _check(kind: str, linears) -> None:
    """The op's output equals the reference's on the first rows of every weight (benchmarks verify first)."""
    quantize = _quantizer(kind)
    for linear in linears:
        w = linear.weight.detach()[:64]
        got = quantize(w)
        with _reference_path(True):
            want = quantize(w)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            raise AssertionError(f"{kind}: the C++ quantizer differs from the reference on {tuple(w.shape)}")


def measure_shape(name: str, repeats: int, reference: bool) -> dict:
    s = SHAPES[name]
    gen = torch.Generator().manual_seed(0)

    def linear(out_f, in_f):
        m = torch.nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16, device="meta")
        m.weight = torch.nn.Parameter(torch.randn(out_f, in_f, generator=gen, dtype=torch.bfloat16) * 0.02,
                                      requires_grad=False)
        return m

    layer = [linear(*shape) for shape in layer_linears(s).values()]
    head = linear(s["vocab"], s["hidden"])
    layer_params, head_params = sum(m.weight.numel() for m in layer), head.weight.numel()
    rows = []
    for scheme in SCHEMES:
        kind, tables = _plan(scheme, s)
        _check(kind, layer)
        if tables:
            _check("int8", [head])
        params = s["layers"] * layer_params + tables * head_params
        row = {"scheme": scheme, "billion_weights_quantized": round(params / 1e9, 3)}
        paths = [("", False)] + ([("reference_", True)] if reference else [])
        for prefix, ref in paths:
            with _reference_path(ref):
                for label, make in (("quantizer", _on_weight), ("module", _module)):
                    runs = []
                    for _ in range(1 if ref else repeats):
                        t = s["layers"] * _seconds(make(kind), layer)
                        t += tables * _seconds(make("int8"), [head]) if tables else 0.0
                        runs.append(t)
                    model_s = statistics.median(runs)
                    row[f"{prefix}{label}_s_per_billion"] = round(model_s / params * 1e9, 2)
                    row[f"{prefix}{label}_model_s"] = round(model_s, 1)
        print(f"{name:<14} {scheme:<12} " + "  ".join(f"{k} {v}" for k, v in row.items() if k.endswith("billion")),
              flush=True)
        rows.append(row)
    return {"shape": name, **s, "decoder_layer_weights": layer_params, "head_weights": head_params,
            "timed": "one decoder layer's 7 linears and the head, each timed per pass; the model's time is "
                     "layers x the layer + the head / untied embedding tables the scheme quantizes",
            "results": rows}


def _busy_process():
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def measure_model(model_name: str) -> list:
    import copy

    import ffl_backend
    from ffl_backend.models import BUNDLED
    from ffl_backend.quant.cli import _calibration, _tokens

    base, tokenizer = BUNDLED[model_name].load(dtype=torch.bfloat16)
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
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--shapes", nargs="+", choices=sorted(SHAPES))
    what.add_argument("--model", choices=("smollm2", "gemma3"))
    parser.add_argument("--out", required=True, help="results file name under benchmarks/results/ (no suffix)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per figure (median)")
    parser.add_argument("--busy", action="store_true", help="run one CPU-bound process beside it")
    parser.add_argument("--reference", action="store_true", help="also time the pure-torch reference, once")
    args = parser.parse_args()
    from ffl_backend.bench.outputs import write_script_results

    busy = _busy_process() if args.busy else None
    try:
        if args.shapes:
            results = [measure_shape(name, args.repeats, args.reference) for name in args.shapes]
        else:
            results = measure_model(args.model)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    write_script_results(ROOT / "benchmarks" / "results" / f"{args.out}.json", "benchmarks/quantize_time.py",
                         dtype="bfloat16", busy_process_beside=args.busy,
                         **({"model": args.model} if args.model else {}), results=results)

if __name__ == "__main__":
    main()
