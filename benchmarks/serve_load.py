"""A load run of `ffl-serve` as users start it: C concurrent clients mixing chat and completions,
streaming and not, for D seconds on SmolLM2-135M-Instruct.

    .venv/bin/python benchmarks/serve_load.py [--clients 64] [--duration 300] [--max-batch-size 16]

The server runs in its own process (`python -m ffl_backend.serve.cli`, default engine settings but
the batch size); the clients are asyncio raw-socket coroutines here, each sending its next request
as soon as the last one ends: a prompt cut from Pride and Prejudice (40-400 characters), 16-64 new
tokens, greedy or sampled at T=0.8. Recorded: errors (non-200, error events, client exceptions),
lost requests (sent, never answered), client-side TTFT and inter-token gaps (p50/p99, streams),
throughput, the server's RSS every 2 s (flat after a 60 s warm-up: the last 60 s against the
60-120 s window), and /metrics before and after (the same run seen by the server). SIGTERM ends
the server; its exit status is recorded. Writes benchmarks/results/serve_load_smollm2_<cpu>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_client import percentile, request  # noqa: E402

KINDS = ("completion", "completion-stream", "chat", "chat-stream")


def snippets() -> list[str]:
    path = ROOT.parent / "shared/data/prideprejudice.txt"
    text = path.read_text()[20_000:220_000] if path.exists() else "It is a truth universally acknowledged. " * 5000
    rng = random.Random(0)
    out = []
    for _ in range(500):
        start, size = rng.randrange(len(text) - 500), rng.randint(40, 400)
        out.append(" ".join(text[start:start + size].split()))
    return out


def body_for(kind: str, text: str, rng: random.Random) -> tuple[str, dict]:
    body = {"model": "smollm2", "max_tokens": rng.randint(16, 64), "temperature": rng.choice([0, 0.8]),
            "seed": rng.randrange(2**32), "stream": kind.endswith("stream")}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if kind.startswith("chat"):
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Continue: {text}"}]}
    return "/v1/completions", {**body, "prompt": text}


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln and not ln.startswith("#")}


def histogram_quantile(metrics: dict, name: str, q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets (linear within the bucket)."""
    buckets = sorted((float(k.split('le="')[1].rstrip('"}')), v) for k, v in metrics.items()
                     if k.startswith(name + "_bucket") and "+Inf" not in k)
    total = metrics.get(name + "_count", 0)
    if not total:
        return None
    rank, lo, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            return lo + (le - lo) * (rank - below) / max(count - below, 1e-9)
        lo, below = le, count
    return buckets[-1][0] if buckets else None


async def client_loop(port, rng, texts, stop_at, results, sent):
    while time.monotonic() < stop_at:
        kind = rng.choice(KINDS)
        path, body = body_for(kind, rng.choice(texts), rng)
        sent[kind] = sent.get(kind, 0) + 1
        result = await request(port, path, body)
        results.append((kind, result))


async def sample_rss(pid, start, stop_at, series):
    while time.monotonic() < stop_at:
        series.append((round(time.monotonic() - start, 1), rss_kib(pid)))
        await asyncio.sleep(2)


