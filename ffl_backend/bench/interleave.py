"""Interleaved timing: every configuration's process stays alive and the timed generates go round
robin, one per configuration per round, so a drift of the machine's speed hits every configuration
alike and the ratios between them stay comparable.

Why: on a shared or virtualized CPU the same configuration can run much faster in one phase than in
another (docs/performance.md#the-benchmark-harness); when configurations run one after the other, a
ratio between two rows says as much about when each ran as about the configurations. Interleaving keeps
what isolation gives -- each configuration's compile, allocator and peak RSS are still its own
process's -- at the price of holding every configuration's model in memory at once.

Set-up (load, quantize, compile, warm-up) still happens one configuration at a time, while the
others wait idle, so compile times are measured alone; quantized configurations are set up first
(`setup_order`). Rounds alternate direction (A B C, C B A, ...) so that no configuration always
follows the same neighbour. The memory every process holds at once is estimated first; where it
would not fit, the grid runs on the alternating schedule instead (grid.choose_schedule).

The alternating schedule (`time_alternating`), for models whose configurations' processes cannot all
be alive at once (two bf16 copies of an 8B model do not fit a 24 GiB machine): one configuration
process at a time, but the configurations alternate round by round in the same order (round_orders),
so round i of every configuration runs within the same stretch of time, a drift of the machine's
speed hits all alike and the median of per-round ratios stays meaningful. Each round is a fresh
process (worker.run_one): set up, warm-up, one timed generate (as the interleaved schedule times one
per configuration per round), exit. What makes the later rounds' set-up fast: each configuration
keeps its own Inductor/Triton cache folder across its rounds, so only its first round compiles cold;
and a quantized configuration's first round saves its quantized model (`save_quantized`, into that
folder), which the later rounds load (`load_quantized`) instead of quantizing again -- minutes per
round for a 3B model's fitted int4 grids. Every round's tokens are compared with the first round's
(`deterministic`), so a saved model that decoded differently would show.
A configuration's row keeps the interleaved schedule's shape (merge_rounds): `decode_tok_s_all[i]`
(and `ttft_s_all[i]`) come from round i; load, quantize and cold compile are its first round's (what a
user pays on a first start); compile_warm_s is the median of the later rounds' first generate minus
their timed one (no extra process is needed for it); peak RSS is the highest of its rounds' processes
(as a rule the first, which loads the checkpoint and quantizes), every round's in `peak_rss_mb_all`.
`--schedule sequential` runs one process per configuration, all its generates in it, one after another.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile


def worker_env(cache_dir: str, code: str | None = None) -> dict:
    """A worker's environment: its own Inductor and Triton cache folder; with `code` (another checkout of
    fastflow, `ffl-bench --code`) that checkout's package first on the path of the processes the worker
    starts (the worker itself puts it first: worker_command)."""
    path = {"PYTHONPATH": os.pathsep.join(filter(None, (code, os.environ.get("PYTHONPATH"))))} if code else {}
    return {**os.environ, **path, "TORCHINDUCTOR_CACHE_DIR": cache_dir,
            "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton"),
            # On by default in this torch; set so the warm run measures the caches, not a default.
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def worker_command(cfg: dict, *args: str) -> list[str]:
    """The worker's command line: one interpreter, or `tp` of them under torchrun (tensor parallel)."""
    tp = cfg.get("tp", 1)
    start = ["-m", "ffl_backend.bench.worker"]
    if cfg.get("code"):  # `-m` would put the current folder, maybe another checkout, ahead of PYTHONPATH
        start = ["-c", f"import runpy, sys; sys.path.insert(0, {cfg['code']!r}); "
                       "runpy.run_module('ffl_backend.bench.worker', run_name='__main__', alter_sys=True)"]
    worker = [sys.executable, *start, *args, json.dumps(cfg)]
    if tp == 1:
        return worker
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", "--no-python",
            *worker]


def run_worker(cfg: dict, cache_dir: str) -> dict:
    proc = subprocess.run(worker_command(cfg), capture_output=True, text=True,
                          env=worker_env(cache_dir, cfg.get("code")))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": error_line(proc.stderr or proc.stdout) or f"worker exited with {proc.returncode}"}
    return json.loads(lines[-1])


