"""Interleaved timing: every configuration's process stays alive and the timed generates go round
robin, one per configuration per round, so a drift of the machine's speed hits every configuration
alike and the ratios between them stay comparable.

Why: on a shared or virtualized CPU the same configuration can run much faster in one phase than in
another (docs/performance.md#the-benchmark-harness); when configurations run one after the other, a
ratio between two rows says as much about when each ran as about the configurations. Interleaving keeps
what isolation gives -- each configuration's compile, allocator and peak RSS are still its own
process's -- at the price of holding every configuration's model in memory at once
(`--schedule sequential` runs them one at a time).

Set-up (load, quantize, compile, warm-up) still happens one configuration at a time, while the
others wait idle, so compile times are measured alone; quantized configurations are set up first
(`setup_order`). Rounds alternate direction (A B C, C B A, ...) so that no configuration always
follows the same neighbour. The memory every process holds at once is estimated first; where it
would not fit, the grid runs sequentially instead (grid.choose_schedule).
"""
from __future__ import annotations

import json
import os
import re
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

