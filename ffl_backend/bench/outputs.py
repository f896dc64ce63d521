"""What a grid run leaves behind: a terminal/markdown table, JSON (everything), CSV (one row per
configuration, fixed columns) and a PNG chart (decode tok/s and speedup per configuration)."""
from __future__ import annotations

import csv
import json
import math
import os

from .grid import BACKENDS, label

# CSV columns, in order; JSON keeps these and more (token ids, every repeat, the environment).
CSV_COLUMNS = (
    "backend", "dtype", "quant", "gguf_type", "batch", "prompt_len", "new_tokens", "repeats",
    "load_s", "quantize_s", "compile_cold_s", "compile_warm_s",
    "ttft_s", "prefill_tok_s", "decode_tok_s", "decode_tok_s_min", "decode_tok_s_max", "decode_spread_pct",
    "speedup_vs_inductor", "speedup_vs_inductor_paired", "speedup_vs_llamacpp", "speedup_vs_llamacpp_paired",
    "peak_rss_mb", "runtime_rss_mb", "model_peak_rss_mb", "cuda_peak_mb", "kv_cache_mb",
    "weight_bytes", "effective_gbs", "ceiling_gbs", "pct_of_ceiling",
    "recompiles", "graphs_compiled_while_timed", "matching_prefix", "tokens_equal_eager", "rows_equal", "error",
)
BACKEND_COLORS = {"eager": "#9e9e9e", "inductor": "#1f77b4", "fastflow": "#ff7f0e", "llamacpp": "#2ca02c",
                  "onnxruntime": "#9467bd", "onnxruntime-genai": "#8c564b", "onnxruntime-genai-builder": "#e377c2"}


def _fmt(value, spec: str, none: str = "-") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return none
    return format(value, spec)


def _times(value) -> str:
    """A ratio cell: "1.23x", or "-" where there is none."""
    text = _fmt(value, ".2f")
    return text if text == "-" else text + "x"


def _agreement_cell(r: dict) -> str:
    if "tokens_equal_eager" not in r:
        return "n/a (no eager run)"
    differ = r.get("rows_equal", True) is False  # None: left-padded rows hold different prompts
    return f"{r['matching_prefix']}/{len(r['tokens'])}" + (" (rows differ)" if differ else "")


def speedup(r: dict, baseline: str = "inductor") -> float | None:
    """The speedup a row is shown with: paired (median of per-round ratios) where the rounds were
    interleaved, else the ratio of medians."""
    return r.get(f"speedup_vs_{baseline}_paired", r.get(f"speedup_vs_{baseline}"))


def table(grid: dict) -> str:
    """A markdown table (also what the terminal shows); a "vs" column per peer present (llama.cpp,
    ONNX Runtime)."""
    peers = [(name, title) for name, title in (("llamacpp", "vs llama.cpp"), ("onnxruntime", "vs onnxruntime"))
             if any(r.get("backend") == name for r in grid["results"])]
    columns = 12 + len(peers)
    rows = ["| configuration | decode tok/s median (min-max) | vs inductor | " + "".join(f"{t} | " for _, t in peers)
            + "TTFT ms | prefill tok/s | compile s cold / warm | load s | peak RSS MB (above runtime) | "
            "KV cache MiB | weights GB/s (% of ceiling) | recompiles | tokens = eager |",
            "|---" * columns + "|"]
    for r in grid["results"]:
        name = label(r) if "quant" in r else f"{r['dtype']} {r['backend']}"
        if "error" in r:
            rows.append(f"| {name} | error: {r['error']} |" + " |" * (columns - 2))
            continue
        vs_peers = "".join(f"{_times(speedup(r, peer))} | " for peer, _ in peers)
        spread = (f" ({r['decode_tok_s_min']:.1f}-{r['decode_tok_s_max']:.1f})"
                  if "decode_tok_s_min" in r else "")
        rows.append(
            f"| {name} | {r['decode_tok_s']:.1f}{spread} | {_times(speedup(r))} | {vs_peers}"
            f"{1000 * r['ttft_s']:.0f} | {_fmt(r.get('prefill_tok_s'), '.0f')} | "
            f"{_fmt(r.get('compile_cold_s', r.get('first_generate_s')), '.1f')} / "
            f"{_fmt(r.get('compile_warm_s'), '.1f')} | {_fmt(r.get('load_s'), '.1f')} | "
            f"{r['peak_rss_mb']:.0f} ({_fmt(r.get('model_peak_rss_mb'), '.0f')}) | "
            f"{_fmt(r.get('kv_cache_mb'), '.1f')} | {_fmt(r.get('effective_gbs'), '.1f')} "
            f"({_fmt(r.get('pct_of_ceiling'), '.0f')}%) | {_fmt(r.get('recompiles'), 'd')} | "
            f"{_agreement_cell(r)} |")
    return "\n".join(rows)


