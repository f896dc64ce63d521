"""bench/grid.py: the configurations and their labels, the schedules, the ratios between rows, report rows."""
import json
import os
import statistics
import sys

import pytest

from ffl_backend.bench.grid import label

from .conftest import run_bench


def test_each_fastflow_options_value_is_a_row_of_its_own():
    from ffl_backend.bench.grid import configurations, label

    todo, _ = configurations("m", ["inductor", "fastflow"], ["bfloat16"], ["int8"], [1], [16],
                             [None, {"int8_activations": "int16"}], options={"mode": "default"})
    assert [(r["backend"], r["options"]) for r in todo] == [
        ("inductor", None), ("fastflow", {"mode": "default"}),
        ("fastflow", {"mode": "default", "int8_activations": "int16"})]
    assert label(todo[2]) == "bfloat16 int8 fastflow int8_activations=int16 b1 p16"

def test_report_row_stamps_prints_and_appends(tmp_path, monkeypatch, capsys):
    from ffl_backend.bench.grid import report_row

    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["benchmarks/x.py", "--opt", '{"a": 1}'])
    report_row({"tok_s": 1.0}, str(out))
    report_row({"tok_s": 2.0}, str(out))
    rows = json.loads(out.read_text())
    assert [r["tok_s"] for r in rows] == [1.0, 2.0]
    assert rows[0]["command"] == "python benchmarks/x.py --opt '{\"a\": 1}'"
    assert rows[0]["environment"]["torch"]
    assert '"tok_s": 2.0' in capsys.readouterr().out

