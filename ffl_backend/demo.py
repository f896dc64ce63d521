"""The README demo: SmolLM2-135M generating through fastflow, and its decode speed next to Inductor.

    python -m ffl_backend.demo [--dtype float32|bfloat16] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import logging
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", default="The capital of France is")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("torch").setLevel(logging.WARNING)

    import torch

    from .bench import run_grid, table, time_generate
    from .generation import configure_generate
    from .models import load_smollm2, smollm2_path

    model, tok = load_smollm2(dtype=getattr(torch, args.dtype))
    configure_generate(model, backend="fastflow")
    ids = tok(args.prompt, return_tensors="pt").input_ids
    print(f"\n>>> {args.prompt}", flush=True)
    run = time_generate(model, ids, args.new_tokens)  # first call compiles the decode step
    print(tok.decode(run["tokens"], skip_special_tokens=True))

    print("\nDecode speed, batch 1, greedy (each backend in its own process):", flush=True)
    grid = run_grid(str(smollm2_path()), backends=("inductor", "fastflow"), dtypes=(args.dtype,),
                    new_tokens=args.new_tokens, repeats=2, warm_compile=False)  # the demo times decode only
    print(table(grid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
