"""The benchmark grid: every combination of the requested settings, each isolated, then compared.

Isolation: each configuration runs in a fresh interpreter (worker.py) with its own, new Inductor and
Triton cache folder, so no configuration can warm another's compile caches, share its allocator or
raise its peak-RSS high-water mark. Compiled configurations then run a second fresh process on that
same folder: its first generate is the *warm* compile time, i.e. what a user pays on the next start
of the same model when Inductor's on-disk caches already hold the compiled code (Dynamo still traces).
Schedule: by default every configuration's process stays alive and the timed generates go round robin
(interleave.py), so a drift of the machine's speed cancels out of the ratios; where they would not all
fit in memory, "alternating" runs one process at a time but alternates the configurations round by
round (interleave.py), which keeps the per-round ratios; "sequential" runs one configuration after
another, all its generates in one process.
Outputs are checked before speeds are compared: greedy tokens against eager of the same dtype, batch
and prompt (unquantized), as the length of the matching prefix.
"""
from __future__ import annotations

import itertools
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from ..quant.schemes import PRESETS, SCHEMES
from . import llamacpp, onnxruntime_rows
from .interleave import fits_in_memory, memory_needed_gb, run_worker, setup_order, time_alternating, time_interleaved

BACKENDS = ("eager", "inductor", "fastflow", "llamacpp", *onnxruntime_rows.BACKENDS)
DEFAULT_BACKENDS = BACKENDS[:3]  # the others need optional packages (and an export): asked for by name
OUT_OF_TORCH = ("llamacpp", *onnxruntime_rows.BACKENDS)  # rows that run no torch model: nothing compiles
DTYPES = ("float32", "bfloat16")
QUANTS = ("none", *SCHEMES, *PRESETS)  # "none": the model as loaded
SCHEDULES = ("interleaved", "alternating", "sequential")
PAIRED = ("interleaved", "alternating")  # decode_tok_s_all[i] of every row comes from round i


def skip_reason(cfg: dict) -> str | None:
    """Why a combination of the cartesian product is not run, or None.

    Quantized linears take their scales in the activation dtype and are built for bf16/fp16
    activations; with fp32 activations they are several times slower than fp32 F.linear
    (docs/performance.md#the-benchmark-harness), so an fp32 x scheme row would time a configuration
    nobody should use.
    llama.cpp and ONNX Runtime rows have reasons of their own (their modules' skip_reason)."""
    if cfg["backend"] in OUT_OF_TORCH and cfg.get("tp", 1) > 1:
        return f"{cfg['backend']} rows run in one process"
    if cfg["backend"] == "llamacpp":
        return llamacpp.skip_reason(cfg)
    if cfg["backend"] in onnxruntime_rows.BACKENDS:
        return onnxruntime_rows.skip_reason(cfg)
    if cfg["quant"] != "none" and cfg["dtype"] == "float32":
        return "quantized schemes run on bfloat16/float16 models only"
    return None


def configurations(model, backends, dtypes, quants, batches, prompt_lens, fastflow_variants=(None,), tps=(1,),
                   **common) -> tuple[list, list]:
    """(configurations to run, skipped ones with their reason), eager first within each group so
    that the reference tokens exist before anything is compared with them. Each of
    `fastflow_variants` (backend options, None = the defaults) makes a fastflow row of its own; each
    of `tps` > 1, rows split over that many tensor-parallel ranks (torchrun) of their own."""
    order = {b: i for i, b in enumerate(BACKENDS)}
    todo, skipped = [], []
    for dtype, quant, batch, plen, tp, backend in itertools.product(
            dtypes, quants, batches, prompt_lens, tps, sorted(backends, key=order.get)):
        cfg = {"model": str(model), "backend": backend, "dtype": dtype, "quant": quant, "batch": batch,
               "prompt_len": plen, **({"tp": tp} if tp > 1 else {}), **common}
        variants = [None]
        if backend == "fastflow":
            variants = [{**(cfg.get("options") or {}), **(v or {})} or None for v in fastflow_variants]
        for options in variants:  # fastflow's options mean nothing to the other backends
            row = {**cfg, "options": options}
            reason = skip_reason(row)
            (skipped if reason else todo).append({**row, "reason": reason} if reason else row)
    return todo, skipped


