"""`ffl-bench` on the command line: one-line errors for bad requests, a tiny model end to end, --code rows."""
import csv
import json
import math
import os
import statistics

import pytest

from ffl_backend.bench.grid import label

from .conftest import RESULT_KEYS, one_line_error, run_bench


def test_missing_model_folder(tmp_path):
    one_line_error(run_bench("--model", str(tmp_path / "nope")), "model folder not found")

def test_folder_without_config(tmp_path):
    one_line_error(run_bench("--model", str(tmp_path)), "no config.json")

def test_unknown_backend(tiny_folder):
    one_line_error(run_bench("--model", str(tiny_folder), "--backends", "tvm"), "--backends", "tvm")

def test_unknown_scheme(tiny_folder):
    one_line_error(run_bench("--model", str(tiny_folder), "--quant", "int3"), "--quant", "int3")

def test_over_length_request(tiny_folder):
    one_line_error(run_bench("--model", str(tiny_folder), "--prompt-lens", "250", "--new-tokens", "10"),
                    "260 exceeds the model's 256 positions")

def test_non_positive_count(tiny_folder):
    one_line_error(run_bench("--model", str(tiny_folder), "--repeats", "0"), "positive integer")

def test_schedules_on_the_command_line():
    from ffl_backend.bench.cli import build_parser

    assert build_parser().parse_args([]).schedule == "interleaved"  # alternating where it would not fit
    assert build_parser().parse_args(["--schedule", "alternating"]).schedule == "alternating"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--schedule", "round-robin"])

def test_fastflow_options_must_be_json_objects(tiny_folder):
    one_line_error(run_bench("--model", str(tiny_folder), "--fastflow-options", "[1]"), "expected a JSON object")

def test_only_skipped_configurations(tiny_folder):
    one_line_error(run_bench("--model", str(tiny_folder), "--dtypes", "float32", "--quant", "int8"),
                    "skipped", "bfloat16")