def _onnxruntime_note(info: dict) -> str:
    versions = ", ".join(f"{name} {v}" for name, v in info.items() if v)
    return (f"*onnxruntime* rows ({versions}): the model exported by `ffl_backend.onnx.export_onnx` (float32; "
            "int8/int4 layers as MatMulNBits from fastflow's own codes, accuracy_level 4 = int8 activations; "
            "onnxscript's ORT fusions) in plain ONNX Runtime, one session.run per token; *onnxruntime-genai-builder*: "
            "ONNX Runtime GenAI's own model builder on the same HF folder (its round-to-nearest int8/int4, block 32, "
            "accuracy_level 4, GroupQueryAttention) in GenAI's loop. *vs onnxruntime*: fastflow against the "
            "onnxruntime row of the same quantization (float32 there: no bf16 on ONNX Runtime's CPU).")


def _isa_note(isa: dict | None) -> str:
    """One sentence on the instruction sets the torch rows used (absent from older files)."""
    if not isa:
        return ""
    return (f" CPU flags {'/'.join(isa['cpu_flags']) or 'baseline'}; used: fastflow -march={isa['fastflow_march']}, "
            f"ATen {isa['aten']}, oneDNN up to {isa['onednn_max_cpu_isa']}.")


def header(grid: dict) -> str:
    """Where and how the figures were measured, in markdown."""
    env, bw, st = grid["environment"], grid.get("bandwidth", {}), grid.get("settings", {})
    lines = [f"`{grid['command']}`" if grid.get("command") else "",
             f"{env['machine']}; torch {env['torch']}, transformers {env['transformers']}, "
             f"{env['torch_threads']} threads; {env['date']}." + _isa_note(env.get("instruction_sets")),
             f"{st.get('new_tokens')} new tokens, greedy; median of {st.get('repeats')} timed generates after "
             f"{st.get('warmup')} warm-up (the first compiles). " + _schedule_note(st) + " Peak RSS in "
             f"brackets: above the runtime's own RSS (torch, transformers, the modeling code and, when compiling, "
             f"Inductor, imported before the model loads). Read ceiling "
             f"of this machine: {_fmt(bw.get('dram_read_gbs'), '.1f')} GB/s from DRAM (1 GiB), "
             f"{_fmt(bw.get('cache_read_gbs'), '.1f')} GB/s in cache (32 MiB); each row's % is against a "
             f"buffer of its own weight bytes. *tokens = eager*: leading greedy tokens equal to unquantized eager of "
             f"the same dtype, batch and prompt."
             + (" Batches are left-padded: row i of b keeps its last p - i p / (2 b) prompt tokens (masked "
                "padding before them), *tokens = eager* compares row 0." if st.get("left_pad") else "")]
    if "llama_cpp" in env:
        lines.append(_llama_cpp_note(env["llama_cpp"]))
    if "onnxruntime" in env:
        lines.append(_onnxruntime_note(env["onnxruntime"]))
    lines += [f"{label(r)}: one all-reduce of a decode step's hidden states {r['allreduce_us']:.0f} us (mean of a "
              f"loop of 200 after the timed runs), {r['allreduce_per_step']} per step: "
              f"~{r['allreduce_share_pct']:.0f}% of a decode step."
              for r in grid["results"] if "allreduce_us" in r]
    by_reason: dict[str, list] = {}
    for s in grid.get("skipped", []):
        by_reason.setdefault(s["reason"], []).append(label(s))
    lines += [f"Skipped ({reason}): {', '.join(names)}." for reason, names in by_reason.items()]
    return "\n\n".join(line for line in lines if line)