def label(cfg: dict) -> str:
    """e.g. "bfloat16 int8 fastflow b1 p16"; a llama.cpp row names the GGUF type it runs."""
    quant = "" if cfg["quant"] == "none" else f" {cfg['quant']}"
    backend = cfg["backend"]
    if backend == "llamacpp" and llamacpp.gguf_type(cfg):
        backend += f"({llamacpp.gguf_type(cfg)})"
    variant = "".join(f" {k}={v}" for k, v in (cfg.get("options") or {}).items() if k != "mode")
    padded = " left-padded" if cfg.get("left_pad") and cfg["batch"] > 1 else ""
    split = f" tp{cfg['tp']}" if cfg.get("tp", 1) > 1 else ""
    code = f" @{cfg['code_rev']}" if cfg.get("code") else ""
    return f"{cfg['dtype']}{quant} {backend}{variant} b{cfg['batch']} p{cfg['prompt_len']}{padded}{split}{code}"


def code_revision(path: str) -> str:
    """A checkout's short commit (its folder name where git cannot say)."""
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or os.path.basename(os.path.abspath(path))
    except OSError:
        return os.path.basename(os.path.abspath(path))


def with_code_versions(todo: list[dict], codes) -> list[dict]:
    """Each row once more per other checkout in `codes` (`ffl-bench --code`), right after it: the same
    configuration run by that checkout's package, in the same interleaved rounds."""
    revisions = {path: code_revision(path) for path in codes}
    return [variant for cfg in todo
            for variant in (cfg, *({**cfg, "code": path, "code_rev": rev} for path, rev in revisions.items()))]


def versus_this_checkout(results: list[dict], paired: bool) -> None:
    """A row of another checkout: its decode tok/s over the same row of this one (`vs_this_checkout`,
    with `paired` also the median of per-round ratios)."""
    ours = {label(r): r for r in results if not r.get("code") and "decode_tok_s" in r}
    for r in results:
        base = ours.get(label({**r, "code": None}))
        if r.get("code") and "decode_tok_s" in r and base is not None:
            _ratios(r, base, "vs_this_checkout", paired)


def run_isolated(cfg: dict, warm_compile: bool = True) -> dict:
    """One configuration: a cold process, then (compiled backends) a warm one on the same caches."""
    cache_dir = tempfile.mkdtemp(prefix="ffl-bench-")
    try:
        return _with_warm_compile(cfg, run_worker(cfg, cache_dir), cache_dir, warm_compile)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def _with_warm_compile(cfg: dict, measured: dict, cache_dir: str, warm_compile: bool) -> dict:
    """The result row of a measured configuration, with compile_warm_s from a second process on its
    (now warm) cache folder."""
    res = {**cfg, **measured, "compile_warm_s": None}
    if warm_compile and cfg["backend"] not in ("eager", *OUT_OF_TORCH) and "error" not in res:
        warm = run_worker({**cfg, "mode": "warm"}, cache_dir)
        if "error" in warm:
            res["error"] = "warm run: " + warm["error"]
        else:
            res["compile_warm_s"] = max(0.0, warm["first_generate_s"] - res["generate_s"])
    return res


def choose_schedule(requested: str, todo: list[dict], log=print) -> tuple[str, str]:
    """(schedule, why): `requested`, unless interleaving would hold more memory than the machine has:
    then alternating, said in one line of the log (an out-of-memory kill would lose the whole grid)."""
    if requested != "interleaved":
        return requested, "requested"
    fits, figures = fits_in_memory(todo)
    if fits:
        return requested, f"every configuration fits in memory at once ({figures})"
    largest = max(memory_needed_gb([cfg]) for cfg in todo)
    log(f"  interleaved schedule would not fit ({figures}): alternating schedule instead -- one configuration "
        f"process at a time (the largest ~{largest:.1f} GB), configurations alternating round by round")
    return "alternating", f"interleaved would not fit: {figures}"


