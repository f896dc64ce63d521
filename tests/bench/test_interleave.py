"""bench/interleave.py and worker.py: workers set up first, timed round robin, their errors, the memory check."""
import io
import json
import sys

import pytest


class _FakeWorker:
    """Stands in for interleave.WorkerProcess: records every set-up and request in `events`."""
    events: list = []

    def __init__(self, cfg, cache_dir):
        self.name, self.error, self.rates = cfg["name"], None, []
        self.events.append(("setup", self.name))
        if cfg.get("fails"):
            self.error = "RuntimeError: cannot load"

    def request(self, what):
        if self.error is not None:
            return {}
        self.events.append((what, self.name))
        if what == "time":
            self.rates.append(len(self.events))
            return {"decode_tok_s": float(len(self.events))}
        return {"decode_tok_s_all": self.rates}

    def close(self):
        self.events.append(("close", self.name))

def test_interleaved_timing_sets_all_up_first_then_alternates_rounds(monkeypatch):
    from ffl_backend.bench import interleave

    _FakeWorker.events = events = []
    monkeypatch.setattr(interleave, "WorkerProcess", _FakeWorker)
    cfgs = [{"name": "a", "quant": "none"}, {"name": "broken", "fails": True}, {"name": "b", "quant": "int8"},
            {"name": "c", "quant": "int4"}]
    progress = []
    out = interleave.time_interleaved(cfgs, ["/tmp"] * 4, repeats=3, on_progress=lambda *a: progress.append(a))
    assert progress == [(0, "set up"), (1, "set up"), (2, "set up"), (3, "set up"), (0, "round"), (1, "round"),
                        (2, "round")]
    # quantized ones first: they page the checkpoint out only while no other process maps it
    assert events[:4] == [("setup", n) for n in ("b", "c", "a", "broken")]
    timed = [n for what, n in events if what == "time"]
    assert timed == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert out[1] == {"error": "RuntimeError: cannot load"}
    assert [len(r["decode_tok_s_all"]) for r in (out[0], out[2], out[3])] == [3, 3, 3]
    assert sorted(n for what, n in events if what == "close") == ["a", "b", "broken", "c"]

def test_worker_serves_timed_generates_on_request(tiny_folder):
    from ffl_backend.bench.worker import serve

    cfg = {"model": str(tiny_folder), "backend": "eager", "dtype": "float32", "quant": "none", "batch": 1,
           "prompt_len": 4, "new_tokens": 3, "threads": 1}
    replies = io.StringIO()
    serve(cfg, io.StringIO("time\nwhat\ntime\nfinish\ntime\n"), replies)
    lines = [json.loads(line) for line in replies.getvalue().splitlines()]
    assert lines[0] == {"ready": True}
    assert lines[1]["decode_tok_s"] > 0 and "unknown request 'what'" in lines[2]["error"]
    summary = lines[4]
    assert summary["decode_tok_s_all"] == [lines[1]["decode_tok_s"], lines[3]["decode_tok_s"]]
    assert len(lines) == 5  # nothing is answered after finish
    assert summary["load_s"] > 0 and summary["peak_rss_mb"] > 0 and len(summary["tokens"]) == 3

def test_a_worker_that_dies_while_setting_up_reports_why(tmp_path):
    from ffl_backend.bench.interleave import WorkerProcess

    cfg = {"model": str(tmp_path / "missing"), "backend": "eager", "dtype": "float32", "quant": "none",
           "batch": 1, "prompt_len": 4, "new_tokens": 3}
    worker = WorkerProcess(cfg, str(tmp_path))
    try:
        assert worker.error and "missing" in worker.error and worker.request("time") == {}
    finally:
        worker.close()

