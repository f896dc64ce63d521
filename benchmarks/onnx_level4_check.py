"""Why export_onnx checks accuracy level 4 layer by layer (ffl_backend/onnx/check.py), measured.

Exports a model quantized with --quant at level 4 (MatMulNBits quantizes activations to int8 per
block) and compares, over a 7-token prompt and two decode steps:
- at the logits: ONNX Runtime at level 4 against PyTorch at level 4 (nbits' reference); PyTorch at
  level 4 against level 0 (all the rounding does); ONNX Runtime against PyTorch at level 0 (what an
  export that skipped the rounding would be compared with); and PyTorch at level 4 against itself with
  every activation moved by about one fp32 ulp before rounding (what two exact implementations may
  differ by);
- layer by layer: the largest error / bound ratio of the MatMulNBits nodes on their own inputs, for
  the export as written and for the same graph with its nodes at level 0 (an export that skipped it).

    .venv/bin/python benchmarks/onnx_level4_check.py --out onnx_level4_check_smollm2_cpu_<cpu>

Writes benchmarks/results/<--out>.json with machine and versions.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def largest(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def dithered_reference(model, ids, seeds: int = 3) -> list:
    """PyTorch at level 4, each activation multiplied by (1 + 2^-24 n), n standard normal, before rounding."""
    from ffl_backend.onnx import check, nbits

    plain, runs = nbits.round_activations, []
    try:
        for seed in range(seeds):
            torch.manual_seed(seed)
            nbits.round_activations = lambda x, block: plain(x * (1 + 2.0 ** -24 * torch.randn_like(x)), block)
            runs.append(check.reference_steps(model, ids, 2, 4))
    finally:
        nbits.round_activations = plain
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results file name under benchmarks/results/ (no suffix)")
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3"])
    parser.add_argument("--quant", default="int4-all")
    args = parser.parse_args()
    import onnx

    import ffl_backend
    from ffl_backend.bench.grid import environment
    from ffl_backend.onnx import check, export_onnx
    from ffl_backend.onnx.runtime import OnnxCausalLM

    model, tokenizer = (ffl_backend.load_smollm2 if args.model == "smollm2" else ffl_backend.load_gemma3)(torch.float32)
    folder = Path(tempfile.mkdtemp(prefix="ffl-onnx-level4-"))
    try:
        export_onnx(model, folder, quant=args.quant, tokenizer=tokenizer, check=False, fuse=True)
        ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
        session = OnnxCausalLM(folder)
        ort4 = check._steps(lambda s, p: check._onnx_step(session, s, p), ids, 2)
        torch4, torch0 = check.reference_steps(model, ids, 2, 4), check.reference_steps(model, ids, 2, 0)
        logits = {"ort4_vs_torch4": largest(ort4, torch4), "torch4_vs_torch0": largest(torch4, torch0),
                  "ort4_vs_torch0": largest(ort4, torch0),
                  "torch4_dithered_vs_torch4": max(largest(d, torch4) for d in dithered_reference(model, ids)),
                  "largest_logit": max(float(t.abs().max()) for t in torch4)}
        nodes, ratio = check.check_layers(folder, ids)
        graph = onnx.load(str(folder / "model.onnx"), load_external_data=False)
        for node in check.nbits_nodes(graph.graph):
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    attr.i = 0
        onnx.save(graph, str(folder / "model.onnx"))
        try:
            check.check_layers(folder, ids)
            skipped = "passed"
        except RuntimeError as exc:
            skipped = str(exc)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {"environment": environment(), "model": args.model, "quant": args.quant, "logits_max_abs_diff": logits,
              "layers": {"nodes": nodes, "worst_error_over_bound": round(ratio, 3),
                         "the_graph_at_level_0_checked_as_level_4": skipped},
              "command": f"python benchmarks/onnx_level4_check.py --out {args.out} --model {args.model} "
                         f"--quant {args.quant}"}
    print(json.dumps({k: result[k] for k in ("logits_max_abs_diff", "layers")}, indent=1))
    (ROOT / "benchmarks" / "results" / f"{args.out}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