def run_sequential(todo: list[dict], warm_compile: bool = True, bar=None) -> list[dict]:
    """Every configuration in its own process, one after another."""
    results = []
    for cfg in todo:
        if bar:
            bar.show(f"running {label(cfg)}")
        results.append(run_isolated(cfg, warm_compile))
        if bar:
            bar.show(f"finished {label(cfg)}", finished=True)
    return results


def run_alternating(todo: list[dict], repeats: int, bar=None) -> list[dict]:
    """One configuration process at a time, alternating round by round (interleave.time_alternating), each
    configuration on a cache folder of its own kept across its rounds."""
    cache_dirs = [tempfile.mkdtemp(prefix="ffl-bench-") for _ in todo]
    try:
        def progress(r, i, done):
            if bar:
                bar.show(f"round {r + 1}/{repeats}: {'finished' if done else 'ran'} {label(todo[i])}", finished=done)

        rows = time_alternating(todo, cache_dirs, repeats, on_progress=progress)
        return [{**cfg, **row} for cfg, row in zip(todo, rows)]
    finally:
        for cache_dir in cache_dirs:
            shutil.rmtree(cache_dir, ignore_errors=True)


def run_interleaved(todo: list[dict], repeats: int, warm_compile: bool = True, bar=None) -> list[dict]:
    """Every configuration in its own process, all alive at once, timed round robin (interleave.py)."""
    cache_dirs = [tempfile.mkdtemp(prefix="ffl-bench-") for _ in todo]
    try:
        order = setup_order(todo)

        def progress(i, stage):
            if bar and stage == "set up":
                bar.show(f"set up {label(todo[order[i]])} ({i + 1}/{len(todo)}); timing starts once all are")
            elif bar:
                bar.show(f"timed round {i + 1}/{repeats} (one generate per configuration)")

        summaries = time_interleaved(todo, cache_dirs, repeats, on_progress=progress)
        results = []
        for cfg, cache_dir, summary in zip(todo, cache_dirs, summaries):
            results.append(_with_warm_compile(cfg, summary, cache_dir, warm_compile))
            if bar:
                bar.show(f"finished {label(cfg)}", finished=True)
        return results
    finally:
        for cache_dir in cache_dirs:
            shutil.rmtree(cache_dir, ignore_errors=True)


def _group(r: dict) -> tuple:
    return r["dtype"], r["batch"], r["prompt_len"]


def agreement(results: list[dict]) -> None:
    """Annotate results with the matching prefix of their greedy tokens against unquantized eager of
    the same dtype, batch and prompt length."""
    eager = {_group(r): r["tokens"] for r in results if r["backend"] == "eager" and r.get("quant", "none") == "none"
             and "tokens" in r and not r.get("code")}
    for r in results:
        ref = eager.get(_group(r))
        if ref is None or "tokens" not in r:
            continue
        n = next((i for i, (a, b) in enumerate(zip(r["tokens"], ref)) if a != b), min(len(ref), len(r["tokens"])))
        r["matching_prefix"], r["tokens_equal_eager"] = n, r["tokens"] == ref


def _ratios(r: dict, b: dict, name: str, paired: bool) -> None:
    """`name` (ratio of medians) and, with `paired`, `name`_paired: the median of per-round ratios."""
    r[name] = r["decode_tok_s"] / b["decode_tok_s"]
    if paired:
        r[f"{name}_paired"] = statistics.median(
            x / y for x, y in zip(r["decode_tok_s_all"], b["decode_tok_s_all"], strict=True))