def test_interleaving_falls_back_to_alternating_where_memory_is_short(tmp_path, monkeypatch):
    from ffl_backend.bench import interleave
    from ffl_backend.bench.grid import choose_schedule

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    with open(tmp_path / "model.safetensors", "wb") as fh:
        fh.truncate(200_000_000)  # sparse: the size is what counts
    cfgs = [{"model": str(tmp_path), "dtype": d, "quant": q}
            for d, q in (("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8"))]
    assert interleave.memory_needed_gb(cfgs) == pytest.approx(3 * interleave.RUNTIME_GB + 0.4 + 0.2
                                                              + 0.2 * interleave.QUANTIZED_SHARE)
    with open(tmp_path / "model.gguf", "wb") as fh:  # a llama.cpp row: its small runtime and its file
        fh.truncate(50_000_000)
    llama = {"model": str(tmp_path), "dtype": "bfloat16", "quant": "int8", "backend": "llamacpp",
             "gguf": str(tmp_path / "model.gguf")}
    assert interleave.memory_needed_gb([llama]) == pytest.approx(interleave.LLAMACPP_RUNTIME_GB + 0.05)
    assert interleave.available_memory_gb() > 0  # this machine's /proc/meminfo
    logged = []
    for available, expected in ((4.0, "alternating"), (10.0, "interleaved"), (None, "interleaved")):
        monkeypatch.setattr(interleave, "available_memory_gb", lambda: available)
        assert choose_schedule("interleaved", cfgs, logged.append)[0] == expected
    # one line says why and what runs instead; the reason goes to the results file
    (line,) = logged
    assert "~3.7 GB memory needed" in line and "4.0 GB available" in line and "\n" not in line
    assert "alternating schedule instead" in line and "the largest ~1.4 GB" in line  # fp32: 1.0 + 0.4
    monkeypatch.setattr(interleave, "available_memory_gb", lambda: 4.0)
    assert choose_schedule("interleaved", cfgs, logged.append)[1].startswith("interleaved would not fit: ~3.7 GB")
    assert choose_schedule("sequential", cfgs, logged.append) == ("sequential", "requested")
    assert choose_schedule("alternating", cfgs, logged.append) == ("alternating", "requested")
    assert len(logged) == 2  # asked for by name: no note
    # on a GPU the device's free memory is checked as well
    monkeypatch.setattr(interleave, "available_memory_gb", lambda: 100.0)
    monkeypatch.setattr(interleave, "available_gpu_memory_gb", lambda: 2.0)
    gpu = [{**cfg, "device": "cuda"} for cfg in cfgs]
    assert interleave.gpu_memory_needed_gb(gpu) == pytest.approx(
        interleave.memory_needed_gb(gpu) - 3 * (interleave.RUNTIME_GB - interleave.CUDA_CONTEXT_GB))
    assert choose_schedule("interleaved", gpu, logged.append)[0] == "alternating" and "GPU memory" in logged[-1]
    assert choose_schedule("interleaved", cfgs, logged.append)[0] == "interleaved"  # CPU runs ignore the GPU

def test_worker_command_and_rank_errors():
    from ffl_backend.bench.interleave import error_line, worker_command

    assert worker_command({"backend": "eager"})[:3] == [sys.executable, "-m", "ffl_backend.bench.worker"]
    cmd = worker_command({"backend": "eager", "tp": 3}, "--serve")
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
    assert cmd[cmd.index("--no-python") + 1:][:4] == [sys.executable, "-m", "ffl_backend.bench.worker", "--serve"]
    stderr = ("[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: heads=9 does not divide by 2\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n=====\n")
    assert error_line(stderr) == "ValueError: heads=9 does not divide by 2"


def _round_summary(rate: float, first_s: float, peak: float, tokens=(5, 6, 7)) -> dict:
    """What worker.run_one returns for one timed generate (session.summarize_runs' keys)."""
    return {"load_s": 1.0, "quantize_s": 2.0, "first_generate_s": first_s, "compile_cold_s": first_s - 0.5,
            "generate_s": 0.5, "ttft_s": 0.01 * rate, "prefill_tok_s": 1.0, "decode_tok_s": rate,
            "decode_tok_s_all": [rate], "decode_tok_s_min": rate, "decode_tok_s_max": rate,
            "decode_spread_pct": 0.0, "recompiles": 0, "graphs_compiled_while_timed": 0, "cuda_peak_mb": None,
            "peak_rss_mb": peak, "runtime_rss_mb": 400.0, "model_peak_rss_mb": peak - 400.0,
            "tokens": list(tokens), "rows_equal": True, "deterministic": True, "weight_bytes": 10**9,
            "effective_gbs": rate, "kv_cache_mb": 1.0}


