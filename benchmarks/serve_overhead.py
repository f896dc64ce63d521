"""What the HTTP layer costs: tokens/s of N concurrent streams through ffl-serve against the same
N streams submitted to the engine directly, one engine, interleaved rounds.

    .venv/bin/python benchmarks/serve_overhead.py [--streams 16] [--new 64] [--rounds 5]

One process holds the engine (SmolLM2-135M, fastflow-compiled, max_batch_size = N) and the server
(uvicorn in a thread, as `ffl-serve` builds it). A round is either N coroutines reading
`engine.submit(...)` streams, or N raw-socket SSE clients of /v1/completions (include_usage, the
same token-id prompts, greedy, eos ignored; the client parses only the usage event): the client's
socket reading, in the same process, is counted against the HTTP side. tokens/s = generated
tokens / wall time of the round; the result is the median of the per-pair ratios. The process's
CPU seconds per token (all threads: engine, server, client) are reported too: on a shared VM they
move less than wall time. Writes benchmarks/results/serve_overhead_smollm2_<cpu>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_client import request  # noqa: E402


def text_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    path = next((p for p in (ROOT.parent / "shared/data/prideprejudice.txt",) if p.exists()), None)
    text = path.read_text()[:100_000] if path else "The quick brown fox jumps over the lazy dog. " * 2000
    ids = tokenizer(text)["input_ids"]
    return [ids[500 * i: 500 * i + length] for i in range(n)]


async def engine_round(engine, prompts, new) -> tuple[int, float]:
    from ffl_backend.engine import SamplingParams

    params = SamplingParams(max_new_tokens=new, ignore_eos=True)

    async def one(ids):
        count = 0
        async for _ in await engine.submit(ids, params):
            count += 1
        return count

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts), time.perf_counter() - start


async def http_round(port, prompts, new) -> tuple[int, float]:
    body = {"max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    results = await asyncio.gather(*(request(port, "/v1/completions", {**body, "prompt": p}, lean=True)
                                     for p in prompts))
    wall = time.perf_counter() - start
    bad = [r.error for r in results if not r.ok]
    assert not bad, bad[:3]
    return sum(r.completion_tokens for r in results), wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from ffl_backend.bench.grid import environment
    from ffl_backend.engine import OptimizedInferenceEngine
    from ffl_backend.models import smollm2_path
    from ffl_backend.serve.app import build_app
    from ffl_backend.serve.cli import make_server, uvicorn_config
    from ffl_backend.serve.state import ServeConfig, ServerState

    engine = OptimizedInferenceEngine(smollm2_path(), max_batch_size=args.streams, max_seq_len=512)
    state = ServerState(ServeConfig(served_model_names=("smollm2",)), engine)
    server = make_server(uvicorn_config(build_app(state), state, "127.0.0.1", 0), state)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    prompts = text_prompts(engine.tokenizer, args.streams, args.prompt_len)

    async def run():
        rows = []
        await engine_round(engine, prompts, args.new)  # warm both paths
        await http_round(port, prompts, args.new)
        for i in range(args.rounds):
            order = ("engine", "http") if i % 2 == 0 else ("http", "engine")
            row = {}
            for mode in order:
                cpu = time.process_time()
                tokens, wall = await (engine_round(engine, prompts, args.new) if mode == "engine"
                                      else http_round(port, prompts, args.new))
                cpu = time.process_time() - cpu
                row[mode] = {"tokens": tokens, "seconds": round(wall, 4), "tok_s": round(tokens / wall, 2),
                             "cpu_ms_per_token": round(1e3 * cpu / tokens, 3)}
            row["ratio"] = round(row["http"]["tok_s"] / row["engine"]["tok_s"], 4)
            row["cpu_ratio"] = round(row["http"]["cpu_ms_per_token"] / row["engine"]["cpu_ms_per_token"], 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
        return rows

    try:
        rows = asyncio.run(run())
    finally:
        server.handle_exit(15, None)
        thread.join(30)
        engine.close()
    ratio = statistics.median(r["ratio"] for r in rows)
    env = environment()
    result = {"benchmark": "serve_overhead", "model": "SmolLM2-135M-Instruct (bf16 checkpoint)",
              "streams": args.streams, "new_tokens": args.new, "prompt_tokens": args.prompt_len,
              "rounds": rows, "median_ratio_http_over_engine": ratio,
              "http_overhead_percent": round(100 * (1 - ratio), 2),
              "median_cpu_ratio_http_over_engine": statistics.median(r["cpu_ratio"] for r in rows),
              "engine_tok_s_median": statistics.median(r["engine"]["tok_s"] for r in rows),
              "http_tok_s_median": statistics.median(r["http"]["tok_s"] for r in rows),
              "command": "python " + " ".join(sys.argv), "environment": env}
    cpu = "cpu_amd_epyc" if "AMD" in env["machine"] else "cpu_xeon" if "Xeon" in env["machine"] else "cpu"
    out = Path(args.out or ROOT / f"benchmarks/results/serve_overhead_smollm2_{cpu}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"HTTP layer: {result['http_overhead_percent']}% of tokens/s at {args.streams} streams -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
