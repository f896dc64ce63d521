"""The GPU check (docs/gpu.md): the `cuda` tests, then a short benchmark, in one run of <= 8 minutes.

    bash scripts/gpu_check.sh OUT [--skip STAGE ...] [--only STAGE ...]
    bash scripts/gpu_check.sh --dry-run [OUT]

Stages, in order: env (versions, GPU, what the CUDA paths need of this torch/triton/transformers),
tests (`pytest -m cuda tests/cuda`, junit XML), kernels (each Triton kernel's GB/s against the H200's
4.8 TB/s), decode (random-weight SmolLM2-135M and Llama-3-8B-sized models: eager, Inductor, fastflow).
Each stage runs in its own process under a time budget, so a crash, a hang or a poisoned CUDA context
costs that stage alone; what it finished is kept. Writes OUT/gpu_check.json and OUT/gpu_check.log.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
# Seconds per stage, 455 in all: with each stage's 5 s of grace, under 8 minutes. What a stage leaves
# unused goes to the next. A stage past its budget is ended; tests, kernels and decode also skip
# what is left of their own work when it runs short, so they end on time with what they finished.
BUDGETS = {"env": 25, "tests": 180, "kernels": 50, "decode": 200}
GRACE_S = 5
STAGES = tuple(BUDGETS)
DESCRIPTIONS = {
    "env": "versions, GPU and capability; probes of the torch/triton/transformers features the CUDA paths use",
    "tests": "pytest -m cuda tests/cuda in four parallel groups, junit XML per group",
    "kernels": "each Triton kernel on a Llama-3-8B-sized shape: achieved GB/s vs the H200's 4.8 TB/s",
    "decode": "decode tok/s and weight GB/s: eager, Inductor, fastflow (default, reduce-overhead, int8, int4)",
}
# What the env and tests stages import, checked by the dry run with the stage modules' own NEEDS
NEEDS = {"torch": ["cuda"], "triton": ["language"], "transformers": ["AutoModelForCausalLM"], "pytest": ["main"],
         "ffl_backend.backend": ["register_without_install"], "ffl_backend.config": ["DEFAULT_INDUCTOR_CONFIG"],
         "ffl_backend.generation": ["FAST_GUARD_CONFIG"]}
# pytest runs side by side (pytest arguments): the model tests, each an Inductor compile, split in two
# beside the many small kernel tests
MODELS_TESTS = "tests/cuda/test_models_cuda.py"
TEST_GROUPS = {"kernels": ["tests/cuda/test_kernels_cuda.py"],
               "quant_attention": ["tests/cuda/test_quant_cuda.py", "tests/cuda/test_attention_cuda.py"],
               "models_fp32": [MODELS_TESTS, "-k", "fp32"],
               "models_engine": [MODELS_TESTS, "tests/cuda/test_engine_cuda.py", "-k", "not fp32"]}


class Tee:
    """Every line to stdout and to the log file, flushed (a killed run keeps what it printed)."""

    def __init__(self, path: Path | None):
        self.fh = open(path, "a", encoding="utf-8") if path else None
        self.lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self.lock:
            print(line, flush=True)
            if self.fh:
                self.fh.write(line + "\n")
                self.fh.flush()


# ------------------------------------------------------------------------------- stage: env ----

def _probe(name: str, fn) -> dict:
    try:
        detail = fn()
        return {"name": name, "ok": True, **({"detail": detail} if detail else {})}
    except Exception as exc:  # noqa: BLE001 - each missing feature is a finding, not a crash
        return {"name": name, "ok": False, "reason": f"{type(exc).__name__}: {exc}"}


def _probe_line(probe: dict) -> str:
    return f"  {'ok' if probe['ok'] else 'MISSING'} {probe['name']}" + ("" if probe["ok"] else f": {probe['reason']}")


def _config_keys(module, keys) -> str:
    """Look up every dotted name in `keys` under `module` (AttributeError names the first missing)."""
    for key in keys:
        obj = module
        for part in key.split("."):
            obj = getattr(obj, part)
    return f"{len(keys)} keys"


def compat_probes() -> list[dict]:
    """What the CUDA paths take from this torch, triton and transformers, probed one by one."""
    import torch

    from ffl_backend.config import DEFAULT_INDUCTOR_CONFIG, mode_config
    from ffl_backend.generation import FAST_GUARD_CONFIG

    def transformers_api():
        from transformers import AttentionInterface, CompileConfig, StaticCache  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401

    def triton_api():
        import triton.language as tl

        missing = [n for n in ("div_rn", "float8e4nv", "dot", "exp2", "rsqrt", "erf") if not hasattr(tl, n)]
        if missing:
            raise AttributeError(f"triton.language lacks {missing}")

    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    inductor_keys = [*DEFAULT_INDUCTOR_CONFIG, *mode_config("reduce-overhead", "cuda"), "post_grad_custom_post_pass"]
    library = ["library." + n for n in ("triton_op", "wrap_triton", "custom_op", "opcheck")]
    return [
        _probe("torch.library triton_op / wrap_triton / custom_op / opcheck", lambda: _config_keys(torch, library)),
        _probe("Inductor config keys fastflow sets", lambda: _config_keys(inductor_config, inductor_keys)),
        _probe("Dynamo guard config keys", lambda: _config_keys(dynamo_config, list(FAST_GUARD_CONFIG))),
        _probe("Dynamo frame compile counter (ffl-bench)",
               lambda: _config_keys(torch, ["_dynamo.convert_frame.FRAME_COMPILE_COUNTER"])),
        _probe("transformers attention/mask interfaces, CompileConfig, StaticCache", transformers_api),
        _probe("triton.language features of the kernels", triton_api),
    ]


def _versions() -> dict:
    import platform

    import torch
    import transformers
    import triton

    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "triton": triton.__version__, "transformers": transformers.__version__}
    try:
        import accelerate

        out["accelerate"] = accelerate.__version__
    except ImportError:
        out["accelerate"] = None
    return out


def stage_env(ctx) -> dict:
    import torch

    from ffl_backend.backend import register_without_install

    res = {"versions": _versions(), "compat": compat_probes(),
           "entry_point_registered_by_hand": register_without_install(),
           "env": {k: os.environ.get(k) for k in ("FFL_NATIVE_TRITON", "TRITON_INTERPRET", "PYTHONPATH")}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        res["gpu"] = {"name": props.name, "capability": list(torch.cuda.get_device_capability(0)),
                      "memory_gib": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count,
                      "count": torch.cuda.device_count()}
    else:
        res["gpu"] = None
    for key, value in res["versions"].items():
        ctx.log(f"  {key}: {value}")
    ctx.log(f"  gpu: {res['gpu']}")
    for probe in res["compat"]:
        ctx.log(_probe_line(probe))
    res["ok"] = all(p["ok"] for p in res["compat"])
    return res


# ----------------------------------------------------------------------------- stage: tests ----

def _junit_counts(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    if not path.exists():
        return {"missing": True}
    suites = ET.parse(path).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    keys = ("tests", "failures", "errors", "skipped")
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}
    counts["time_s"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    return counts


def _summary(log: Path, most: int = 80) -> list[str]:
    """pytest's short summary (failures, then skips with their reasons) and its closing line."""
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    start = next((i for i, line in enumerate(lines) if "short test summary info" in line), len(lines) - 10)
    return lines[max(0, start):][:most] + (lines[-1:] if len(lines) - start > most else [])


