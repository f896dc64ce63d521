"""`optimize(model)` vs HF static cache + Inductor on SmolLM2-135M: decode tok/s and TTFT.

Each configuration runs in a fresh process (ffl_backend.bench.run_one conventions): load bf16, set up,
one warm-up generate (compiles decode), then `repeats` timed greedy generates of `new_tokens` after a
`prompt_len`-token prompt of real text. Both use the same static cache length. Rounds alternate the two
configurations so that drift in a shared machine's load hits both; every round is reported.
Outputs are checked first: both configurations' greedy tokens are compared.

    python benchmarks/optimize_decode.py [--rounds 2] [--json benchmarks/results/optimize_decode_cpu.json]
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = ("hf_static_inductor", "fastflow_optimize")


def run_one(cfg: dict) -> dict:
    import torch

    import ffl_backend
    from ffl_backend.bench import prompt_ids, time_generate
    from ffl_backend.generation import configure_generate

    torch.set_num_threads(cfg["threads"])
    model, tok = ffl_backend.load_smollm2(getattr(torch, cfg["dtype"]))
    ids = prompt_ids(tok, cfg["prompt_len"], cfg["text"])
    if cfg["config"] == "fastflow_optimize":
        ffl_backend.optimize(model, max_seq_len=cfg["cache_len"])
    else:
        configure_generate(model, backend="inductor", max_cache_len=cfg["cache_len"])
    start = time.perf_counter()
    first = time_generate(model, ids, cfg["new_tokens"])
    warm = time.perf_counter() - start
    runs = [time_generate(model, ids, cfg["new_tokens"]) for _ in range(cfg["repeats"])]
    return {**cfg, "first_generate_s": warm, "decode_tok_s_all": [r["decode_tok_s"] for r in runs],
            "ttft_s_all": [r["ttft_s"] for r in runs], "tokens": first["tokens"],
            "graphs": len(ffl_backend.fusion_reports())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_one(json.loads(args.worker))))
        return 0
    from ffl_backend.bench import environment

    text = Path(__file__).resolve().parents[2] / "shared" / "data" / "prideprejudice.txt"
    results = []
    for rnd in range(args.rounds):
        for name in CONFIGS if rnd % 2 == 0 else CONFIGS[::-1]:
            cfg = {"config": name, "dtype": args.dtype, "prompt_len": args.prompt_len, "round": rnd,
                   "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": args.threads,
                   "cache_len": args.prompt_len + args.new_tokens + 256, "text": str(text)}
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)],
                                  capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                sys.exit(f"{name} failed: {proc.stderr[-2000:]}")
            res = json.loads(lines[-1])
            results.append(res)
            print(f"round {rnd} {name:20s} decode {statistics.median(res['decode_tok_s_all']):6.1f} tok/s "
                  f"{[round(x, 1) for x in res['decode_tok_s_all']]}  "
                  f"TTFT {statistics.median(res['ttft_s_all']):.3f} s "
                  f"{[round(x, 3) for x in res['ttft_s_all']]}  first generate {res['first_generate_s']:.1f} s",
                  flush=True)
    same = len({tuple(r["tokens"]) for r in results}) == 1
    summary = {}
    for name in CONFIGS:
        rates = [x for r in results if r["config"] == name for x in r["decode_tok_s_all"]]
        ttfts = [x for r in results if r["config"] == name for x in r["ttft_s_all"]]
        summary[name] = {"decode_tok_s_median": statistics.median(rates), "decode_tok_s_min": min(rates),
                         "decode_tok_s_max": max(rates), "ttft_s_median": statistics.median(ttfts),
                         "ttft_s_min": min(ttfts), "ttft_s_max": max(ttfts)}
    ratio = summary["fastflow_optimize"]["decode_tok_s_median"] / summary["hf_static_inductor"]["decode_tok_s_median"]
    print(f"tokens identical across configs and rounds: {same}; decode speedup (medians) {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment(), "summary": summary,
                                               "decode_speedup": ratio, "tokens_identical": same,
                                               "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
