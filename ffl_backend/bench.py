"""Decode benchmark core: one configuration per fresh process, timed token by token.

`python -m ffl_backend.bench` runs a grid of (backend, dtype) configurations on a model folder and
prints a table; benchmarks/ scripts use `run_grid` and commit the JSON. Each configuration runs in
its own subprocess so compiled code, allocator state and peak-RSS figures cannot leak between them.
Outputs are checked before times are trusted: every configuration's greedy tokens are compared with
the eager run of the same dtype.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

BACKENDS = ("eager", "inductor", "fastflow")
DTYPES = ("float32", "bfloat16")


class TimingStreamer:
    """A generate() streamer that timestamps every step: the prompt, then each new token."""

    def __init__(self):
        self.stamps = []

    def put(self, value):
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


def prompt_ids(tokenizer, length: int, text_path: str | None = None):
    """`length` tokens of real text (Pride and Prejudice if available, else a fixed sentence)."""
    import torch

    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. "
    if text_path and os.path.exists(text_path):
        with open(text_path, encoding="utf-8") as fh:
            text = fh.read(200_000)
    ids = tokenizer(text * (1 + 4 * length // max(1, len(text.split()))), return_tensors="pt").input_ids
    return ids[:, :length].contiguous() if ids.shape[1] >= length else torch.cat([ids] * 2, 1)[:, :length]


def time_generate(model, ids, new_tokens: int) -> dict:
    import torch

    streamer = TimingStreamer()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             streamer=streamer)
    s = streamer.stamps  # s[0]: prompt echoed; s[1]: first new token; s[-1]: last token
    decode_s = s[-1] - s[1]
    return {"ttft_s": s[1] - start, "decode_tok_s": (len(s) - 2) / decode_s if decode_s > 0 else float("nan"),
            "tokens": out[0, ids.shape[1]:].tolist()}


def run_one(cfg: dict) -> dict:
    """Load, configure, warm up (compile) and time one configuration in this process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .generation import configure_generate

    torch.set_num_threads(cfg.get("threads") or torch.get_num_threads())
    dtype = getattr(torch, cfg["dtype"])
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    load_s = time.perf_counter() - t0
    ids = prompt_ids(tok, cfg["prompt_len"], cfg.get("text"))
    backend = None if cfg["backend"] == "eager" else cfg["backend"]
    configure_generate(model, backend=backend, options=cfg.get("options"),
                       max_cache_len=cfg["prompt_len"] + cfg["new_tokens"] + 16)
    t0 = time.perf_counter()
    first = time_generate(model, ids, cfg["new_tokens"])  # compiles the decode step
    warmup_s = time.perf_counter() - t0
    runs = [time_generate(model, ids, cfg["new_tokens"]) for _ in range(cfg["repeats"])]
    rates = [r["decode_tok_s"] for r in runs]
    return {**cfg, "load_s": load_s, "first_generate_s": warmup_s,
            "decode_tok_s": statistics.median(rates), "decode_tok_s_all": rates,
            "ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "tokens": runs[-1]["tokens"], "deterministic": all(r["tokens"] == first["tokens"] for r in runs)}


def run_isolated(cfg: dict) -> dict:
    """`run_one` in a fresh interpreter (see module docstring)."""
    proc = subprocess.run([sys.executable, "-m", "ffl_backend.bench", "--worker", json.dumps(cfg)],
                          capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {**cfg, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(lines[-1])


def agreement(results: list[dict]) -> None:
    """Annotate each result with how many leading tokens match eager of the same dtype."""
    eager = {r["dtype"]: r["tokens"] for r in results if r["backend"] == "eager" and "tokens" in r}
    for r in results:
        ref = eager.get(r["dtype"])
        if ref is None or "tokens" not in r:
            continue
        n = next((i for i, (a, b) in enumerate(zip(r["tokens"], ref)) if a != b), min(len(ref), len(r["tokens"])))
        r["matching_prefix"], r["tokens_equal_eager"] = n, r["tokens"] == ref


def environment() -> dict:
    import torch
    import transformers
    import triton

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return {"machine": f"{cpu}, {os.cpu_count()} cores", "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "triton": triton.__version__,
            "torch_threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def run_grid(model: str, backends=BACKENDS, dtypes=DTYPES, prompt_len=16, new_tokens=128, repeats=3,
             text=None, options=None, log=print) -> dict:
    results = []
    for dtype in dtypes:
        for backend in backends:
            cfg = {"model": str(model), "backend": backend, "dtype": dtype, "prompt_len": prompt_len,
                   "new_tokens": new_tokens, "repeats": repeats, "text": text,
                   "options": options if backend == "fastflow" else None}
            res = run_isolated(cfg)
            log(f"  {dtype:9s} {backend:9s} " + (f"{res['decode_tok_s']:.1f} tok/s" if "error" not in res
                                                 else f"ERROR {res['error']}"))
            results.append(res)
    agreement(results)
    base = {r["dtype"]: r.get("decode_tok_s") for r in results if r["backend"] == "inductor"}
    for r in results:
        if base.get(r["dtype"]) and "decode_tok_s" in r:
            r["speedup_vs_inductor"] = r["decode_tok_s"] / base[r["dtype"]]
    return {"environment": environment(), "results": results}


def _agreement_cell(r: dict) -> str:
    if "tokens_equal_eager" not in r:
        return "n/a (no eager run)"
    return f"{r['tokens_equal_eager']} ({r['matching_prefix']}/{len(r['tokens'])})"


def table(grid: dict) -> str:
    rows = ["| dtype | backend | decode tok/s (median) | vs inductor | TTFT ms | first generate s | peak RSS MB | tokens = eager |",
            "|---|---|---|---|---|---|---|---|"]
    for r in grid["results"]:
        if "error" in r:
            rows.append(f"| {r['dtype']} | {r['backend']} | error: {r['error']} | | | | | |")
            continue
        rows.append(f"| {r['dtype']} | {r['backend']} | {r['decode_tok_s']:.1f} | "
                    f"{r.get('speedup_vs_inductor', float('nan')):.2f}x | {1000 * r['ttft_s']:.0f} | "
                    f"{r['first_generate_s']:.1f} | {r['peak_rss_mb']:.0f} | "
                    f"{_agreement_cell(r)} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="decode tok/s of eager, inductor and fastflow")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help="HF model folder (default: SmolLM2-135M, built on first use)")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_one(json.loads(args.worker))))
        return 0
    from .models import smollm2_path

    model = args.model or str(smollm2_path())
    grid = run_grid(model, args.backends, args.dtypes, args.prompt_len, args.new_tokens, args.repeats)
    print(table(grid))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(grid, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