def stage_tests(ctx) -> dict:
    """The `cuda` tests, four pytest processes side by side (their own logs and junit files), each
    stopped at the stage's deadline."""
    procs = {}
    # tests/cuda/conftest.py skips the tests still to run past this, so pytest ends and writes its junit
    env = {**os.environ, "FFL_TESTS_DEADLINE": str(time.time() + ctx.left() - 15)}
    for name, selection in TEST_GROUPS.items():
        cmd = [sys.executable, "-m", "pytest", "-m", "cuda", *selection, "-q", "-rs", "-p", "no:cacheprovider",
               f"--junitxml={ctx.out / f'junit_{name}.xml'}"]
        log = open(ctx.out / f"pytest_{name}.log", "w", encoding="utf-8")
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log, cmd)
    res = {}
    for name, (proc, log, cmd) in procs.items():
        try:
            rc = proc.wait(timeout=max(1.0, ctx.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        log.close()
        res[name] = {"command": " ".join(cmd), "returncode": rc, **_junit_counts(ctx.out / f"junit_{name}.xml")}
        ctx.log(f"  [{name}] rc={rc} " + json.dumps({k: v for k, v in res[name].items() if k != "command"}))
        for line in _summary(ctx.out / f"pytest_{name}.log"):
            ctx.log(f"    {line}")
    res["ok"] = all(r["returncode"] == 0 for r in res.values() if isinstance(r, dict))
    return res


# -------------------------------------------------------------------------- orchestration ----

class StageContext:
    """What a stage gets: its output folder, device, deadline and a way to log and save progress."""

    def __init__(self, name: str, out: Path, budget: float, device: str, models: list[str] | None):
        self.name, self.out, self.device, self.models = name, out, device, models
        self.deadline = time.monotonic() + budget
        self.log = Tee(None)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self, result: dict) -> None:
        """Write the stage's result so far (atomically): a stage ended at its deadline keeps it."""
        path = self.out / "stages" / f"{self.name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(path)


def _stage_fn(name: str):
    if name == "kernels":
        from gpu_check_kernels import stage_kernels

        return stage_kernels
    if name == "decode":
        from gpu_check_decode import stage_decode

        return stage_decode
    return {"env": stage_env, "tests": stage_tests}[name]


def run_stage_here(args) -> int:
    """The child process of one stage: run it, save its result, exit 0 unless it raised."""
    out = Path(args.out)
    ctx = StageContext(args.stage, out, args.stage_budget, args.device, args.models)
    try:
        from ffl_backend.backend import register_without_install

        register_without_install()  # each stage is its own process: a source tree has no entry point
        result = _stage_fn(args.stage)(ctx)
        if isinstance(result.get("skipped"), str):  # the stage cannot run here (no GPU), and says why
            status = "skipped"
        else:
            status = "ok" if result.get("ok", True) else "failed"
        ctx.save({"status": status, "result": result})
        return 0
    except Exception as exc:
        import traceback

        traceback.print_exc()
        ctx.save({"status": "failed", "error": f"{type(exc).__name__}: {exc}"})
        return 1


def _pump(stream, tee: Tee) -> None:
    for line in iter(stream.readline, ""):
        tee(line.rstrip("\n"))


def run_stage_child(name: str, budget: float, args, out: Path, tee: Tee) -> dict:
    """Run stage `name` in a child process with `budget` seconds as its limit; collect what it saved."""
    cmd = [sys.executable, str(Path(__file__).resolve()), str(out), "--stage", name, "--stage-budget", str(budget),
           "--device", args.device, *(["--models", *args.models] if args.models else [])]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pump = threading.Thread(target=_pump, args=(proc.stdout, tee), daemon=True)
    pump.start()
    try:
        rc = proc.wait(timeout=budget + GRACE_S)  # the stage watches its own deadline; this is the backstop
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    pump.join(timeout=5)
    saved = out / "stages" / f"{name}.json"
    record = json.loads(saved.read_text()) if saved.exists() else {"status": "failed", "error": "no result saved"}
    if rc == "timeout":
        record["status"], record["error"] = "timeout", f"stopped after its budget of {budget:.0f} s"
    elif rc != 0 and record["status"] in ("ok", "skipped"):
        record["status"] = "failed"
    record.update(elapsed_s=round(time.monotonic() - start, 1), budget_s=round(budget), returncode=rc)
    return record


def dry_run(selected: list[str], out: Path | None, tee: Tee) -> int:
    """List the stages, import what they need, collect the cuda tests, probe the versions: no GPU used."""
    import importlib

    for name in STAGES:
        mark = "run " if name in selected else "skip"
        tee(f"stage {name:8s} [{mark}] budget {BUDGETS[name]:3.0f} s: {DESCRIPTIONS[name]}")
    import gpu_check_decode
    import gpu_check_kernels

    needs = {}
    for part in (NEEDS, gpu_check_kernels.NEEDS, gpu_check_decode.NEEDS):
        for module, names in part.items():
            needs.setdefault(module, []).extend(names)
    imports = [_probe(f"import {module}: {', '.join(names)}",
                      lambda m=module, n=names: _config_keys(importlib.import_module(m), n))
               for module, names in needs.items()]
    load_all = importlib.import_module("ffl_backend.kernels").load_all
    imports.append(_probe("every fastflow op registers", load_all))
    for probe in imports:
        if not probe["ok"]:
            tee(_probe_line(probe))
    tee(f"imports: {len(needs)} modules, {sum(map(len, needs.values()))} names: "
        f"{'ok' if all(p['ok'] for p in imports) else 'MISSING (above)'}")
    collect = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "tests/cuda",
                              "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    summary = (collect.stdout.strip().splitlines() or ["(no output)"])[-1]
    tee(f"cuda tests: {summary}")
    probes = compat_probes()
    for probe in probes:
        tee(_probe_line(probe))
    for row in gpu_check_decode.plan(["smollm2-135m", "llama-3-8b"]):
        tee(f"  decode row: {row.label}")
    ok = collect.returncode == 0 and all(p["ok"] for p in [*imports, *probes])
    if out:
        (out / "gpu_check.json").write_text(json.dumps({"dry_run": True, "versions": _versions(), "compat": probes,
                                                        "selected": selected, "collected": summary}, indent=1))
    tee("ok" if ok else "dry run found problems (above)")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", help="output folder (created); required unless --dry-run")
    p.add_argument("--dry-run", action="store_true", help="list stages, check imports and versions; no GPU")
    p.add_argument("--skip", nargs="+", choices=STAGES, default=[], metavar="STAGE")
    p.add_argument("--only", nargs="+", choices=STAGES, metavar="STAGE")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script itself")
    p.add_argument("--models", nargs="+", help="decode models (default: smollm2-135m llama-3-8b; tiny-llama)")
    p.add_argument("--budget", nargs="+", default=[], metavar="STAGE=SECONDS",
                   help=f"change stage budgets (defaults {BUDGETS}), e.g. --only tests --budget tests=600")
    p.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # internal: run one stage here
    p.add_argument("--stage-budget", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in BUDGETS or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--budget takes STAGE=SECONDS with STAGE one of {STAGES}, got {item!r}")
        BUDGETS[name] = float(seconds)
    sys.path.insert(0, str(HERE))  # the stage modules beside this file
    if args.device == "cuda":  # compiled kernels here, in every stage and in pytest (tests/conftest.py)
        os.environ["FFL_NATIVE_TRITON"] = "1"
        os.environ.pop("TRITON_INTERPRET", None)
    if args.stage:
        return run_stage_here(args)
    if not args.out and not args.dry_run:
        p.error("give an output folder (or --dry-run)")
    out = Path(args.out).resolve() if args.out else None
    if out:
        (out / "stages").mkdir(parents=True, exist_ok=True)
    tee = Tee(out / "gpu_check.log" if out else None)
    selected = [s for s in (args.only or STAGES) if s not in args.skip]
    tee(f"gpu_check {datetime.datetime.now().isoformat(timespec='seconds')}: {' '.join(sys.argv)}")
    if args.dry_run:
        return dry_run(selected, out, tee)
    report = {"command": " ".join(sys.argv), "started": datetime.datetime.now().isoformat(timespec="seconds"),
              "budgets_s": BUDGETS, "stages": {}}
    start, slack = time.monotonic(), 0.0
    for name in STAGES:
        if name not in selected:
            report["stages"][name] = {"status": "skipped", "reason": "--skip/--only"}
            continue
        budget = BUDGETS[name] + slack
        tee(f"=== stage {name} (budget {budget:.0f} s)")
        record = run_stage_child(name, budget, args, out, tee)
        slack = max(0.0, budget - record["elapsed_s"])
        report["stages"][name] = record
        tee(f"=== stage {name}: {record['status']} in {record['elapsed_s']} s")
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    env = report["stages"].get("env", {}).get("result", {})
    report.update(versions=env.get("versions"), gpu=env.get("gpu"), elapsed_s=round(time.monotonic() - start, 1),
                  failures=[n for n, r in report["stages"].items() if r["status"] not in ("ok", "skipped")])
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    tee(f"gpu_check done in {report['elapsed_s']} s; failures: {report['failures'] or 'none'}; "
        f"{out / 'gpu_check.json'}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