def _schedule_note(st: dict) -> str:
    """How the configurations' processes ran, and why that schedule (absent from older files)."""
    schedule = st.get("schedule")
    why = f" (schedule {schedule}: {st['schedule_reason']})" if st.get("schedule_reason") else ""
    if schedule == "alternating":
        return ("Each configuration in processes of its own, one process at a time, the configurations "
                "alternating round by round (a fresh process per configuration per round: set-up on its own "
                "Inductor cache, kept across its rounds, and a quantized model saved by its first round; "
                f"warm-up; one timed generate){why}, so *vs inductor* is the median of the per-round ratios; "
                "load, quantize and cold compile are each configuration's first round's, *warm* compile its later "
                "rounds' (median), peak RSS the highest of its rounds.")
    if schedule == "interleaved":
        return ("Each configuration in its own process with its own Inductor cache, all processes alive and timed "
                f"round robin (one generate each per round){why}, so *vs inductor* is the median of the per-round "
                "ratios; *warm* compile = a second process reusing that on-disk cache.")
    return ("Each configuration in its own process with its own Inductor cache, one process after another"
            f"{why}; *warm* compile = a second process reusing that on-disk cache.")


def _llama_cpp_note(info: dict) -> str:
    """What the llamacpp rows ran: versions, GGUF types, settings and the build's CPU features."""
    buffers = ("on" if info["extra_buffer_types"] else "off (ggml's AMX kernels segfault on this CPU, "
               "ggml-org/llama.cpp#20824; weight repacking goes with them)")
    return (f"*llamacpp* rows: llama.cpp (libllama {info['libllama']}) through llama-cpp-python "
            f"{info['llama_cpp_python']}, on a GGUF file written by ffl_backend from the same safetensors: F16 for "
            f"bfloat16/float16, Q8_0 (embedding included) for int8 and int8-all, Q4_0 with a Q8_0 embedding/output "
            f"for int4 and int4-all; the type is in the row's name. Same prompt ids, greedy, KV cache cleared per "
            f"generate; nothing compiles (compile 0); peak RSS in brackets is above llama_cpp's own import and "
            f"counts the pages of the memory-mapped file that were read; extra buffer types {buffers}. "
            f"Build: `{info['system_info']}`")


