"""In-process comparison of decode setups on SmolLM2-135M, batch 1: fastflow options, or whole setups
(backend, dtype, quantization) against a baseline.

This shared machine's speed drifts by 10-30% between runs (the same configuration measured 84 and
58 tok/s hours apart), so two separate ffl-bench runs cannot resolve a few-percent change, and a ratio
between rows of one ffl-bench run depends on when each row ran. Here every variant lives in one
process: its own copy of the model, compiled with its own settings, timed in alternation (64-token
greedy generates), so drift hits all alike. Each round times every variant once; the ratio of a
variant to the first is reported as the median of the per-round ratios (paired) and as the ratio of
medians.

    python benchmarks/ab_decode.py --quant int8-all
        --a '{"inductor_config": {"cpp.enable_floating_point_contract_flag": "off"}}' --b '{}'
    python benchmarks/ab_decode.py ... --dtype float32 --rounds 7
        --out benchmarks/results/fp_contract_ab_cpu.json   (appends a row)
    python benchmarks/ab_decode.py --variants '[{"name": "inductor fp32", "backend": "inductor", "dtype": "float32"},
        {"name": "fastflow int8", "quant": "int8"}, {"name": "optimize int8", "quant": "int8", "entry": "optimize"}]'
        (defaults: backend fastflow, --dtype, --quant, options {}, mode None, entry "generate" =
        configure_generate, i.e. a CompileConfig over a static cache of prompt + new tokens; "optimize" =
        ffl_backend.optimize(model, **options) with its defaults (mode "reduce-overhead" unless given);
        "model.compile" = model.compile(backend=..., mode=...) in place over the same static cache)

--a/--b are fastflow options of two variants that share --dtype and --quant.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# Long prompts are cut from the bundled text (../shared/MODELS.md), not a repeated sentence.
_TEXT = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "prideprejudice.txt")
SETUP_KEYS = ("name", "backend", "dtype", "quant", "options", "entry", "mode")


def _variant(spec: dict, dtype: str, quant: str) -> dict:
    unknown = set(spec) - set(SETUP_KEYS)
    if unknown:
        raise ValueError(f"unknown variant keys {sorted(unknown)}; known: {SETUP_KEYS}")
    v = {"backend": "fastflow", "dtype": dtype, "quant": quant, "options": {}, "entry": "generate", "mode": None,
         **spec}
    v.setdefault("name", f"{v['backend']} {v['dtype']} {v['quant']}")
    return v


def _prepare(v: dict, new_tokens: int, prompt_len: int = 16):
    import ffl_backend
    from ffl_backend.bench.session import load_model, prompt_ids, time_generate
    from ffl_backend.generation import configure_generate
    from ffl_backend.models import smollm2_path

    model, tok, _, _ = load_model({"model": str(smollm2_path()), "dtype": v["dtype"], "quant": v["quant"]})
    backend = None if v["backend"] == "eager" else v["backend"]
    if v["entry"] == "optimize":  # what users are told to call: ffl_backend.optimize's defaults
        ffl_backend.optimize(model, **({"mode": v["mode"]} if v["mode"] else {}), **v["options"])
    elif v["entry"] == "model.compile":  # compiled in place (prefill too), static cache
        configure_generate(model, backend=None, max_cache_len=prompt_len + new_tokens)
        model.compile(backend=backend, mode=v["mode"], **({"options": v["options"]} if v["options"] else {}))
    else:  # "generate": a CompileConfig for transformers' generate() (configure_generate)
        configure_generate(model, backend=backend, options=v["options"] or None,
                           max_cache_len=prompt_len + new_tokens, mode=v["mode"])
    ids = prompt_ids(tok, prompt_len, _TEXT if prompt_len > 64 else None)
    for _ in range(2):  # compile, then one warm run
        time_generate(model, ids, new_tokens)
    return model, ids


def compare(variants: list, rounds: int, new_tokens: int, prompt_len: int = 16) -> dict:
    """Decode tok/s of each variant (dicts with SETUP_KEYS), timed in alternation, and each one's
    ratio to the first."""
    from ffl_backend.bench.session import time_generate

    names = [v["name"] for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must differ: {names}")
    prepared = {v["name"]: _prepare(v, new_tokens, prompt_len) for v in variants}
    rates, tokens = {n: [] for n in names}, {}
    for _ in range(rounds):
        for name, (model, ids) in prepared.items():
            timing = time_generate(model, ids, new_tokens)
            rates[name].append(timing["decode_tok_s"])
            tokens[name] = timing["tokens"]
    base = names[0]
    row = {"variants": variants, "rounds": rounds, "prompt_len": prompt_len, "new_tokens": new_tokens,
           "decode_tok_s": {n: {"median": round(statistics.median(r), 1), "min": round(min(r), 1),
                                "max": round(max(r), 1), "all": [round(x, 1) for x in r]} for n, r in rates.items()},
           "vs_first": {}}
    for name in names[1:]:
        paired = [b / a for a, b in zip(rates[base], rates[name])]
        row["vs_first"][name] = {
            "paired_median": round(statistics.median(paired), 3),
            "paired_min": round(min(paired), 3), "paired_max": round(max(paired), 3),
            "of_medians": round(statistics.median(rates[name]) / statistics.median(rates[base]), 3),
            "greedy_tokens_equal_first": f"{sum(x == y for x, y in zip(tokens[base], tokens[name]))}/{new_tokens}"}
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--quant", default="none", help="none or a quantize() scheme/preset (int8, int8-all, int4-all)")
    p.add_argument("--a", default="{}", help="fastflow options of variant a (JSON)")
    p.add_argument("--b", default="{}", help="fastflow options of variant b (JSON)")
    p.add_argument("--variants", help="JSON list of variants (keys: name, backend, dtype, quant, options); "
                                      "replaces --a/--b")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (real text beyond 64)")
    p.add_argument("--out", help="JSON file to append this row to")
    args = p.parse_args(argv)
    from ffl_backend.bench.grid import report_row

    specs = (json.loads(args.variants) if args.variants else
             [{"name": "a", "options": json.loads(args.a)}, {"name": "b", "options": json.loads(args.b)}])
    variants = [_variant(s, args.dtype, args.quant) for s in specs]
    report_row(compare(variants, args.rounds, args.new_tokens, args.prompt_len), args.out)


if __name__ == "__main__":
    main()