@pytest.mark.slow  # measured cost and the fast set's budget: docs/testing.md
def test_kv_cache_dtype_rows_report_their_cache_memory(tiny_folder, tmp_path):
    """One fastflow row per --kv-cache-dtype value; an int8 cache's rows (16 values + a 4-byte scale)
    take 20/64 of the fp32 cache's bytes."""
    out = tmp_path / "kv"
    proc = run_bench("--model", str(tiny_folder), "--backends", "fastflow", "--dtypes", "float32",
                  "--kv-cache-dtype", "model", "int8", "--prompt-lens", "8", "--new-tokens", "4",
                  "--repeats", "1", "--threads", "1", "--no-warm-compile", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "float32 fastflow kv_cache_dtype=int8 b1 p8" in proc.stdout and "KV cache MiB" in proc.stdout
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    full, int8 = (r["kv_cache_mb"] for r in rows)
    assert int8 == pytest.approx(full * 20 / 64)

@pytest.mark.slow
def test_tiny_model_end_to_end(tiny_folder, tmp_path):
    out = tmp_path / "res" / "tiny"
    proc = run_bench("--model", str(tiny_folder), "--backends", "eager", "inductor", "--dtypes", "float32",
                  "--prompt-lens", "8", "--new-tokens", "6", "--batch-sizes", "2", "--repeats", "2",
                  "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| configuration |" in proc.stdout and "float32 inductor b2 p8" in proc.stdout
    assert "2/2" in proc.stderr  # the progress line reached the end

    grid = json.loads(out.with_suffix(".json").read_text())
    assert set(grid) >= {"command", "environment", "bandwidth", "settings", "results", "skipped"}
    assert grid["command"].startswith("ffl-bench --model")
    assert grid["bandwidth"]["dram_read_gbs"] > 0 and grid["bandwidth"]["cache_read_gbs"] > 0
    eager, inductor = grid["results"]
    for r in (eager, inductor):
        assert RESULT_KEYS <= set(r), RESULT_KEYS - set(r)
        assert "error" not in r
        assert len(r["tokens"]) == 6 and len(r["decode_tok_s_all"]) == 2 and r["rows_equal"]
        assert r["decode_tok_s"] > 0 and r["ttft_s"] > 0 and r["weight_bytes"] > 0
        assert r["tokens_equal_eager"] and r["matching_prefix"] == 6  # fp32 greedy: same tokens
    assert eager["compile_warm_s"] is None and inductor["compile_warm_s"] >= 0
    for r in (eager, inductor):  # the runtime is imported before the model: its RSS is part of the peak
        assert 0 < r["runtime_rss_mb"] < r["peak_rss_mb"]
        assert r["model_peak_rss_mb"] == pytest.approx(r["peak_rss_mb"] - r["runtime_rss_mb"])
    assert inductor["runtime_rss_mb"] > eager["runtime_rss_mb"]  # Inductor's own import
    assert inductor["recompiles"] == 0 and inductor["graphs_compiled_while_timed"] == 0
    assert inductor["speedup_vs_inductor"] == pytest.approx(1.0)
    # interleaved by default: the speedup shown is the median of per-round ratios
    assert grid["settings"]["schedule"] == "interleaved"
    assert inductor["speedup_vs_inductor_paired"] == pytest.approx(1.0)
    assert eager["speedup_vs_inductor_paired"] == pytest.approx(statistics.median(
        e / i for e, i in zip(eager["decode_tok_s_all"], inductor["decode_tok_s_all"])))
    assert f"| {eager['speedup_vs_inductor_paired']:.2f}x |" in proc.stdout

    with open(out.with_suffix(".csv"), newline="") as fh:
        rows = list(csv.DictReader(fh))
    from ffl_backend.bench.outputs import CSV_COLUMNS

    assert tuple(rows[0]) == CSV_COLUMNS and len(rows) == 2
    assert [r["backend"] for r in rows] == ["eager", "inductor"] and float(rows[1]["decode_tok_s"]) > 0

    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "| configuration |" in out.with_suffix(".md").read_text()

@pytest.mark.slow  # measured cost and the fast set's budget: docs/testing.md
def test_tiny_model_fastflow_and_int8_rows(tiny_folder, tmp_path):
    """The rows the benchmark exists for: fastflow (optimize() with its defaults) and an int8 model
    under fastflow, each next to eager of the same dtype, each verified before it is timed."""
    out = tmp_path / "ff"
    proc = run_bench("--model", str(tiny_folder), "--backends", "eager", "fastflow", "--dtypes", "bfloat16",
                  "--quant", "none", "int8", "--prompt-lens", "8", "--new-tokens", "6", "--repeats", "2",
                  "--threads", "1", "--no-warm-compile", "--out", str(out), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bfloat16 fastflow b1 p8" in proc.stdout and "bfloat16 int8 fastflow b1 p8" in proc.stdout
    rows = {(r["quant"], r["backend"]): r for r in json.loads(out.with_suffix(".json").read_text())["results"]}
    assert set(rows) == {("none", "eager"), ("none", "fastflow"), ("int8", "eager"), ("int8", "fastflow")}
    for r in rows.values():
        assert "error" not in r, r["error"]
        assert all(math.isfinite(v) and v > 0 for v in r["decode_tok_s_all"]) and len(r["decode_tok_s_all"]) == 2
        assert r["deterministic"] and r["rows_equal"] and len(r["tokens"]) == 6
        assert "matching_prefix" in r  # checked against unquantized bf16 eager before any speed is shown
    fast, fast8, eager8 = rows["none", "fastflow"], rows["int8", "fastflow"], rows["int8", "eager"]
    assert fast["tokens_equal_eager"] and fast["matching_prefix"] == 6
    assert fast["recompiles"] == 0 and fast["graphs_compiled_while_timed"] == 0
    assert fast8["tokens"] == eager8["tokens"]  # int8 under fastflow decodes as int8 eager does
    assert fast8["weight_bytes"] < fast["weight_bytes"] / 1.5  # the int8 row really ran quantized

def test_code_must_be_a_checkout(tiny_folder, tmp_path):
    one_line_error(run_bench("--model", str(tiny_folder), "--code", str(tmp_path)), "--code", "no fastflow checkout")

@pytest.mark.slow
def test_code_rows_run_the_other_checkouts_package(tiny_folder, tmp_path):
    """A copy of the package whose session marks its rows: only the @other row carries the mark."""
    import shutil

    import ffl_backend

    other = tmp_path / "other"
    shutil.copytree(os.path.dirname(ffl_backend.__file__), other / "ffl_backend",
                    ignore=shutil.ignore_patterns("__pycache__"))
    session = other / "ffl_backend" / "bench" / "session.py"
    text = session.read_text()
    marked = text.replace('        out["runtime_rss_mb"] = self.runtime_rss_mb',
                          '        out["checkout"] = "other"\n        out["runtime_rss_mb"] = self.runtime_rss_mb')
    assert marked != text
    session.write_text(marked)
    out = tmp_path / "r"
    proc = run_bench("--model", str(tiny_folder), "--backends", "eager", "--dtypes", "bfloat16", "--new-tokens", "2",
                  "--repeats", "2", "--prompt-lens", "4", "--no-progress", "--no-warm-compile", "--code", str(other),
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [(label(r), r.get("checkout")) for r in rows] == [("bfloat16 eager b1 p4", None),
                                                             ("bfloat16 eager b1 p4 @other", "other")]
    assert rows[1]["vs_this_checkout_paired"] > 0 and "bfloat16 eager b1 p4 @other vs this checkout" in proc.stderr
