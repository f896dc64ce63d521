"""`ffl-bench` (also `python -m ffl_backend.bench`): decode benchmark of eager, Inductor and fastflow
(and llama.cpp on the same weights, with --backends ... llamacpp).

    ffl-bench [--model DIR] [--backends eager inductor fastflow llamacpp] [--dtypes float32 bfloat16]
              [--quant none int8 ...] [--batch-sizes 1 ...] [--prompt-lens 16 ...] [--new-tokens 64]
              [--warmup 1] [--repeats 3] [--schedule interleaved|alternating|sequential] [--out PREFIX]

Writes PREFIX.json, .csv, .png and .md and prints the table. Every request is checked before any
model is loaded; a bad one ends with a single `ffl-bench: error: ...` line and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from .grid import BACKENDS, DEFAULT_BACKENDS, DTYPES, QUANTS, SCHEDULES

PROG = "ffl-bench"


class BenchError(Exception):
    """A request that cannot be run; main prints its message as one line and exits with 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # argparse prints the whole usage block first; one line says the same and stays readable.
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _options(text: str) -> dict:
    """One --fastflow-options value: a JSON object of backend options (checked by the backend itself)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Decode benchmark: each configuration in its own process, outputs "
                "checked against eager before speeds are reported.")
    p.add_argument("--model", help="Hugging Face model folder, or a bundled model's name: smollm2 (the default) or "
                                   "gemma3 (Gemma-3-270M), converted on first use")
    p.add_argument("--backends", nargs="+", default=list(DEFAULT_BACKENDS), choices=BACKENDS,
                   help="eager = HF static cache uncompiled; inductor = static cache + torch.compile; "
                        "fastflow = static cache + this project's backend; llamacpp = llama.cpp (llama-cpp-python) "
                        "on a GGUF file written from the same weights: F16, Q8_0 for int8/int8-all, Q4_0 for "
                        "int4/int4-all; onnxruntime / onnxruntime-genai = the model exported by export_onnx "
                        "(float32, int8/int4 as MatMulNBits) in plain ONNX Runtime / ONNX Runtime GenAI "
                        "(these not run unless named)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES + ("float16",))
    p.add_argument("--quant", nargs="+", default=["none"], choices=QUANTS,
                   help="weight quantization schemes (ffl_backend.quantize); float32 x scheme is skipped")
    p.add_argument("--batch-sizes", nargs="+", type=_positive, default=[1],
                   help="rows per generate (same prompt, unless --left-pad)")
    p.add_argument("--left-pad", action="store_true",
                   help="batches of different prompt lengths: row i of b keeps the last p - i*p/(2b) prompt tokens, "
                        "left-padded and masked")
    p.add_argument("--prompt-lens", nargs="+", type=_positive, default=[16], help="prompt tokens")
    p.add_argument("--new-tokens", type=_positive, default=64, help="tokens generated per row")
    p.add_argument("--warmup", type=_positive, default=1, help="untimed generates first (the first compiles)")
    p.add_argument("--repeats", type=_positive, default=3, help="timed generates; the median is reported")
    p.add_argument("--threads", type=_positive,
                   help="torch (and llama.cpp) threads per worker (default: torch's default count)")
    p.add_argument("--tp", nargs="+", type=_positive, default=[1],
                   help="tensor-parallel degrees: N > 1 splits the model over N torchrun ranks (transformers' "
                        "tp_plan, gloo on CPU), threads shared among them; e.g. --tp 1 3 for both side by side")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto = cuda if available")
    p.add_argument("--text", help="text file the prompt is cut from (default: a fixed sentence, repeated)")
    p.add_argument("--out", default="ffl-bench-results/bench", help="output prefix for .json .csv .png .md")
    p.add_argument("--schedule", default="interleaved", choices=SCHEDULES,
                   help="interleaved: every configuration's process stays alive and timed generates go round "
                        "robin, so a drift of the machine's speed hits all alike (holds every model in memory "
                        "at once; falls back to alternating, with a note, where they would not fit); "
                        "alternating: one process at a time, the configurations alternating round by round (a "
                        "fresh process per round: set-up on its warm compile cache and saved quantized model, "
                        "warm-up, one timed generate), for models too big to hold several of; "
                        "sequential: one process per configuration, one after another")
    p.add_argument("--no-warm-compile", action="store_true",
                   help="skip the second process that times compilation with warm on-disk caches (the "
                        "alternating schedule needs none: its later rounds start warm)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--code", nargs="+", default=[], metavar="PATH",
                   help="other checkouts of fastflow (e.g. a git worktree of an older commit): every row runs "
                        "once more with each one's package, in the same interleaved rounds -- a before/after "
                        "of a change in one run (rows labelled @<commit>)")
    p.add_argument("--fastflow-options", nargs="+", type=_options, default=[None], metavar="JSON",
                   help="backend options of the fastflow rows, one row per JSON object, e.g. "
                        "'{}' '{\"int8_activations\": \"int16\"}' (default: the defaults)")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["model"], choices=("model", "int8", "fp8"),
                   help="the fastflow rows' KV cache: the model's dtype, int8 or fp8 (e4m3) rows with per-token "
                        "scales; one row per value and --fastflow-options object (e.g. model int8)")
    return p


def fastflow_variants(options: list, kv_cache_dtypes: list) -> list:
    """One fastflow row per (backend options, KV cache dtype); kv_cache_dtype goes to optimize()."""
    return [{**(o or {}), "kv_cache_dtype": kv} if kv != "model" else o for o in options for kv in kv_cache_dtypes]


def resolve_model(folder: str | None) -> str:
    """The model folder to use, checked; a bundled model's folder (default: SmolLM2) is built on first use."""
    from ..models import BUNDLED

    if folder is None or folder in BUNDLED:
        try:
            return str(BUNDLED[folder or "smollm2"].path())
        except (FileNotFoundError, ImportError) as exc:
            raise BenchError(f"bundled model {folder or 'smollm2'} unavailable: {exc}") from None
    if not os.path.isdir(folder):
        raise BenchError(f"model folder not found: {folder}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise BenchError(f"not a Hugging Face model folder (no config.json): {folder}")
    return folder


def max_positions(folder: str) -> int | None:
    """The longest sequence the model's config allows, read without importing transformers."""
    with open(os.path.join(folder, "config.json")) as fh:
        config = json.load(fh)
    config = {**config.get("text_config", {}), **config}
    return next((config[k] for k in ("max_position_embeddings", "n_positions", "max_sequence_length")
                 if isinstance(config.get(k), int)), None)


def check_request(args, model: str) -> str:
    """Everything that can be known wrong before loading anything; returns the device to use."""
    limit = max_positions(model)
    longest = max(args.prompt_lens) + args.new_tokens
    if limit is not None and longest > limit:
        raise BenchError(f"prompt {max(args.prompt_lens)} + {args.new_tokens} new tokens = {longest} exceeds "
                         f"the model's {limit} positions")
    from .grid import configurations

    todo, skipped = configurations(model, args.backends, args.dtypes, args.quant, args.batch_sizes,
                                   args.prompt_lens, args.fastflow_options, args.tp)
    if not todo:
        raise BenchError("every requested configuration is skipped: "
                         + "; ".join(sorted({s["reason"] for s in skipped})))
    if args.text and not os.path.isfile(args.text):
        raise BenchError(f"text file not found: {args.text}")
    missing = [path for path in args.code if not os.path.isfile(os.path.join(path, "ffl_backend", "__init__.py"))]
    if missing:
        raise BenchError(f"--code: no fastflow checkout (ffl_backend/__init__.py) in {', '.join(missing)}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda, but torch sees no CUDA device")
    return "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto"
                                                                               else args.device)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        model = resolve_model(args.model)
        device = check_request(args, model)
        return _run(args, model, device, command=" ".join([PROG, shlex.join(argv)]).strip())
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130


def _run(args, model: str, device: str, command: str) -> int:
    from .grid import run_grid
    from .outputs import header, table, write_all

    def log(line):
        print(line, file=sys.stderr, flush=True)

    grid = run_grid(model, args.backends, args.dtypes, args.prompt_lens, args.new_tokens, args.repeats,
                    text=args.text, log=log, quants=args.quant, batches=args.batch_sizes, warmup=args.warmup,
                    warm_compile=not args.no_warm_compile, device=device, threads=args.threads,
                    progress=not args.no_progress, schedule=args.schedule,
                    fastflow_variants=fastflow_variants(args.fastflow_options, args.kv_cache_dtype),
                    left_pad=args.left_pad, tps=args.tp, codes=args.code)
    grid["command"] = command
    paths = write_all(grid, args.out)
    print(header(grid) + "\n\n" + table(grid))
    log("wrote " + ", ".join(paths))
    failed = [r for r in grid["results"] if "error" in r]
    if failed:
        log(f"{PROG}: {len(failed)} configuration(s) failed (see the table)")
    return 1 if failed else 0
