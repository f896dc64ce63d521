"""OptimizedInferenceEngine on CPU, SmolLM2-135M: 8 requests of mixed prompt lengths, N new tokens
each (eos ignored so every request makes exactly N), greedy.

    flock /tmp/ffl_cpu.lock .venv/bin/python benchmarks/engine_cpu.py [--dtype bfloat16] [--new 64]

Three ways to serve the same 8 requests, each timed after its own warm-up (compile) run:
- concurrent: one engine, max_batch_size=8, all 8 submitted at once (continuous batching);
- sequential: one engine, max_batch_size=1, the 8 run one after another (same code, batch 1);
- hf_static: plain `model.generate` after `ffl_backend.optimize` (static cache + fastflow compiled
  decode), batch 1, one after another: the honest single-stream baseline.
Outputs are compared first (token agreement is reported: bf16 batched matmuls may round
differently from batch 1); then total generated tokens / wall time, median of --repeats runs.
Writes benchmarks/results/engine_cpu_<dtype>.json with machine and versions.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (24, 200, 57, 128, 90, 300, 16, 160)


def machine() -> dict:
    try:
        from ffl_backend.bench import environment

        return environment()
    except Exception:  # noqa: BLE001 - that module is being rewritten; gather the basics here
        import transformers

        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
                "transformers": transformers.__version__, "python": platform.python_version()}


def prompts_from_text(tokenizer, lengths) -> list[list[int]]:
    paths = [ROOT.parent / "shared" / "data" / "prideprejudice.txt", Path("/work/shared/data/prideprejudice.txt")]
    path = next((p for p in paths if p.exists()), None)
    text = path.read_text() if path else "The quick brown fox jumps over the lazy dog. " * 400
    ids = tokenizer(text[:200_000])["input_ids"]
    return [ids[1000 * i: 1000 * i + n] for i, n in enumerate(lengths)]


def run_engine(model, prompts, new, batch, repeats, max_seq_len):
    from ffl_backend.engine import OptimizedInferenceEngine

    torch._dynamo.reset()
    t0 = time.perf_counter()
    engine = OptimizedInferenceEngine(model, max_batch_size=batch, max_seq_len=max_seq_len, compile="fastflow")
    warm = time.perf_counter() - t0
    try:
        def once():
            if batch > 1:
                return engine.generate(prompts, max_new_tokens=new, ignore_eos=True)
            return [engine.generate([p], max_new_tokens=new, ignore_eos=True)[0] for p in prompts]

        outs = [r.token_ids for r in once()]  # warm run (first prefills, allocator, caches)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            again = once()
            times.append(time.perf_counter() - t0)
            assert [r.token_ids for r in again] == outs, "engine not deterministic across runs"
        stats = engine.stats()
    finally:
        engine.close()
    return outs, times, warm, stats


def run_hf(model, prompts, new, repeats, max_seq_len):
    import ffl_backend
    from ffl_backend.api import restore

    torch._dynamo.reset()
    ffl_backend.optimize(model, max_seq_len=max_seq_len)
    try:
        def once():
            res = []
            for p in prompts:
                with torch.inference_mode():
                    out = model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
                res.append(out[0, len(p):].tolist())
            return res

        t0 = time.perf_counter()
        outs = once()
        warm = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
    finally:
        restore(model)
    return outs, times, warm


def agreement(a, b) -> dict:
    """Requests identical, and mean length of the common prefix in tokens."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y))) for x, y in zip(a, b)]
    return {"identical_requests": same, "of": len(a), "mean_common_prefix": statistics.mean(prefix)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF static-cache baseline")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ffl_backend.models import smollm2_path

    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    prompts = prompts_from_text(tokenizer, LENGTHS)
    total = args.new * len(prompts)
    result = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "prompt_lengths": list(LENGTHS),
              "new_tokens_each": args.new, "requests": len(prompts), "max_seq_len": args.max_seq_len,
              "block_size": 16, "machine": machine(), "command": "flock /tmp/ffl_cpu.lock .venv/bin/python "
              f"benchmarks/engine_cpu.py --dtype {args.dtype} --new {args.new} --repeats {args.repeats}"}
    runs = {}
    for name, batch in (("concurrent", 8), ("sequential", 1)):
        outs, times, warm, stats = run_engine(model, prompts, args.new, batch, args.repeats, args.max_seq_len)
        runs[name] = outs
        med = statistics.median(times)
        result[name] = {"max_batch_size": batch, "seconds": times, "median_s": med, "tok_s": total / med,
                        "warmup_s": warm, "recompiles_after_warmup": stats["recompiles_after_warmup"],
                        "decode_steps_total": stats.get("decode_steps", 0), "peak_blocks": stats["peak_blocks"]}
        print(f"{name:11s} batch {batch}: {total / med:7.1f} tok/s  ({med:.2f} s, warm-up {warm:.0f} s)", flush=True)
    if not args.no_hf:
        outs, times, warm = run_hf(model, prompts, args.new, args.repeats, args.max_seq_len)
        runs["hf_static"] = outs
        med = statistics.median(times)
        result["hf_static"] = {"seconds": times, "median_s": med, "tok_s": total / med, "warmup_s": warm}
        print(f"hf_static   batch 1: {total / med:7.1f} tok/s  ({med:.2f} s)", flush=True)
    result["agreement"] = {f"concurrent_vs_{k}": agreement(runs["concurrent"], v) for k, v in runs.items()
                           if k != "concurrent"}
    result["speedup_concurrent_vs_sequential"] = result["concurrent"]["tok_s"] / result["sequential"]["tok_s"]
    if "hf_static" in result:
        result["speedup_concurrent_vs_hf_static"] = result["concurrent"]["tok_s"] / result["hf_static"]["tok_s"]
    print(json.dumps({k: result[k] for k in result if k.startswith(("speedup", "agreement"))}, indent=1))
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"engine_cpu_{args.dtype}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