def speedups(results: list[dict], paired: bool = False) -> None:
    """decode tok/s relative to HF static cache + Inductor (unquantized) of the same group, and of
    fastflow rows relative to the llama.cpp row of the same dtype, quantization, batch and prompt (the
    GGUF type standing for that quantization): the ratio of medians, and with `paired` (interleaved
    rounds: `decode_tok_s_all[i]` all come from round i) also the median of the per-round ratios,
    which a drift of the machine's speed cancels out of. Against ONNX Runtime (float32 rows only: its
    CPU kernels have no bfloat16) every fastflow row of the same quantization, batch and prompt."""
    timed = [r for r in results if "decode_tok_s" in r and not r.get("code")]  # (others: versus_this_checkout)
    base = {_group(r): r for r in timed if r["backend"] == "inductor" and r.get("quant", "none") == "none"}
    llama = {(*_group(r), r["quant"]): r for r in timed if r["backend"] == "llamacpp"}
    ort = {(*_group(r)[1:], r["quant"]): r for r in timed if r["backend"] == "onnxruntime"}
    for r in timed:
        if _group(r) in base:
            _ratios(r, base[_group(r)], "speedup_vs_inductor", paired)
        if r["backend"] == "fastflow" and (*_group(r), r.get("quant", "none")) in llama:
            _ratios(r, llama[(*_group(r), r.get("quant", "none"))], "speedup_vs_llamacpp", paired)
        if r["backend"] == "fastflow" and (*_group(r)[1:], r.get("quant", "none")) in ort:
            _ratios(r, ort[(*_group(r)[1:], r.get("quant", "none"))], "speedup_vs_onnxruntime", paired)


def environment() -> dict:
    import torch
    import transformers
    import triton

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor() or "?")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"machine": f"{cpu}, {os.cpu_count()} cores" + (f", {gpu}" if gpu else ""),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "triton": triton.__version__,
            "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "instruction_sets": instruction_sets()}


def instruction_sets() -> dict:
    """What this process may use: the CPU's vector / matrix flags, fastflow's build target (FFL_CPU_MARCH),
    ATen's kernels (ATEN_CPU_CAPABILITY) and oneDNN's limit (ONEDNN_MAX_CPU_ISA): an AVX2 proxy run on
    an AVX-512 machine says so here."""
    import torch

    from ..kernels.cpu_isa import cpu_flags, target_arch

    flags = set(cpu_flags().split())
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile")
    return {"cpu_flags": [f for f in wanted if f in flags], "fastflow_march": target_arch(),
            "aten": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "(all)")}


def report_row(row: dict, out: str | None = None) -> dict:
    """Stamp a benchmark script's result row with its command line and environment, print it, and
    append it to the JSON list in `out` (created if missing)."""
    row["command"] = "python " + shlex.join(sys.argv)
    row["environment"] = environment()
    print(json.dumps(row, indent=1))
    if out:
        rows = json.load(open(out)) if os.path.exists(out) else []
        with open(out, "w") as fh:
            json.dump(rows + [row], fh, indent=1)
    return row