def error_line(text: str) -> str | None:
    """The innermost exception of a worker's traceback. Dynamo appends advice lines after it and
    wraps backend failures ("BackendCompilerFailed ... raised:" then the cause), so the last line
    naming an exception type is the informative one. Under torchrun, ranks prefix their lines with
    "[rankN]: " and torchrun ends with its own ChildFailedError, which says less than the rank's."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line.strip()) for line in text.splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Failed|Interrupt)\b", line)
             and not line.startswith("torch.distributed.elastic")]
    return (named or lines or [None])[-1]


class WorkerProcess:
    """A `worker --serve` process for one configuration, spoken to one JSON line at a time."""

    def __init__(self, cfg: dict, cache_dir: str):
        # stderr goes to a file: a pipe nobody reads would block the worker once it fills up.
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(worker_command(cfg, "--serve"),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     env=worker_env(cache_dir, cfg.get("code")))
        self.error = None
        self.read()  # {"ready": true} once set up

    def read(self) -> dict:
        """The worker's next JSON line; on exit or a bad line, `error` is set and {} returned."""
        if self.error is None:
            for line in self.proc.stdout:
                if line.startswith("{"):
                    reply = json.loads(line)
                    if "error" not in reply:
                        return reply
                    self.error = reply["error"]
                    break
            else:
                self.proc.wait()
                self.stderr.seek(0)
                self.error = error_line(self.stderr.read()) or f"worker exited with {self.proc.returncode}"
        return {}

    def request(self, what: str) -> dict:
        if self.error is not None:
            return {}
        try:
            self.proc.stdin.write(what + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker is gone; read() says why
        return self.read()

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.stderr.close()


# What one configuration's process holds besides its weights: torch, transformers and Inductor, and the
# compile's own state -- their measured sizes (docs/performance.md#the-benchmark-harness), rounded up.
RUNTIME_GB = 1.0
# A quantized model against its unquantized one: int8 with a bf16 embedding is 0.61x of bf16 on
# SmolLM2-135M and 0.53x on 1.7B; int4 less.
QUANTIZED_SHARE = 0.65
CUDA_CONTEXT_GB = 0.6  # a CUDA context with cuBLAS and Triton loaded, rounded up
# A llama.cpp worker holds llama_cpp's import (tens of MB, docs/performance.md#the-benchmark-harness) and the
# pages of its GGUF file it reads.
LLAMACPP_RUNTIME_GB = 0.2
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def checkpoint_gb(folder: str) -> tuple[float, int]:
    """(GB of weight files, bytes per parameter they are stored with) of a Hugging Face folder."""
    names = [n for n in os.listdir(folder) if n.endswith((".safetensors", ".bin", ".pt"))]
    size = sum(os.path.getsize(os.path.join(folder, n)) for n in names) / 1e9
    try:
        with open(os.path.join(folder, "config.json")) as fh:
            config = json.load(fh)
        stored = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    except (OSError, ValueError):
        stored = "bfloat16"
    return size, _ITEMSIZE.get(str(stored).replace("torch.", ""), 2)


def _weights_gb(cfg: dict) -> float:
    size, stored = checkpoint_gb(cfg["model"])
    weights = size * _ITEMSIZE.get(cfg["dtype"], 2) / stored
    return weights * (QUANTIZED_SHARE if cfg.get("quant", "none") != "none" else 1.0)


def _process_gb(cfg: dict) -> float:
    """One configuration's process: a llama.cpp row's file (llamacpp.prepare wrote it) and its small
    runtime, or a torch row's runtime and weights."""
    if cfg.get("backend") == "llamacpp" and cfg.get("gguf") and os.path.exists(cfg["gguf"]):
        return LLAMACPP_RUNTIME_GB + os.path.getsize(cfg["gguf"]) / 1e9
    if cfg.get("onnx_dir"):  # ONNX Runtime holds the file's weights (prepacked: up to twice)
        return LLAMACPP_RUNTIME_GB + 2 * cfg.get("weight_bytes", 0) / 1e9
    return RUNTIME_GB + _weights_gb(cfg)


def memory_needed_gb(cfgs: list[dict]) -> float:
    """A generous estimate of the host memory every configuration's process holds at once when
    interleaved (a GPU configuration's weights counted on the host too: they are loaded there first)."""
    return sum(_process_gb(cfg) for cfg in cfgs)


def gpu_memory_needed_gb(cfgs: list[dict]) -> float:
    """The same for GPU memory: each CUDA process holds a context and its model."""
    return sum(CUDA_CONTEXT_GB + _weights_gb(cfg) for cfg in cfgs if str(cfg.get("device", "cpu")).startswith("cuda"))


def available_memory_gb() -> float | None:
    """MemAvailable of /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as fh:
            return next(int(line.split()[1]) / 1e6 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def available_gpu_memory_gb() -> float | None:
    """Free memory of the current CUDA device, or None without one."""
    import torch

    return torch.cuda.mem_get_info()[0] / 1e9 if torch.cuda.is_available() else None


def fits_in_memory(cfgs: list[dict]) -> tuple[bool, str]:
    """Whether interleaving `cfgs` should fit in this machine's available memory, host and (for CUDA
    configurations) GPU, with 20% to spare; and the figures that say so."""
    checks = [("", memory_needed_gb(cfgs), available_memory_gb)]
    if any(str(cfg.get("device", "cpu")).startswith("cuda") for cfg in cfgs):
        checks.append(("GPU ", gpu_memory_needed_gb(cfgs), available_gpu_memory_gb))
    figures = []
    for kind, need, available in checks:
        free = available()
        if free is None:
            figures.append(f"~{need:.1f} GB {kind}memory needed, available unknown")
            continue
        figures.append(f"~{need:.1f} GB {kind}memory needed for all configurations at once, {free:.1f} GB available")
        if need > 0.8 * free:
            return False, figures[-1]
    return True, "; ".join(figures)


def setup_order(cfgs: list[dict]) -> list[int]:
    """Quantized configurations first. A process that quantizes hands the checkpoint's pages back as
    it goes (quant/file_pages.py), but the kernel cannot page out what another process also maps:
    with an unquantized process of the same checkpoint alive, the quantizing process would count the
    whole checkpoint in its peak RSS (for a 1.7B int8 model more than twice its own peak:
    docs/performance.md#the-benchmark-harness)."""
    return sorted(range(len(cfgs)), key=lambda i: cfgs[i].get("quant", "none") == "none")


def round_orders(n: int, rounds: int) -> list[list[int]]:
    """The order configurations are timed in, round by round: forward, backward, forward, ..."""
    forward = list(range(n))
    return [forward if r % 2 == 0 else forward[::-1] for r in range(rounds)]


def time_interleaved(cfgs: list[dict], cache_dirs: list[str], repeats: int, on_progress=None) -> list[dict]:
    """Set every configuration up in its own process, one after another, then time `repeats` rounds
    of one generate each; returns each configuration's summary (or {"error": ...}), in `cfgs` order.
    Each summary's `decode_tok_s_all[i]` comes from round i. `on_progress(i, stage)` is called after
    set-up i (stage "set up") and after round i (stage "round")."""
    workers = [None] * len(cfgs)
    try:
        for step, i in enumerate(setup_order(cfgs)):
            workers[i] = WorkerProcess(cfgs[i], cache_dirs[i])
            if on_progress:
                on_progress(step, "set up")
        for r, order in enumerate(round_orders(len(workers), repeats)):
            for i in order:
                workers[i].request("time")
            if on_progress:
                on_progress(r, "round")
        summaries = [w.request("finish") for w in workers]
        return [{"error": w.error} if w.error is not None else s for w, s in zip(workers, summaries)]
    finally:
        for w in workers:
            if w is not None:
                w.close()


TORCH_BACKENDS = ("eager", "inductor", "fastflow")  # rows that load a transformers model (and may quantize it)
COMPILED = ("inductor", "fastflow")


def round_config(cfg: dict, cache_dir: str) -> dict:
    """One round's worker configuration: one timed generate; a quantized torch row (one process: a
    tensor-parallel row shards as it loads) names the folder its quantized model is kept in."""
    keep = (cfg["backend"] in TORCH_BACKENDS and cfg.get("quant", "none") != "none" and cfg.get("tp", 1) == 1)
    return {**cfg, "repeats": 1, **({"quantized_dir": os.path.join(cache_dir, "quantized")} if keep else {})}


def time_alternating(cfgs: list[dict], cache_dirs: list[str], repeats: int, on_progress=None) -> list[dict]:
    """`repeats` rounds; in each, every configuration (in round_orders' order) runs one process on its
    own cache folder. Returns each configuration's merged row (merge_rounds) or {"error": ...}, in
    `cfgs` order; a configuration whose round fails runs no further rounds. `on_progress(r, i, done)`
    is called after configuration i's process of round r (`done`: it was its last)."""
    rounds: list[list[dict]] = [[] for _ in cfgs]
    errors: list = [None] * len(cfgs)
    for r, order in enumerate(round_orders(len(cfgs), repeats)):
        for i in order:
            if errors[i] is not None:
                continue
            out = run_worker(round_config(cfgs[i], cache_dirs[i]), cache_dirs[i])
            if "error" in out:
                errors[i] = out["error"] if r == 0 else f"round {r + 1}: {out['error']}"
            else:
                rounds[i].append(out)
            if on_progress:
                on_progress(r, i, errors[i] is not None or r == repeats - 1)
    return [{"error": e} if e is not None else merge_rounds(cfg, rs) for cfg, rs, e in zip(cfgs, rounds, errors)]


def _all_or_none(flags: list):
    """True/False over every round; None where any round said None (rows held different prompts)."""
    return None if None in flags else all(flags)


def merge_rounds(cfg: dict, rounds: list[dict]) -> dict:
    """One row from the summaries of a configuration's round processes (each of one timed generate),
    with the keys a row of the interleaved schedule has (session.summarize_runs), per-round lists
    ordered by round."""
    first = rounds[0]
    rates = [r["decode_tok_s"] for r in rounds]
    ttfts = [r["ttft_s"] for r in rounds]
    rate, ttft = statistics.median(rates), statistics.median(ttfts)
    highest = max(rounds, key=lambda r: r.get("peak_rss_mb") or 0.0)
    warm = [r["compile_cold_s"] for r in rounds[1:]]  # later rounds start on warm caches
    res = {
        **first,
        **{key: highest.get(key) for key in ("peak_rss_mb", "runtime_rss_mb", "model_peak_rss_mb")},
        "generate_s": statistics.median(r["generate_s"] for r in rounds),
        "ttft_s": ttft, "ttft_s_all": ttfts, "prefill_tok_s": cfg.get("batch", 1) * cfg["prompt_len"] / ttft,
        "decode_tok_s": rate, "decode_tok_s_all": rates, "decode_tok_s_min": min(rates),
        "decode_tok_s_max": max(rates), "decode_spread_pct": 100 * (max(rates) - min(rates)) / rate,
        "compile_warm_s": statistics.median(warm) if warm and cfg["backend"] in COMPILED else None,
        "peak_rss_mb_all": [r.get("peak_rss_mb") for r in rounds],
        "load_s_all": [r.get("load_s") for r in rounds],
        "quantize_s_all": [r.get("quantize_s") for r in rounds],  # 0 where a round loaded the saved model
        "rows_equal": _all_or_none([r.get("rows_equal") for r in rounds]),
        "deterministic": all(r.get("deterministic", True) and r["tokens"] == first["tokens"] for r in rounds),
        "rounds": len(rounds),
    }
    for key in ("recompiles", "graphs_compiled_while_timed", "cuda_peak_mb"):
        values = [r[key] for r in rounds if r.get(key) is not None]
        res[key] = max(values) if values else first.get(key)
    if first.get("weight_bytes"):  # every decode step reads the weights once, whatever the batch
        res["effective_gbs"] = first["weight_bytes"] * rate / cfg.get("batch", 1) / 1e9
    return res