def write_json(grid: dict, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(grid, fh, indent=1)


def write_csv(grid: dict, path: str) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in grid["results"]:
            writer.writerow({k: r.get(k) for k in CSV_COLUMNS})


def write_markdown(grid: dict, path: str) -> None:
    with open(path, "w") as fh:
        fh.write(f"# ffl-bench: {os.path.basename(grid['settings']['model'].rstrip('/'))}\n\n"
                 f"{header(grid)}\n\n{table(grid)}\n")


def write_png(grid: dict, path: str) -> None:
    """Two panels sharing the x axis: decode tok/s (bars = median, whiskers = min..max of the repeats)
    and speedup vs Inductor; one bar colour per backend, groups = dtype/quant/batch/prompt."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers or CI
    import matplotlib.pyplot as plt

    ok = [r for r in grid["results"] if "decode_tok_s" in r and "error" not in r]
    groups = list(dict.fromkeys(_group_label(r) for r in ok))
    backends = [b for b in BACKENDS if any(r["backend"] == b for r in ok)]
    width = 0.8 / max(1, len(backends))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 0.9 * len(backends) * len(groups) + 3), 8), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]}, layout="constrained")
    for i, backend in enumerate(backends):
        rows = {_group_label(r): r for r in ok if r["backend"] == backend}
        xs = [g + (i - (len(backends) - 1) / 2) * width for g, name in enumerate(groups) if name in rows]
        rs = [rows[name] for name in groups if name in rows]
        med = [r["decode_tok_s"] for r in rs]
        err = [[max(0.0, m - r.get("decode_tok_s_min", m)) for m, r in zip(med, rs)],
               [max(0.0, r.get("decode_tok_s_max", m) - m) for m, r in zip(med, rs)]]
        bars = top.bar(xs, med, width, yerr=err, capsize=3, label=backend, color=BACKEND_COLORS.get(backend))
        # llama.cpp bars name the GGUF type they ran, as their table rows do
        top.bar_label(bars, labels=[f"{m:.1f}" + (f"\n{r['gguf_type']}" if r.get("gguf_type") else "")
                                    for m, r in zip(med, rs)], fontsize=8, padding=2)
        speed = [float("nan") if speedup(r) is None else speedup(r) for r in rs]
        sbars = bottom.bar(xs, speed, width, color=BACKEND_COLORS.get(backend), label=backend)
        bottom.bar_label(sbars, labels=[_fmt(s, ".2f", "") + ("x" if not math.isnan(s) else "") for s in speed],
                         fontsize=8, padding=2)
    top.set_ylabel("decode tokens/s")
    top.legend(title="backend", loc="upper left", fontsize=8)
    top.grid(axis="y", alpha=0.3)
    top.margins(y=0.15)
    bottom.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    paired = grid.get("settings", {}).get("schedule") in ("interleaved", "alternating")
    bottom.set_ylabel("speedup vs Inductor")
    bottom.set_xlabel("configuration: dtype, quantization, batch size b, prompt length p (tokens)")
    bottom.grid(axis="y", alpha=0.3)
    bottom.margins(y=0.2)
    bottom.set_xticks(range(len(groups)), groups, fontsize=8)
    fig.align_ylabels((top, bottom))
    env, st = grid["environment"], grid.get("settings", {})
    model = os.path.basename(st.get("model", "model").rstrip("/"))
    fig.suptitle(f"{model}: greedy decode, {st.get('new_tokens')} new tokens\n{env['machine']}, "
                 f"torch {env['torch']}", fontsize=10)
    # The long explanations go under the figure, not into axis labels that would collide.
    fig.supxlabel("Bars: median of the timed generates, whiskers: min-max. "
                  "Speedup: decode tok/s over unquantized Inductor of the same dtype, batch and prompt"
                  + (" (median of per-round ratios)." if paired else "."),
                  fontsize=8, wrap=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _group_label(r: dict) -> str:
    quant = "" if r.get("quant", "none") == "none" else f" {r['quant']}"
    return f"{r['dtype']}{quant}\nb{r.get('batch', 1)} p{r['prompt_len']}"


def write_all(grid: dict, out: str) -> list[str]:
    """`out`.json, .csv, .png and .md (a prefix, e.g. benchmarks/results/bench_smollm2_cpu)."""
    folder = os.path.dirname(out)
    if folder:
        os.makedirs(folder, exist_ok=True)
    paths = [f"{out}.json", f"{out}.csv", f"{out}.png", f"{out}.md"]
    for writer, path in zip((write_json, write_csv, write_png, write_markdown), paths):
        writer(grid, path)
    return paths


def write_script_results(path, script: str, **payload) -> None:
    """A benchmark script's results file: `payload` after the machine and versions (grid.environment)
    and the command line that ran (`script` and this process's arguments)."""
    import sys
    from pathlib import Path

    from .grid import environment

    head = {"environment": environment(), "command": " ".join(["python", script, *sys.argv[1:]])}
    Path(path).write_text(json.dumps({**head, **payload}, indent=1))
    print(f"wrote {path}")