@pytest.mark.slow  # measured cost and the fast set's budget: docs/testing.md
def test_sequential_schedule_runs_one_process_at_a_time(tiny_folder, tmp_path):
    out = tmp_path / "seq"
    proc = run_bench("--model", str(tiny_folder), "--backends", "eager", "--dtypes", "float32", "--prompt-lens", "4",
                  "--new-tokens", "3", "--repeats", "2", "--threads", "1", "--schedule", "sequential",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    grid = json.loads(out.with_suffix(".json").read_text())
    (row,) = grid["results"]
    assert grid["settings"]["schedule"] == "sequential" and "schedule" not in row
    assert len(row["decode_tok_s_all"]) == 2 and "speedup_vs_inductor_paired" not in row
    assert "one process after another" in out.with_suffix(".md").read_text()

def test_a_grid_that_does_not_fit_runs_alternating_and_says_so(tiny_folder, monkeypatch):
    """run_grid: interleaving asked for (the default) but not fitting -> the alternating schedule, one
    log line saying why, the schedule and its reason in the settings, per-round (paired) ratios."""
    from ffl_backend.bench import bandwidth, grid

    monkeypatch.setattr(grid, "fits_in_memory", lambda todo: (False, "~31.0 GB memory needed for all "
                                                                      "configurations at once, 20.0 GB available"))
    monkeypatch.setattr(bandwidth, "machine_bandwidth", lambda device: {})
    monkeypatch.setattr(grid, "add_ceilings", lambda results, device: None)
    ran = []

    def fake_alternating(todo, repeats, bar=None):
        ran.append([label(c) for c in todo])
        return [{**c, "decode_tok_s": statistics.median(s), "decode_tok_s_all": s, "tokens": [1]}
                for c, s in zip(todo, ([10.0, 20.0, 30.0], [20.0, 20.0, 60.0]))]

    monkeypatch.setattr(grid, "run_alternating", fake_alternating)
    logged = []
    out = grid.run_grid(str(tiny_folder), ["eager", "inductor"], ["bfloat16"], 4, 3, 3, log=logged.append,
                        progress=False)
    assert ran == [["bfloat16 eager b1 p4", "bfloat16 inductor b1 p4"]]
    (line,) = [x for x in logged if "would not fit" in x]
    assert "20.0 GB available): alternating schedule instead -- one configuration process at a time" in line
    assert out["settings"]["schedule"] == "alternating"
    assert out["settings"]["schedule_reason"].startswith("interleaved would not fit: ~31.0 GB")
    eager = out["results"][0]
    assert eager["speedup_vs_inductor_paired"] == pytest.approx(statistics.median([0.5, 1.0, 0.5]))


@pytest.mark.slow  # 4 worker processes: ~30 s on a quiet 2-core VM, minutes beside a busy one
def test_alternating_schedule_end_to_end(tiny_folder, tmp_path):
    """--schedule alternating on eager rows: a process per configuration per round; the int8 row's
    later rounds load the model its first round quantized and saved (no quantize of their own) and
    decode the same tokens; rows carry per-round figures and paired ratios like interleaved ones."""
    out = tmp_path / "alt"
    proc = run_bench("--model", str(tiny_folder), "--backends", "eager", "--dtypes", "bfloat16", "--quant", "none",
                     "int8", "--prompt-lens", "4", "--new-tokens", "3", "--repeats", "2", "--threads", "1",
                     "--schedule", "alternating", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "round 2/2: finished bfloat16 int8 eager b1 p4" in proc.stderr
    grid = json.loads(out.with_suffix(".json").read_text())
    assert grid["settings"]["schedule"] == "alternating" and grid["settings"]["schedule_reason"] == "requested"
    plain, int8 = grid["results"]
    for r in (plain, int8):
        assert "error" not in r and r["rounds"] == 2 and len(r["decode_tok_s_all"]) == len(r["ttft_s_all"]) == 2
        assert r["deterministic"] and len(r["tokens"]) == 3 and "quantized_dir" not in r and r["repeats"] == 2
        assert len(r["peak_rss_mb_all"]) == 2 and r["peak_rss_mb"] == max(r["peak_rss_mb_all"])
        assert r["compile_warm_s"] is None  # eager: nothing compiles
    assert int8["quantize_s_all"][0] > 0 and int8["quantize_s_all"][1] == 0.0  # round 2 loaded the saved model
    assert plain["tokens_equal_eager"] and "matching_prefix" in int8
    assert "alternating round by round (a fresh process" in out.with_suffix(".md").read_text()


@pytest.mark.slow  # measured cost and the fast set's budget: docs/testing.md
def test_tensor_parallel_rows_run_under_torchrun_and_report_the_all_reduce(tiny_folder, tmp_path):
    """--tp 1 2: the split rows run as 2 ranks (rank 0 answers, the others follow its requests), make the
    whole model's greedy tokens and report one all-reduce's time and its share of a decode step."""
    out = tmp_path / "tp"
    proc = run_bench("--model", str(tiny_folder), "--backends", "eager", "fastflow", "llamacpp", "--dtypes", "float32",
                  "--tp", "1", "2", "--prompt-lens", "8", "--new-tokens", "6", "--repeats", "2",
                  "--no-warm-compile", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grid = json.loads(out.with_suffix(".json").read_text())
    rows = {label(r): r for r in grid["results"]}
    split = rows["float32 fastflow b1 p8 tp2"]
    assert "error" not in split and split["tp"] == 2 and split["allreduce_per_step"] == 4  # 2 layers x 2
    assert split["allreduce_us"] > 0 and split["allreduce_share_pct"] > 0
    assert split["tokens"] == rows["float32 eager b1 p8"]["tokens"] == rows["float32 eager b1 p8 tp2"]["tokens"]
    assert "float32 llamacpp b1 p8 tp2" in {label(s) for s in grid["skipped"]}
    assert "float32 fastflow b1 p8 tp2: one all-reduce" in out.with_suffix(".md").read_text()

def test_fastflow_rows_are_compared_with_the_onnxruntime_row_of_their_scheme():
    from ffl_backend.bench.grid import speedups
    from ffl_backend.bench.outputs import table

    def row(backend, dtype, quant, rates):
        return {"backend": backend, "dtype": dtype, "quant": quant, "batch": 1, "prompt_len": 16, "new_tokens": 4,
                "decode_tok_s": statistics.median(rates), "decode_tok_s_all": rates, "ttft_s": 0.01,
                "peak_rss_mb": 1.0, "tokens": [1]}
    results = [row("onnxruntime", "float32", "int4-all", [50.0, 40.0, 60.0]),
               row("fastflow", "bfloat16", "int4-all", [100.0, 100.0, 90.0]),
               row("fastflow", "bfloat16", "int8-all", [80.0, 80.0, 80.0])]
    speedups(results, paired=True)
    assert results[1]["speedup_vs_onnxruntime_paired"] == pytest.approx(2.0)  # median of 2.0, 2.5, 1.5
    assert "speedup_vs_onnxruntime" not in results[2]  # no onnxruntime row of int8-all
    grid = {"results": results}
    assert "| vs onnxruntime |" in table(grid) and "| 2.00x |" in table(grid)

def test_code_versions_add_a_row_per_checkout_with_its_path_and_ratio(tmp_path):
    """--code: each row once more per other checkout, labelled with its commit, its worker's PYTHONPATH
    led by that checkout, and its decode speed over this checkout's same row, round by round."""
    from ffl_backend.bench.grid import versus_this_checkout, with_code_versions
    from ffl_backend.bench.interleave import worker_command, worker_env

    rows = [{"dtype": "bfloat16", "quant": q, "backend": "fastflow", "batch": 1, "prompt_len": 16}
            for q in ("none", "int8")]
    todo = with_code_versions(rows, [str(tmp_path)])
    other = f"@{tmp_path.name}"
    assert [label(r) for r in todo] == ["bfloat16 fastflow b1 p16", f"bfloat16 fastflow b1 p16 {other}",
                                        "bfloat16 int8 fastflow b1 p16", f"bfloat16 int8 fastflow b1 p16 {other}"]
    assert worker_env("/c", todo[1]["code"])["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)
    assert worker_env("/c").get("PYTHONPATH") == os.environ.get("PYTHONPATH")  # this checkout's rows: as they were
    command = worker_command(todo[1])
    assert command[1] == "-c" and repr(str(tmp_path)) in command[2] and worker_command(todo[0])[1:3] == [
        "-m", "ffl_backend.bench.worker"]
    speeds = ([10.0, 12.0, 11.0], [9.0, 12.0, 9.9], [20.0, 20.0, 20.0], [21.0, 20.0, 22.0])
    results = [{**r, "decode_tok_s": statistics.median(s), "decode_tok_s_all": s} for r, s in zip(todo, speeds)]
    versus_this_checkout(results, paired=True)
    assert "vs_this_checkout" not in results[0] and "vs_this_checkout" not in results[2]
    assert results[1]["vs_this_checkout"] == pytest.approx(9.9 / 11.0)
    assert results[1]["vs_this_checkout_paired"] == pytest.approx(0.9)  # median of 0.9, 1.0, 0.9
    assert results[3]["vs_this_checkout_paired"] == pytest.approx(1.05)