def test_alternating_schedule_runs_a_process_per_configuration_per_round(monkeypatch, tmp_path):
    """One process at a time, configurations alternating A B C, C B A, A B C; each configuration on its
    own cache folder every round, a quantized torch row told where its quantized model is kept; a
    failing configuration runs no further rounds; rows come out in the interleaved schedule's shape."""
    from ffl_backend.bench import interleave

    calls = []

    def fake_worker(cfg, cache_dir):
        calls.append((cfg["name"], cache_dir, cfg["repeats"], cfg.get("quantized_dir")))
        r = sum(1 for c in calls if c[0] == cfg["name"]) - 1  # this configuration's round
        if cfg["name"] == "c" and r == 1:
            return {"error": "RuntimeError: out of memory"}
        first_s = 30.0 if r == 0 else 3.0  # the first round compiles cold
        return _round_summary(10.0 * (r + 1) + (cfg["name"] == "b"), first_s, peak=2000.0 - 100 * r)

    monkeypatch.setattr(interleave, "run_worker", fake_worker)
    cfgs = [{"name": "a", "backend": "inductor", "quant": "none", "prompt_len": 4, "batch": 1, "repeats": 3},
            {"name": "b", "backend": "fastflow", "quant": "int8", "prompt_len": 4, "batch": 1, "repeats": 3},
            {"name": "c", "backend": "eager", "quant": "int8", "prompt_len": 4, "batch": 1, "repeats": 3}]
    dirs = [str(tmp_path / n) for n in "abc"]
    progress = []
    rows = interleave.time_alternating(cfgs, dirs, 3, on_progress=lambda *a: progress.append(a))
    assert [c[0] for c in calls] == ["a", "b", "c", "c", "b", "a", "a", "b"]  # c failed in round 2
    assert all(c[1] == dirs["abc".index(c[0])] and c[2] == 1 for c in calls)  # own folder, one timed generate
    assert {c[0]: c[3] for c in calls} == {"a": None, "b": str(tmp_path / "b" / "quantized"),
                                           "c": str(tmp_path / "c" / "quantized")}
    assert progress[-1] == (2, 1, True) and (1, 2, True) in progress and (0, 0, False) in progress
    assert rows[2] == {"error": "round 2: RuntimeError: out of memory"}
    a, b = rows[0], rows[1]
    assert a["decode_tok_s_all"] == [10.0, 20.0, 30.0] and b["decode_tok_s_all"] == [11.0, 21.0, 31.0]
    assert a["decode_tok_s"] == 20.0 and a["decode_tok_s_min"] == 10.0 and a["decode_spread_pct"] == 100.0
    assert a["ttft_s_all"] == [0.1, 0.2, 0.3] and a["ttft_s"] == 0.2 and a["prefill_tok_s"] == 4 / 0.2
    assert a["compile_cold_s"] == 29.5 and a["compile_warm_s"] == 2.5  # the first round's; the later ones'
    assert a["peak_rss_mb"] == 2000.0 and a["model_peak_rss_mb"] == 1600.0
    assert a["peak_rss_mb_all"] == [2000.0, 1900.0, 1800.0] and a["rounds"] == 3
    assert a["deterministic"] and a["effective_gbs"] == 20.0
    from .conftest import RESULT_KEYS

    added_by_the_grid = {*cfgs[0], "dtype", "new_tokens", "ceiling_gbs", "pct_of_ceiling"}  # configuration, ceilings
    assert RESULT_KEYS - added_by_the_grid <= set(a)


def test_merged_rounds_say_when_a_round_decoded_differently():
    from ffl_backend.bench.interleave import merge_rounds

    cfg = {"backend": "eager", "quant": "int8", "prompt_len": 4}
    rounds = [_round_summary(10.0, 3.0, 900.0), _round_summary(12.0, 1.0, 800.0, tokens=(5, 6, 8))]
    row = merge_rounds(cfg, rounds)
    assert not row["deterministic"] and row["tokens"] == [5, 6, 7]
    assert row["compile_warm_s"] is None  # eager compiles nothing
