"""In-process A/B of fastflow options on SmolLM2-135M batch-1 decode.

This shared machine's speed drifts by 10-30% between runs (the same configuration measured 84 and
58 tok/s hours apart), so two separate ffl-bench runs cannot resolve a few-percent change. Here both
variants live in one process: two copies of the model, each compiled with its own options, timed in
alternation (64-token greedy generates), so drift hits both alike.

    python benchmarks/ab_decode.py --quant int8-all --a '{"inductor_config": {"cpp.enable_floating_point_contract_flag": "off"}}' --b '{}'
    python benchmarks/ab_decode.py ... --dtype float32 --rounds 7 --out benchmarks/results/fp_contract_ab_cpu.json   (appends a row)
"""
from __future__ import annotations

import argparse
import json
import statistics


def ab(dtype: str, quant: str, variants: dict, rounds: int, new_tokens: int) -> dict:
    from ffl_backend.bench.worker import load_model, prompt_ids, time_generate
    from ffl_backend.generation import configure_generate
    from ffl_backend.models import smollm2_path

    models, ids = {}, None
    for name, options in variants.items():
        models[name], tok, _, _ = load_model({"model": str(smollm2_path()), "dtype": dtype, "quant": quant})
        configure_generate(models[name], backend="fastflow", options=options or None,
                           max_cache_len=16 + new_tokens)
        ids = prompt_ids(tok, 16)
        for _ in range(2):  # compile, then one warm run
            time_generate(models[name], ids, new_tokens)
    rates = {name: [] for name in models}
    tokens = {}
    for _ in range(rounds):
        for name, model in models.items():
            timing = time_generate(model, ids, new_tokens)
            rates[name].append(timing["decode_tok_s"])
            tokens[name] = timing["tokens"]
    a, b = (statistics.median(rates[n]) for n in variants)
    same = sum(x == y for x, y in zip(*tokens.values()))
    return {"dtype": dtype, "quant": quant, "variants": variants,
            "decode_tok_s": {n: {"median": round(statistics.median(r), 1), "min": round(min(r), 1),
                                 "max": round(max(r), 1)} for n, r in rates.items()},
            "b_over_a": round(b / a, 3), "greedy_tokens_equal_a_b": f"{same}/{new_tokens}"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--quant", default="none", help="none or a quantize() scheme/preset (int8, int8-all, int4-all)")
    p.add_argument("--a", default="{}", help="fastflow options of variant a (JSON)")
    p.add_argument("--b", default="{}", help="fastflow options of variant b (JSON)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", help="JSON file to append this row to")
    args = p.parse_args(argv)
    from ffl_backend.bench.grid import report_row

    row = ab(args.dtype, args.quant, {"a": json.loads(args.a), "b": json.loads(args.b)}, args.rounds, args.new_tokens)
    report_row(row, args.out)


if __name__ == "__main__":
    main()
