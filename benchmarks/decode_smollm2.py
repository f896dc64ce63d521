"""SmolLM2-135M, batch 1, greedy: decode tok/s of eager, HF static cache + Inductor, and static
cache + fastflow, fp32 and bf16, in one run. Each configuration runs in its own process; greedy
tokens are compared with eager before any speed is reported.

    python benchmarks/decode_smollm2.py [--new-tokens 128] [--repeats 3] [--out benchmarks/results]
"""
import argparse
import json
import os
import sys

from ffl_backend.bench import run_grid, table
from ffl_backend.models import smollm2_path

AUSTEN = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "prideprejudice.txt")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--name", default="decode_smollm2_cpu")
    args = parser.parse_args()
    grid = run_grid(str(smollm2_path()), dtypes=args.dtypes, prompt_len=args.prompt_len,
                    new_tokens=args.new_tokens, repeats=args.repeats,
                    text=AUSTEN if os.path.exists(AUSTEN) else None)
    grid["command"] = "python " + " ".join(sys.argv)
    md = table(grid)
    env = grid["environment"]
    header = (f"# {args.name}\n\n`{grid['command']}`\n\n{env['machine']}; torch {env['torch']}, "
              f"transformers {env['transformers']}, triton {env['triton']}, {env['torch_threads']} threads; "
              f"{env['date']}\n\nprompt {args.prompt_len} tokens, {args.new_tokens} new tokens, batch 1, greedy, "
              f"median of {args.repeats} runs after a compile/warm-up run.\n\n")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.name + ".json"), "w") as fh:
        json.dump(grid, fh, indent=1)
    with open(os.path.join(args.out, args.name + ".md"), "w") as fh:
        fh.write(header + md + "\n")
    print(header + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
