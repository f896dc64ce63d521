"""How Gemma-3-270M's perplexity answers int4 formats per layer kind, and how much of it is noise.

    .venv/bin/python benchmarks/gemma3_int4_sensitivity.py [--tokens 8192] --out gemma3_int4_sensitivity_<cpu>

Perplexity (512-token windows, the first --tokens tokens of the bundled text, bf16) of:
- int4 groups of 32 everywhere, of 64 everywhere, and 64 on one part (attention, MLP, q/k, v, o)
  with 32 elsewhere;
- int8 for one kind (v_proj, k_proj) with int4 groups of 32 elsewhere;
- the bf16 model with Gaussian noise of 1% and 10% of each v_proj weight's std added, two seeds
  each: the spread a perplexity shows for noise of one size.
Writes benchmarks/results/<--out>.json with machine and versions.
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "prideprejudice.txt"
HEAD = ("lm_head", "*embed*")


def int4(group: int, include=("*",)):
    from ffl_backend.quant.schemes import QuantConfig

    return QuantConfig(scheme="int4", group_size=group, include=include, skip=HEAD)


def int8(include):
    from ffl_backend.quant.schemes import QuantConfig

    return QuantConfig(scheme="int8", include=include, skip=HEAD)


VARIANTS = {  # each a list of quantize steps: the first that selects a layer quantizes it
    "int4 g32 everywhere": [int4(32)],
    "int4 g64 everywhere": [int4(64)],
    "g64 attention, g32 MLP": [int4(64, ("*self_attn*",)), int4(32)],
    "g64 MLP, g32 attention": [int4(64, ("*mlp*",)), int4(32)],
    "g64 q_proj + k_proj, g32 rest": [int4(64, ("*q_proj", "*k_proj")), int4(32)],
    "g64 v_proj, g32 rest": [int4(64, ("*v_proj",)), int4(32)],
    "g64 o_proj, g32 rest": [int4(64, ("*o_proj",)), int4(32)],
    "int8 v_proj, g32 rest": [int8(("*v_proj",)), int4(32)],
    "int8 k_proj, g32 rest": [int8(("*k_proj",)), int4(32)],
}


def with_noise(model, suffix: str, relative: float, seed: int):
    noisy = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in noisy.named_parameters():
            if name.endswith(suffix + ".weight"):
                w = p.float()
                p.copy_((w + torch.randn(w.shape, generator=gen) * w.std() * relative).to(p.dtype))
    return noisy


def main(argv=None):
    import ffl_backend
    from ffl_backend.bench import environment
    from ffl_backend.quant.cli import _tokens, perplexity

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", required=True, help="results file name without .json, naming the CPU")
    args = parser.parse_args(argv)
    env = environment()
    model, tok = ffl_backend.load_gemma3(torch.bfloat16)
    ids = _tokens(tok, str(TEXT))[:args.tokens]
    base = perplexity(model, ids)
    rows = [{"model": "bf16", "ppl": base, "delta_pct": 0.0}]

    def add(name, m):
        ppl = perplexity(m, ids)
        rows.append({"model": name, "ppl": round(ppl, 3), "delta_pct": round(100 * (ppl / base - 1), 2)})
        print(rows[-1], flush=True)

    for name, steps in VARIANTS.items():
        add(name, ffl_backend.quantize(copy.deepcopy(model), steps))
    for relative in (0.01, 0.1):
        for seed in (1, 2):
            add(f"bf16 + {relative:g} x std noise on v_proj, seed {seed}", with_noise(model, "v_proj", relative, seed))
    out = {"machine": env, "model": "gemma-3-270m (bundled), bfloat16", "tokens": int(ids.numel()), "window": 512,
           "results": rows}
    path = ROOT / "benchmarks" / "results" / f"{args.out}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
