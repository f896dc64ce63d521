"""The README demo: SmolLM2-135M generating through `ffl_backend.optimize`, then its decode speed next
to the best Inductor row of this machine (fp32 and bf16 both run: which one is faster depends on the
CPU) and llama.cpp where llama-cpp-python is installed.

    python -m ffl_backend.demo [--dtype bfloat16|float32] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import logging
import sys


def headline(grid: dict, dtype: str) -> str:
    """fastflow's row of `dtype` against the fastest Inductor row of any dtype and against llama.cpp."""
    rows = [r for r in grid["results"] if "decode_tok_s" in r and "error" not in r]
    ours = next((r for r in rows if r["backend"] == "fastflow" and r["dtype"] == dtype), None)
    inductor = max((r for r in rows if r["backend"] == "inductor"), key=lambda r: r["decode_tok_s"], default=None)
    if ours is None or inductor is None:
        return "fastflow or Inductor did not finish: see the table"
    text = (f"fastflow {dtype}: {ours['decode_tok_s']:.1f} tok/s = "
            f"{ours['decode_tok_s'] / inductor['decode_tok_s']:.2f}x "
            f"the fastest Inductor row here ({inductor['dtype']}, {inductor['decode_tok_s']:.1f} tok/s)")
    llama = next((r for r in rows if r["backend"] == "llamacpp" and r["dtype"] == dtype), None)
    if llama is not None:
        text += (f", {ours['decode_tok_s'] / llama['decode_tok_s']:.2f}x llama.cpp {llama.get('gguf_type', '')} "
                 f"({llama['decode_tok_s']:.1f} tok/s)")
    return text + " (ratios of medians)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", default="The capital of France is")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("torch").setLevel(logging.WARNING)

    import torch

    from .api import optimize
    from .bench import run_grid, table, time_generate
    from .bench.llamacpp import import_error
    from .models import load_smollm2, smollm2_path

    model, tok = load_smollm2(dtype=getattr(torch, args.dtype))
    optimize(model)
    ids = tok(args.prompt, return_tensors="pt").input_ids
    print(f"\n>>> {args.prompt}", flush=True)
    run = time_generate(model, ids, args.new_tokens)  # the first call compiles the decode step
    print(tok.decode(run["tokens"], skip_special_tokens=True))

    backends = ("inductor", "fastflow") + (("llamacpp",) if import_error() is None else ())
    print(f"\nDecode speed, batch 1, greedy ({', '.join(backends)}; each in its own process, interleaved):",
          flush=True)
    grid = run_grid(str(smollm2_path()), backends=backends, dtypes=("float32", "bfloat16"),
                    new_tokens=args.new_tokens, repeats=3, warm_compile=False)  # the demo times decode only
    print(table(grid))
    print("\n" + headline(grid, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