def start_server(port: int, batch: int, log) -> subprocess.Popen:
    """The server's log goes to a file: a pipe nobody reads would block its access log."""
    proc = subprocess.Popen([sys.executable, "-m", "ffl_backend.serve.cli", "--port", str(port),
                             "--served-model-name", "smollm2", "--max-batch-size", str(batch)],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 900
    while True:
        assert proc.poll() is None, Path(log.name).read_text()[-3000:]
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                return proc
        except OSError:
            pass
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(1)


def summarize(results, sent, rss, duration, before, after, warmup_s) -> dict:
    done = [r for _, r in results]
    streams = [r for k, r in results if k.endswith("stream") and r.ok]
    ttft = [r.ttft for r in streams if r.ttft is not None]
    gaps = [g for r in streams for g in r.gaps]
    tokens = sum(r.completion_tokens for r in done if r.ok)
    base = [kib for t, kib in rss if warmup_s <= t < 2 * warmup_s]
    last = [kib for t, kib in rss if t >= rss[-1][0] - warmup_s]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after
             if k.startswith(("ffl_generation_tokens_total", "ffl_requests_cancelled_total", "ffl_request_errors_total",
                              "ffl_requests_preempted_total", "ffl_http_requests_total", "ffl_requests_finished"))}
    return {
        "requests_sent": sum(sent.values()), "requests_answered": len(done),
        "lost": sum(sent.values()) - len(done), "errors": sum(not r.ok for r in done),
        "error_samples": [r.error for r in done if not r.ok][:5],
        "by_kind": {k: sum(1 for kk, _ in results if kk == k) for k in KINDS},
        "completion_tokens": tokens, "tokens_per_s": round(tokens / duration, 2),
        "requests_per_s": round(len(done) / duration, 3),
        "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99), "n": len(ttft)},
        "inter_token_s": {"p50": percentile(gaps, 50), "p99": percentile(gaps, 99), "n": len(gaps)},
        "rss_mib": {"after_warmup_median": round(statistics.median(base) / 1024, 1) if base else None,
                    "last_window_median": round(statistics.median(last) / 1024, 1) if last else None,
                    "drift_percent": round(100 * (statistics.median(last) / statistics.median(base) - 1), 2)
                    if base and last else None, "max": round(max(k for _, k in rss) / 1024, 1),
                    "series": rss[::5]},
        "server_metrics": {"delta": delta,
                           "ttft_s": {"p50": histogram_quantile(after, "ffl_time_to_first_token_seconds", 0.5),
                                      "p99": histogram_quantile(after, "ffl_time_to_first_token_seconds", 0.99)},
                           "inter_token_s": {"p50": histogram_quantile(after, "ffl_inter_token_latency_seconds", 0.5),
                                             "p99": histogram_quantile(after, "ffl_inter_token_latency_seconds",
                                                                       0.99)}},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=300)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--warmup", type=float, default=60, help="seconds before RSS must be flat")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from ffl_backend.bench.grid import environment

    log = tempfile.NamedTemporaryFile("w+", prefix="ffl-serve-load-", suffix=".log", delete=False)
    proc = start_server(args.port, args.max_batch_size, log)
    texts, results, sent, rss = snippets(), [], {}, []
    try:
        before = scrape(args.port)

        async def run():
            start = time.monotonic()
            stop_at = start + args.duration
            sampler = asyncio.create_task(sample_rss(proc.pid, start, stop_at, rss))
            await asyncio.gather(*(client_loop(args.port, random.Random(i), texts, stop_at, results, sent)
                                   for i in range(args.clients)))
            await sampler
            return time.monotonic() - start

        wall = asyncio.run(run())
        after = scrape(args.port)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        log.close()
    lines = Path(log.name).read_text().splitlines()
    summary = summarize(results, sent, rss, wall, before, after, args.warmup)
    env = environment()
    result = {"benchmark": "serve_load", "model": "SmolLM2-135M-Instruct (bf16 checkpoint)",
              "clients": args.clients, "duration_s": round(wall, 1), "max_batch_size": args.max_batch_size,
              **summary, "server_exit_status": proc.returncode, "server_log_lines": len(lines),
              "server_log_tail": lines[-3:],
              "command": "python " + " ".join(sys.argv), "environment": env}
    cpu = "cpu_amd_epyc" if "AMD" in env["machine"] else "cpu_xeon" if "Xeon" in env["machine"] else "cpu"
    out = Path(args.out or ROOT / f"benchmarks/results/serve_load_smollm2_{cpu}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("environment", "rss_mib", "server_metrics")},
                     indent=1))
    print(f"-> {out}")
    return 0 if summary["errors"] == 0 and summary["lost"] == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
