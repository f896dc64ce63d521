"""SmolLM2-135M quantized on CPU: decode tok/s (batch 1, plain generate()) and peak RSS.

    python benchmarks/quant_cpu.py decode --model int8 --dtype bfloat16
    python benchmarks/quant_cpu.py rss --model imports|bf16|int8-load|int8-hf|int8-quantize [--dir saved_int8]
    python benchmarks/quant_cpu.py save --model int8|int8-all --dir saved_int8

Each decode run warms up (compiles) first, verifies the greedy output is the same text twice, then
times generate() of 8 and of 72 new tokens: 64 / (t72 - t8) is decode only, no prefill. On a shared
machine the best of the repeats is the figure least disturbed by other processes (the median is
reported too); one thread by default, since OpenMP threads on an oversubscribed CPU stall.
Run each configuration in its own process: peak RSS and Inductor caches must not carry over.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

PROMPT = "It is a truth universally acknowledged, that a single man in possession"


def _model(name: str, dtype):
    import ffl_backend
    from ffl_backend.models import load_smollm2

    model, tok = load_smollm2(dtype=dtype)
    if name != "bf16":  # a scheme or preset name: int8, int4, int4-g32, w8a8, fp8, int8-all, int4-all, ...
        ffl_backend.quantize(model, name)
    return model, tok


def _generate_seconds(model, ids, n):
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return time.perf_counter() - start, out


def decode(args) -> dict:
    from ffl_backend.generation import configure_generate

    torch.set_num_threads(args.threads)
    model, tok = _model(args.model, getattr(torch, args.dtype))
    configure_generate(model, backend=args.backend, max_cache_len=128)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    t0 = time.perf_counter()
    _, first = _generate_seconds(model, ids, 72)  # compiles
    compile_s = time.perf_counter() - t0
    rates = []
    for _ in range(args.repeats):
        t_short, _ = _generate_seconds(model, ids, 8)
        t_long, out = _generate_seconds(model, ids, 72)
        assert torch.equal(out, first), "greedy output changed between runs"
        rates.append(64 / (t_long - t_short))
    text = tok.decode(first[0, ids.shape[1]:ids.shape[1] + 16])
    return {"model": args.model, "dtype": args.dtype, "backend": args.backend, "threads": args.threads,
            "tok_s_best": round(max(rates), 1), "tok_s_median": round(statistics.median(rates), 1),
            "tok_s": [round(r, 1) for r in rates],
            "first_run_s": round(compile_s, 1), "text": text}


def rss(args) -> dict:
    import ffl_backend
    from ffl_backend.bench.session import current_rss_mb

    if args.model == "imports":  # what every variant pays before its first tensor
        from transformers import AutoModelForCausalLM  # noqa: F401
        from transformers.models.llama import modeling_llama  # noqa: F401

        return {"model": args.model,
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if args.model == "int8-load":
        model = ffl_backend.load_quantized(args.dir)
    elif args.model == "int8-hf":  # transformers' own loader through the registered quantizer
        from transformers import AutoModelForCausalLM

        ffl_backend.quant.register_with_transformers()
        model = AutoModelForCausalLM.from_pretrained(args.dir)
    elif args.model == "bf16":  # the model alone, like load_quantized (no tokenizer)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(ffl_backend.smollm2_path(), dtype=torch.bfloat16)
    else:  # "<scheme>-quantize": load bf16 and quantize in this process
        model, _ = _model(args.model.removesuffix("-quantize"), torch.bfloat16)
    with torch.no_grad():
        model(torch.randint(0, 1000, (1, 32)))
    return {"model": args.model, "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "rss_after_forward_mib": current_rss_mb()}


def save(args) -> dict:
    from ffl_backend.quant import save_quantized

    model, _ = _model(args.model, torch.bfloat16)
    save_quantized(model, args.dir)
    return {"saved": args.dir}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["decode", "rss", "save"])
    p.add_argument("--model", default="int8",
                   help="bf16 | int8 | int8-all | int4 | int4-g32 | w8a8 | fp8 | imports | int8-load | int8-hf | "
                   "<scheme>-quantize (int8-quantize, int8-all-quantize: bf16 loaded, then quantized in-process)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="fastflow")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default="/tmp/ffl_int8_smollm2")
    args = p.parse_args()
    print(json.dumps({"decode": decode, "rss": rss, "save": save}[args.what](args)))


if __name__ == "__main__":
    main()