class Progress:
    """A one-line progress display on stderr: configurations done / total, elapsed, current one.
    On a terminal the line is redrawn in place; in a log file each update is its own line."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()

    def show(self, text: str, finished: bool = False) -> None:
        self.done += finished
        elapsed = int(time.perf_counter() - self.start)
        bar = "#" * (20 * self.done // max(1, self.total))
        line = f"[{bar:20s}] {self.done}/{self.total} {elapsed // 60}m{elapsed % 60:02d}s {text}"
        self.stream.write(("\r\033[K" + line) if self.tty else line + "\n")
        if self.tty and finished and self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def add_ceilings(results: list[dict], device: str) -> None:
    """Each row's read ceiling (a plain read of a buffer of its weight bytes) and its GB/s as a % of it,
    measured here once every worker is done: measured in the workers, while the others ran, the
    ceilings came out low and the %s above 100."""
    from .bandwidth import read_gbs

    ceilings: dict = {}
    for r in results:
        if "error" in r or not r.get("weight_bytes"):
            continue
        if r["weight_bytes"] not in ceilings:
            ceilings[r["weight_bytes"]] = read_gbs(r["weight_bytes"], device)
        r["ceiling_gbs"] = ceilings[r["weight_bytes"]]
        r["pct_of_ceiling"] = 100 * r["effective_gbs"] / r["ceiling_gbs"]


def run_grid(model, backends=DEFAULT_BACKENDS, dtypes=DTYPES, prompt_len=16, new_tokens=128, repeats=3,
             text=None, options=None, log=print, *, quants=("none",), batches=(1,), warmup=1, warm_compile=True,
             device="cpu", threads=None, progress=True, schedule="interleaved", fastflow_variants=(None,),
             left_pad=False, tps=(1,), codes=()) -> dict:
    """Run every configuration of the grid, each in its own process; `prompt_len` is one length or
    several. `schedule`: "interleaved" (all processes alive, timed round robin; alternating where they
    would not fit), "alternating" (a process per configuration per round) or "sequential" (a process
    per configuration). `left_pad`: batches of prompts of different lengths (session.batch_prompts).
    `tps`: tensor-parallel degrees (1 = one process; N: the model split over N torchrun ranks).
    `codes`: other checkouts of fastflow whose package runs each row once more (with_code_versions).
    Returns {"environment", "bandwidth", "settings", "results", "skipped"}."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    from .bandwidth import machine_bandwidth

    prompt_lens = [prompt_len] if isinstance(prompt_len, int) else list(prompt_len)
    settings = {"new_tokens": new_tokens, "repeats": repeats, "warmup": warmup, "text": text, "device": device,
                "threads": threads, "left_pad": left_pad}
    todo, skipped = configurations(model, backends, dtypes, quants, batches, prompt_lens, fastflow_variants, tps,
                                   options=options, **settings)
    todo = with_code_versions(todo, codes)
    by_reason: dict[str, list] = {}
    for cfg in skipped:
        by_reason.setdefault(cfg["reason"], []).append(label(cfg))
    for reason, names in by_reason.items():  # one line per reason: a missing llama_cpp skips many rows
        log(f"  skipped {', '.join(names)}: {reason}")
    llama_cfgs = [cfg for cfg in todo if cfg["backend"] == "llamacpp"]
    if llama_cfgs:
        llamacpp.prepare(llama_cfgs, log)
    ort_cfgs = [cfg for cfg in todo if cfg["backend"] in onnxruntime_rows.BACKENDS]
    if ort_cfgs:
        onnxruntime_rows.prepare(ort_cfgs, log)
    schedule, settings["schedule_reason"] = choose_schedule(schedule, todo, log)
    settings["schedule"] = schedule
    bar = Progress(len(todo)) if progress else None
    results = (run_interleaved(todo, repeats, warm_compile, bar) if schedule == "interleaved"
               else run_alternating(todo, repeats, bar) if schedule == "alternating"
               else run_sequential(todo, warm_compile, bar))
    for res in results:
        log(f"  {label(res):32s} " + (f"{res['decode_tok_s']:.1f} tok/s" if "error" not in res
                                      else f"ERROR {res['error']}"))
    add_ceilings(results, device)
    agreement(results)
    speedups(results, paired=schedule in PAIRED)
    versus_this_checkout(results, paired=schedule in PAIRED)
    for r in results:
        if "vs_this_checkout" in r:
            log(f"  {label(r)} vs this checkout: {r.get('vs_this_checkout_paired', r['vs_this_checkout']):.3f}x")
    env = {**environment(), **({"llama_cpp": llamacpp.environment()} if llama_cfgs else {}),
           **({"onnxruntime": onnxruntime_rows.environment()} if ort_cfgs else {})}
    return {"environment": env, "bandwidth": machine_bandwidth(device),
            "settings": {**settings, "model": str(model)}, "results": results, "skipped": skipped}
