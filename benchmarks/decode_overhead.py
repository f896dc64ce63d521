"""How much of a fastflow decode step is outside the weight GEMVs and attention, measured without a
profiler: the same compiled model times greedy generate() with the fastflow_cpu kernels computing
(real) and with them returning zeros at once (null: `cpu_lib.null_kernels()`, a switch inside the
C++ library, so it reaches the kernels whichever wrapper calls them, Python or cpp_wrapper's C++),
in alternation, in one process. null is everything else -- generate()'s loop, Dynamo's guards, the
compiled graph's wrapper, its other kernels (norms, rotary, SwiGLU) and every op call's dispatch;
real - null is the GEMVs and (with optimize()'s fastflow attention, the C++ decode-attention
kernel) attention.

    python benchmarks/decode_overhead.py [--quant int4-all] [--dtype bfloat16] [--entry optimize]
        [--mode reduce-overhead] [--rounds 8] [--out benchmarks/results/decode_overhead_cpu.json]

--entry optimize: `ffl_backend.optimize(model, quant=...)` as a user calls it (static cache of 2048,
fastflow attention); generate: `configure_generate` over a cache of exactly prompt + new tokens with
transformers' SDPA attention (whose decode attention Inductor compiles inline, so it counts as null).

torch.profiler adds a fixed cost to every op it records, which on a CPU where an op call costs ~5 us
inflates the small ops several-fold and makes them look like most of the step.
The null kernels make the generated tokens meaningless; the step's work does not depend on them.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics


def split_step(model, ids, rounds: int, new_tokens: int) -> dict:
    """ms per decode step of `model` (set up to generate() with fastflow) with real and with null
    kernels, alternating for `rounds` rounds; the kernels compute again afterwards."""
    from ffl_backend.bench.session import time_generate
    from ffl_backend.kernels.cpu_lib import null_kernels

    modes = {"real": contextlib.nullcontext, "null": null_kernels}
    for name in ("real", "real", "null"):  # compile, warm, warm the null path
        with modes[name]():
            time_generate(model, ids, new_tokens)
    steps, tokens = {name: [] for name in modes}, {}
    for r in range(rounds):
        for name in (("real", "null") if r % 2 else ("null", "real")):
            with modes[name]():
                run = time_generate(model, ids, new_tokens)
            steps[name].append(1e3 / run["decode_tok_s"])
            tokens[name] = run["tokens"]
    real, null = statistics.median(steps["real"]), statistics.median(steps["null"])
    kernels = [r - n for r, n in zip(steps["real"], steps["null"])]
    return {"rounds": rounds, "new_tokens": new_tokens,
            "ms_per_step": {"real": round(real, 2), "null (outside GEMVs + attention)": round(null, 2),
                            "GEMVs + attention (paired real - null, median)": round(statistics.median(kernels), 2)},
            "ms_per_step_all": {k: [round(v, 2) for v in vs] for k, vs in steps.items()},
            # the first token comes from the prompt's forward, outside the decode step
            "null_tokens_all_zero": all(t == 0 for t in tokens["null"][1:])}


def prepare(quant: str, dtype: str, entry: str, mode: str | None, prompt_len: int, new_tokens: int):
    """(model, prompt ids): SmolLM2-135M set up the way `entry` says."""
    import ffl_backend
    from ffl_backend.bench.session import load_model, prompt_ids
    from ffl_backend.generation import configure_generate
    from ffl_backend.models import smollm2_path

    model, tok, _, _ = load_model({"model": str(smollm2_path()), "dtype": dtype, "quant": quant})
    if entry == "optimize":
        ffl_backend.optimize(model, **({"mode": mode} if mode else {}))  # else optimize's own default
    else:
        configure_generate(model, backend="fastflow", max_cache_len=prompt_len + new_tokens, mode=mode)
    return model, prompt_ids(tok, prompt_len)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quant", default="int4-all")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--entry", default="optimize", choices=("optimize", "generate"))
    p.add_argument("--mode", default=None, help="torch.compile mode handed to fastflow (default: the entry's)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", help="JSON file to append this row to")
    args = p.parse_args(argv)
    from ffl_backend.bench.grid import report_row
    from ffl_backend.kernels import cpu_lib

    if not cpu_lib.load():
        raise SystemExit(f"CPU kernels not built: {cpu_lib.load_error()}")
    model, ids = prepare(args.quant, args.dtype, args.entry, args.mode, args.prompt_len, args.new_tokens)
    from ffl_backend.api import DEFAULT_MODE

    mode = args.mode or (DEFAULT_MODE if args.entry == "optimize" else "default")
    row = {"quant": args.quant, "dtype": args.dtype, "entry": args.entry, "mode": mode,
           "prompt_len": args.prompt_len, **split_step(model, ids, args.rounds, args.new_tokens)}
    report_row(row, args.out)


if __name__ == "__main__":
    main()
