"""Peak RSS of `optimize()` + a short generate, above the runtime, against weight + KV cache bytes.

    .venv/bin/python benchmarks/memory_3b.py --model ~/.cache/ffl_backend/llama-3.2-3b-random \
        --quant none int8 int4-all --out memory_3b_<cpu>

Each configuration runs in a fresh process, one after another (never two big models at once), under
`/usr/bin/time -v` where it exists. The process imports what the configuration runs on (torch,
transformers, ffl_backend, the model's modeling code, Inductor: what ffl-bench's `import_runtime`
imports) and reads its RSS: the runtime. Then `from_pretrained` (bf16), `optimize(model, quant=...)`
with its defaults, and two greedy generates of --new-tokens tokens after a --prompt-len token prompt
(the first compiles decode). A thread samples /proc/self/status every few milliseconds and records,
per phase (load; optimize's own phases -- quantize, setup, kernels, autotune --; setup's
share_fused_storage; each generate), the highest RSS seen with its anonymous and file-backed parts;
VmHWM at each phase's end says in which phase the process peaked.

The ratio is issue 47's acceptance: (peak RSS - runtime RSS) / (weight bytes + KV cache bytes), where
weight bytes are the bytes of every distinct tensor the optimized model holds (parameters, buffers and
the CPU forms quantized modules keep as attributes; overlapping views counted once), KV bytes the
static cache the decode loop allocated. Timing figures are smoke only.

Writes benchmarks/results/<--out>.json with machine and versions (ffl_backend.bench.grid.environment).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def status() -> dict:
    """/proc/self/status memory fields in bytes."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key = line.split(":", 1)[0]
            if key in FIELDS:
                out[key] = int(line.split()[1]) * 1024
    return out


