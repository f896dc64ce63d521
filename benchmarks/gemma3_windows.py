"""Issue 24's sliding-window acceptance on the real Gemma-3-270M (fp32, greedy), in one process:

- optimize(): prompts of 17 / 333 / 700 / 1500 tokens (the window is 512) decode the same tokens
  as transformers' own generate before optimize; sliding layers' caches hold the window; decode
  graphs compiled after the first call: 0.
- OptimizedInferenceEngine: 16 requests with prompts of 10..900 tokens submitted at once equal
  single-request generate; the pool's tensors and bytes never change; recompiles after warm-up: 0.

    flock /tmp/ffl_cpu.lock .venv/bin/python benchmarks/gemma3_windows.py [--new 24] --out gemma3_windows_<cpu>

Writes benchmarks/results/<--out>.json with machine and versions.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "prideprejudice.txt"
OPTIMIZE_PROMPTS = (17, 333, 700, 1500)
ENGINE_PROMPTS = tuple(10 + round(i * (900 - 10) / 15) for i in range(16))


def text_prompts(tokenizer, lengths) -> list[list[int]]:
    """Real text, each prompt from its own offset (so requests share no prefix)."""
    ids = tokenizer(TEXT.read_text()[:400_000], add_special_tokens=False)["input_ids"]
    return [[tokenizer.bos_token_id] + ids[997 * i: 997 * i + n - 1] for i, n in enumerate(lengths)]


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def check_optimize(model, prompts, refs, new) -> dict:
    import ffl_backend
    from ffl_backend.api import kv_cache_bytes

    torch._dynamo.reset()
    ffl_backend.optimize(model, max_seq_len=2048)
    rows, graphs_after_first = [], None
    for prompt, ref in zip(prompts, refs):
        t0 = time.perf_counter()
        got = hf_greedy(model, prompt, new)
        rows.append({"prompt": len(prompt), "equal": got == ref, "seconds": round(time.perf_counter() - t0, 2)})
        if graphs_after_first is None:
            graphs_after_first = len(ffl_backend.fusion_reports())
    loop = model.generate.__wrapped__
    cache = next(iter(loop._caches.values()))
    lengths = [layer.keys.shape[2] for layer in cache.layers]
    nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    result = {"rows": rows, "graphs_compiled_after_first_call": len(ffl_backend.fusion_reports()) - graphs_after_first,
              "layer_cache_lengths": lengths, "cache_bytes": nbytes,
              "kv_cache_bytes": kv_cache_bytes(model.config, 1, 2048, model.dtype),
              "full_length_cache_bytes": kv_cache_bytes(model.config, 1, 2048, model.dtype, cap_sliding=False)}
    ffl_backend.restore(model)
    return result


def check_engine(model, prompts, refs, new) -> dict:
    from ffl_backend.engine import OptimizedInferenceEngine

    torch._dynamo.reset()
    t0 = time.perf_counter()
    with OptimizedInferenceEngine(model, max_batch_size=8, max_seq_len=1024) as engine:
        warm = time.perf_counter() - t0
        ptrs, nbytes = engine.cache.data_ptrs(), engine.cache.nbytes
        t0 = time.perf_counter()
        results = engine.generate(prompts, max_new_tokens=new)
        seconds = time.perf_counter() - t0
        stats = engine.stats()
        same_pool = engine.cache.data_ptrs() == ptrs and engine.cache.nbytes == nbytes
        all_back = engine.scheduler.allocator.free == engine.num_blocks - 1
    equal = [r.token_ids[:new] == ref and r.error is None for r, ref in zip(results, refs)]
    return {"requests": len(prompts), "prompts": [len(p) for p in prompts], "equal": equal,
            "all_equal": all(equal), "pool_unchanged": same_pool, "all_blocks_returned": all_back,
            "pool_bytes": nbytes, "num_blocks": engine.num_blocks, "peak_blocks": stats["peak_blocks"],
            "recompiles_after_warmup": stats["recompiles_after_warmup"], "warmup_s": round(warm, 1),
            "generate_s": round(seconds, 1), "preemptions": stats.get("preemptions", 0)}


def main(argv=None):
    import ffl_backend
    from ffl_backend.bench import environment

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", type=int, default=24, help="new tokens per request")
    parser.add_argument("--out", required=True, help="results file name without .json, naming the CPU")
    args = parser.parse_args(argv)
    env = environment()
    model, tok = ffl_backend.load_gemma3(torch.float32)
    t0 = time.perf_counter()
    opt_prompts = text_prompts(tok, OPTIMIZE_PROMPTS)
    opt_refs = [hf_greedy(model, p, args.new) for p in opt_prompts]
    eng_prompts = text_prompts(tok, ENGINE_PROMPTS)
    eng_refs = [hf_greedy(model, p, args.new) for p in eng_prompts]
    ref_s = time.perf_counter() - t0
    out = {"machine": env, "model": "gemma-3-270m (bundled)", "dtype": "float32", "new_tokens": args.new,
           "reference": "transformers generate (dynamic cache, sdpa), one request at a time",
           "reference_s": round(ref_s, 1),
           "optimize": check_optimize(model, opt_prompts, opt_refs, args.new),
           "engine": check_engine(model, eng_prompts, eng_refs, args.new)}
    path = ROOT / "benchmarks" / "results" / f"{args.out}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("optimize", "engine")}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
