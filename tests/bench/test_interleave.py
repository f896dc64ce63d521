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

def test_interleaving_falls_back_to_sequential_where_memory_is_short(tmp_path, monkeypatch):
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
    for available, expected in ((4.0, "sequential"), (10.0, "interleaved"), (None, "interleaved")):
        monkeypatch.setattr(interleave, "available_memory_gb", lambda: available)
        assert choose_schedule("interleaved", cfgs, logged.append) == expected
    assert len(logged) == 1 and "~3.7 GB memory needed" in logged[0] and "4.0 GB available" in logged[0]
    assert choose_schedule("sequential", cfgs, logged.append) == "sequential"
    # on a GPU the device's free memory is checked as well
    monkeypatch.setattr(interleave, "available_memory_gb", lambda: 100.0)
    monkeypatch.setattr(interleave, "available_gpu_memory_gb", lambda: 2.0)
    gpu = [{**cfg, "device": "cuda"} for cfg in cfgs]
    assert interleave.gpu_memory_needed_gb(gpu) == pytest.approx(
        interleave.memory_needed_gb(gpu) - 3 * (interleave.RUNTIME_GB - interleave.CUDA_CONTEXT_GB))
    assert choose_schedule("interleaved", gpu, logged.append) == "sequential" and "GPU memory" in logged[-1]
    assert choose_schedule("interleaved", cfgs, logged.append) == "interleaved"  # CPU runs ignore the GPU

def test_worker_command_and_rank_errors():
    from ffl_backend.bench.interleave import error_line, worker_command

    assert worker_command({"backend": "eager"})[:3] == [sys.executable, "-m", "ffl_backend.bench.worker"]
    cmd = worker_command({"backend": "eager", "tp": 3}, "--serve")
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
    assert cmd[cmd.index("--no-python") + 1:][:4] == [sys.executable, "-m", "ffl_backend.bench.worker", "--serve"]
    stderr = ("[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: heads=9 does not divide by 2\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n=====\n")
    assert error_line(stderr) == "ValueError: heads=9 does not divide by 2"