class Sampler:
    """Highest RSS per phase label (sampled every `interval` s) with its anon / file parts."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.label, self.order = interval, "outside", []
        self.peaks: dict[str, dict] = {}
        self.ends: dict[str, dict] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _record(self) -> None:
        s = status()
        with self._lock:
            best = self.peaks.get(self.label)
            if best is None or s["VmRSS"] > best["VmRSS"]:
                self.peaks[self.label] = s

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._record()

    def start(self) -> None:
        self._thread.start()

    def enter(self, label: str) -> str:
        self._record()
        with self._lock:
            previous, self.label = self.label, label
            if label not in self.order:
                self.order.append(label)
        self._record()
        return previous

    def leave(self, label: str, previous: str) -> None:
        self._record()
        self.ends[label] = status()
        with self._lock:
            self.label = previous

    def phase(self, label: str):
        sampler = self

        class _Phase:
            def __enter__(self):
                self.previous = sampler.enter(label)

            def __exit__(self, *exc):
                sampler.leave(label, self.previous)

        return _Phase()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def table(self, runtime: int) -> list[dict]:
        gb = 1e9
        rows = []
        for label in self.order:
            peak, end = self.peaks.get(label), self.ends.get(label)
            if peak is None:
                continue
            row = {"phase": label, "peak_rss_above_runtime_gb": round((peak["VmRSS"] - runtime) / gb, 3),
                   "at_peak_anon_gb": round(peak["RssAnon"] / gb, 3), "at_peak_file_gb": round(peak["RssFile"] / gb, 3)}
            if end is not None:
                row.update(end_rss_above_runtime_gb=round((end["VmRSS"] - runtime) / gb, 3),
                           end_anon_gb=round(end["RssAnon"] / gb, 3), end_file_gb=round(end["RssFile"] / gb, 3),
                           end_hwm_above_runtime_gb=round((end["VmHWM"] - runtime) / gb, 3))
            rows.append(row)
        return rows


def _instrument(sampler: Sampler) -> None:
    """Phase labels inside optimize: every progress phase, and share_fused_storage apart."""
    from ffl_backend import progress
    from ffl_backend.quant import weight_layout

    call = progress.Phases.__call__

    def phased(self, name, detail=None):
        inner = call(self, name, detail)

        class _Both:
            def __enter__(s):
                s.previous = sampler.enter(f"{self.what}/{name}")
                return inner.__enter__()

            def __exit__(s, *exc):
                try:
                    return inner.__exit__(*exc)
                finally:
                    sampler.leave(f"{self.what}/{name}", s.previous)

        return _Both()

    progress.Phases.__call__ = phased
    share = weight_layout.share_fused_storage

    def share_phased(model):
        with sampler.phase("optimize/setup/share_fused_storage"):
            return share(model)

    weight_layout.share_fused_storage = share_phased


def child(args) -> dict:
    import torch
    import torch._inductor.compile_fx  # noqa: F401  (compiled backends import it: part of the runtime)
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import ffl_backend
    from ffl_backend.bench.session import held_tensor_bytes, prompt_ids

    torch.set_num_threads(args.threads)
    config = transformers.AutoConfig.from_pretrained(args.model)
    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imports the modeling module
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    runtime = status()["VmRSS"]
    sampler = Sampler()
    _instrument(sampler)
    sampler.start()
    times = {}
    t0 = time.perf_counter()
    with sampler.phase("load"):
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    times["load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with sampler.phase("optimize"):
        ffl_backend.optimize(model, quant=None if args.quant == "none" else args.quant)
    times["optimize_s"] = time.perf_counter() - t0
    ids = prompt_ids(tokenizer, args.prompt_len)
    tokens = []
    for i in range(2):
        t0 = time.perf_counter()
        with sampler.phase(f"generate{i + 1}"), torch.inference_mode():
            out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None)
        times[f"generate{i + 1}_s"] = time.perf_counter() - t0
        tokens.append(out[0, ids.shape[1]:].tolist())
    sampler.stop()
    end = status()
    weights = held_tensor_bytes(model)
    loop = getattr(model.generate, "__wrapped__", None)
    kv = loop.cache_bytes() if hasattr(loop, "cache_bytes") else ffl_backend.api.kv_cache_bytes(
        model.config, 1, ffl_backend.api.default_max_seq_len(model.config), model.dtype)
    peak = end["VmHWM"]
    return {"quant": args.quant, "runtime_rss_gb": round(runtime / 1e9, 3),
            "peak_rss_gb": round(peak / 1e9, 3), "peak_above_runtime_gb": round((peak - runtime) / 1e9, 3),
            "weight_gb": round(weights / 1e9, 3), "kv_cache_gb": round(kv / 1e9, 3),
            "ratio_peak_above_runtime_over_weights_plus_kv": round((peak - runtime) / (weights + kv), 3),
            "rss_end_above_runtime_gb": round((end["VmRSS"] - runtime) / 1e9, 3),
            "rss_end_anon_gb": round(end["RssAnon"] / 1e9, 3), "rss_end_file_gb": round(end["RssFile"] / 1e9, 3),
            "tokens_equal_between_generates": tokens[0] == tokens[1],
            **{k: round(v, 2) for k, v in times.items()}, "phases": sampler.table(runtime)}


def _max_rss_time_v(stderr: str):
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    return int(found.group(1)) * 1024 if found else None


def parent(args) -> list[dict]:
    rows = []
    timer = ["/usr/bin/time", "-v"] if os.path.exists("/usr/bin/time") else []
    for quant in args.quant:
        cmd = [*timer, sys.executable, __file__, "--child", "--model", str(args.model), "--quant", quant,
               "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
               "--threads", str(args.threads)]
        print("running:", " ".join(cmd), file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"configuration {quant} failed (exit {proc.returncode})")
        row = json.loads(lines[-1])
        max_rss = _max_rss_time_v(proc.stderr)
        if max_rss is not None:
            row["time_v_max_rss_gb"] = round(max_rss / 1e9, 3)
        print(json.dumps({k: v for k, v in row.items() if k != "phases"}), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--quant", nargs="+", default=["none", "int8", "int4-all"])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="results file name under benchmarks/results/ (no suffix); none: print only")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = Path(args.model).expanduser()
    if args.child:
        args.quant = args.quant[0]
        print(json.dumps(child(args)), flush=True)
        return
    rows = parent(args)
    if args.out:
        from ffl_backend.bench.outputs import write_script_results

        write_script_results(ROOT / "benchmarks" / "results" / f"{args.out}.json", "benchmarks/memory_3b.py",
                             results=rows)

if __name__ == "__main__":
    main()
