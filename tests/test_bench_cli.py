"""`ffl-bench`: one-line errors for bad requests, a tiny model end to end, and the output files' schema."""
import csv
import io
import json
import math
import os
import statistics
import subprocess
import sys

import pytest

from ffl_backend.bench.grid import label
from tiny_models import save_tiny_folder, tiny_model

# Keys every successful result row carries in the JSON (the CSV holds the scalar ones).
RESULT_KEYS = {"backend", "dtype", "quant", "batch", "prompt_len", "new_tokens", "load_s", "compile_cold_s",
               "compile_warm_s", "ttft_s", "prefill_tok_s", "decode_tok_s", "decode_tok_s_all",
               "decode_tok_s_min", "decode_tok_s_max", "decode_spread_pct", "peak_rss_mb", "recompiles",
               "weight_bytes", "effective_gbs", "ceiling_gbs", "pct_of_ceiling", "tokens", "rows_equal"}


def _bench(*args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # workers run real code paths
    return subprocess.run([sys.executable, "-m", "ffl_backend.bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama with a word-level tokenizer, saved as a Hugging Face folder (no download)."""
    return save_tiny_folder(tmp_path_factory.mktemp("tiny_llama"))


def _one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ffl-bench: error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for fragment in fragments:
        assert fragment in lines[0]


def test_missing_model_folder(tmp_path):
    _one_line_error(_bench("--model", str(tmp_path / "nope")), "model folder not found")


def test_folder_without_config(tmp_path):
    _one_line_error(_bench("--model", str(tmp_path)), "no config.json")


def test_unknown_backend(tiny_folder):
    _one_line_error(_bench("--model", str(tiny_folder), "--backends", "tvm"), "--backends", "tvm")


def test_unknown_scheme(tiny_folder):
    _one_line_error(_bench("--model", str(tiny_folder), "--quant", "int3"), "--quant", "int3")


def test_over_length_request(tiny_folder):
    _one_line_error(_bench("--model", str(tiny_folder), "--prompt-lens", "250", "--new-tokens", "10"),
                    "260 exceeds the model's 256 positions")


def test_non_positive_count(tiny_folder):
    _one_line_error(_bench("--model", str(tiny_folder), "--repeats", "0"), "positive integer")


def test_fastflow_options_must_be_json_objects(tiny_folder):
    _one_line_error(_bench("--model", str(tiny_folder), "--fastflow-options", "[1]"), "expected a JSON object")


def test_each_fastflow_options_value_is_a_row_of_its_own():
    from ffl_backend.bench.grid import configurations, label

    todo, _ = configurations("m", ["inductor", "fastflow"], ["bfloat16"], ["int8"], [1], [16],
                             [None, {"int8_activations": "int16"}], options={"mode": "default"})
    assert [(r["backend"], r["options"]) for r in todo] == [
        ("inductor", None), ("fastflow", {"mode": "default"}),
        ("fastflow", {"mode": "default", "int8_activations": "int16"})]
    assert label(todo[2]) == "bfloat16 int8 fastflow int8_activations=int16 b1 p16"


@pytest.mark.slow  # measured cost and the fast set's budget: docs/testing.md
def test_kv_cache_dtype_rows_report_their_cache_memory(tiny_folder, tmp_path):
    """One fastflow row per --kv-cache-dtype value; an int8 cache's rows (16 values + a 4-byte scale)
    take 20/64 of the fp32 cache's bytes."""
    out = tmp_path / "kv"
    proc = _bench("--model", str(tiny_folder), "--backends", "fastflow", "--dtypes", "float32",
                  "--kv-cache-dtype", "model", "int8", "--prompt-lens", "8", "--new-tokens", "4",
                  "--repeats", "1", "--threads", "1", "--no-warm-compile", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "float32 fastflow kv_cache_dtype=int8 b1 p8" in proc.stdout and "KV cache MiB" in proc.stdout
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    full, int8 = (r["kv_cache_mb"] for r in rows)
    assert int8 == pytest.approx(full * 20 / 64)


def test_only_skipped_configurations(tiny_folder):
    _one_line_error(_bench("--model", str(tiny_folder), "--dtypes", "float32", "--quant", "int8"),
                    "skipped", "bfloat16")


@pytest.mark.slow
def test_tiny_model_end_to_end(tiny_folder, tmp_path):
    out = tmp_path / "res" / "tiny"
    proc = _bench("--model", str(tiny_folder), "--backends", "eager", "inductor", "--dtypes", "float32",
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
    proc = _bench("--model", str(tiny_folder), "--backends", "eager", "fastflow", "--dtypes", "bfloat16",
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


def test_outputs_from_a_synthetic_grid(tmp_path):
    """Every writer accepts an error row and a skipped configuration, and the speedup panel copes
    with a group that has no Inductor baseline."""
    from ffl_backend.bench.outputs import CSV_COLUMNS, table, write_all

    base = {"backend": "fastflow", "dtype": "bfloat16", "quant": "int8", "batch": 1, "prompt_len": 16,
            "new_tokens": 4}
    ok = {**base, "decode_tok_s": 50.0, "decode_tok_s_min": 48.0, "decode_tok_s_max": 51.0, "ttft_s": 0.02,
          "peak_rss_mb": 900.0, "tokens": [1, 2, 3, 4]}
    grid = {"command": "ffl-bench", "environment": {"machine": "test cpu", "torch": "x", "transformers": "y",
                                                    "torch_threads": 2, "date": "today"},
            "bandwidth": {"dram_read_gbs": 30.0, "cache_read_gbs": 60.0},
            "settings": {"model": "/m/tiny", "new_tokens": 4, "repeats": 1, "warmup": 1},
            "results": [ok, {**base, "backend": "inductor", "error": "boom"}],
            "skipped": [{**base, "dtype": "float32", "reason": "because"}]}
    paths = write_all(grid, str(tmp_path / "g"))
    assert all(os.path.getsize(p) > 0 for p in paths)
    assert "error: boom" in table(grid) and "n/a (no eager run)" in table(grid)
    with open(tmp_path / "g.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0]) == CSV_COLUMNS and rows[1]["error"] == "boom"
    assert "Skipped (because): float32 int8 fastflow b1 p16." in (tmp_path / "g.md").read_text()


def test_weight_bytes_counts_a_tied_table_once_and_skips_lookup_only_embeddings():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ffl_backend
    from ffl_backend.bench.session import weight_bytes
    from tiny_models import COMMON

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    untied = tiny_model("llama")  # the embedding is only looked up: not read per step
    emb = untied.get_input_embeddings().weight
    assert weight_bytes(untied) == nbytes(untied.parameters()) - nbytes([emb])
    torch.manual_seed(0)
    tied = AutoModelForCausalLM.from_config(LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, **COMMON))
    assert weight_bytes(tied) == nbytes(tied.parameters())  # parameters() yields the tied table once
    before = weight_bytes(tied)
    ffl_backend.quantize(tied, "int8-all")  # one shared int8 table read by the head
    assert tied.get_input_embeddings().qweight.data_ptr() == tied.lm_head.qweight.data_ptr()
    unique = {t.data_ptr(): t for t in tied.state_dict().values()}
    assert weight_bytes(tied) == nbytes(unique.values()) < before / 3  # fp32 -> int8 + scales


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


def test_time_generate_makes_exactly_the_tokens_asked_even_past_eos():
    """The timed generate() must not stop at the end-of-sequence token (rates would count fewer steps
    than asked), and must get there without min_new_tokens' per-step logits processors."""
    import torch

    from ffl_backend.bench.session import time_generate

    model = tiny_model("llama")
    ids = torch.tensor([[1, 2, 3, 4]])
    first = time_generate(model, ids, 6)["tokens"]
    model.generation_config.eos_token_id = first[0]  # greedy decoding now emits EOS at once
    assert model.generate(ids, max_new_tokens=6, do_sample=False).shape[1] == ids.shape[1] + 1
    processors = []
    build = model._get_logits_processor
    model._get_logits_processor = lambda *a, **k: processors.append(build(*a, **k)) or processors[-1]
    run = time_generate(model, ids, 6)
    assert run["tokens"] == first and run["decode_tok_s"] > 0
    assert len(processors) == 1 and len(processors[0]) == 0


def test_left_padded_batches_hold_prompts_of_different_lengths():
    """--left-pad: row i of b keeps its last p - i p / (2 b) tokens, masked padding before them, and
    generate() gets the mask: row 0 (the whole prompt) decodes as it does alone."""
    import torch

    from ffl_backend.bench.grid import label
    from ffl_backend.bench.session import batch_prompts, time_generate

    class Tok:
        pad_token_id, eos_token_id = None, 0

        def __call__(self, text, return_tensors):
            return type("Out", (), {"input_ids": torch.arange(1, 200)[None]})

    cfg = {"prompt_len": 16, "batch": 4, "left_pad": True}
    ids, mask = batch_prompts(Tok(), cfg)
    assert mask.sum(1).tolist() == [16, 14, 12, 10] and (ids[mask == 0] == 0).all()
    assert torch.equal(ids[1, 2:], ids[0, 2:]) and batch_prompts(Tok(), {**cfg, "left_pad": False})[1] is None
    assert label({**cfg, "model": "m", "backend": "eager", "dtype": "float32", "quant": "none"}).endswith(
        "b4 p16 left-padded")
    model = tiny_model("llama")
    run = time_generate(model, ids, 5, mask)
    assert run["rows_equal"] is None and run["tokens"] == time_generate(model, ids[:1], 5)["tokens"]


@pytest.mark.slow  # measured cost and the fast set's budget: docs/testing.md
def test_sequential_schedule_runs_one_process_at_a_time(tiny_folder, tmp_path):
    out = tmp_path / "seq"
    proc = _bench("--model", str(tiny_folder), "--backends", "eager", "--dtypes", "float32", "--prompt-lens", "4",
                  "--new-tokens", "3", "--repeats", "2", "--threads", "1", "--schedule", "sequential",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    grid = json.loads(out.with_suffix(".json").read_text())
    (row,) = grid["results"]
    assert grid["settings"]["schedule"] == "sequential" and "schedule" not in row
    assert len(row["decode_tok_s_all"]) == 2 and "speedup_vs_inductor_paired" not in row
    assert "one process after another" in out.with_suffix(".md").read_text()


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


@pytest.mark.slow  # measured cost and the fast set's budget: docs/testing.md
def test_tensor_parallel_rows_run_under_torchrun_and_report_the_all_reduce(tiny_folder, tmp_path):
    """--tp 1 2: the split rows run as 2 ranks (rank 0 answers, the others follow its requests), make the
    whole model's greedy tokens and report one all-reduce's time and its share of a decode step."""
    out = tmp_path / "tp"
    proc = _bench("--model", str(tiny_folder), "--backends", "eager", "fastflow", "llamacpp", "--dtypes", "float32",
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


def test_worker_command_and_rank_errors():
    from ffl_backend.bench.interleave import error_line, worker_command

    assert worker_command({"backend": "eager"})[:3] == [sys.executable, "-m", "ffl_backend.bench.worker"]
    cmd = worker_command({"backend": "eager", "tp": 3}, "--serve")
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
    assert cmd[cmd.index("--no-python") + 1:][:4] == [sys.executable, "-m", "ffl_backend.bench.worker", "--serve"]
    stderr = ("[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: heads=9 does not divide by 2\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n=====\n")
    assert error_line(stderr) == "ValueError: heads=9 does not divide by 2"


@pytest.mark.slow  # measured cost and the fast set's budget: docs/testing.md
def test_onnxruntime_rows_time_the_export_beside_eager(tiny_folder, tmp_path, monkeypatch):
    """The export is written once into the cache (FFL_CACHE_DIR), timed in the same rounds, its tokens
    compared with eager's; bfloat16 rows are skipped in one line (ONNX Runtime's CPU has no bf16)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    monkeypatch.setenv("FFL_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "ort"
    proc = _bench("--model", str(tiny_folder), "--backends", "eager", "onnxruntime", "--dtypes", "float32",
                  "bfloat16", "--prompt-lens", "8", "--new-tokens", "6", "--repeats", "2", "--threads", "1",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ONNX Runtime's CPU kernels have no bfloat16" in proc.stdout + proc.stderr
    grid = json.loads(out.with_suffix(".json").read_text())
    ort_row = next(r for r in grid["results"] if r["backend"] == "onnxruntime")
    assert RESULT_KEYS <= set(ort_row) and ort_row["dtype"] == "float32" and ort_row["tokens_equal_eager"]
    assert grid["environment"]["onnxruntime"]["onnxruntime"]
    assert list((tmp_path / "cache" / "onnx").iterdir())  # the cached export


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
    from ffl_backend.bench.interleave import worker_env

    rows = [{"dtype": "bfloat16", "quant": q, "backend": "fastflow", "batch": 1, "prompt_len": 16}
            for q in ("none", "int8")]
    todo = with_code_versions(rows, [str(tmp_path)])
    other = f"@{tmp_path.name}"
    assert [label(r) for r in todo] == ["bfloat16 fastflow b1 p16", f"bfloat16 fastflow b1 p16 {other}",
                                        "bfloat16 int8 fastflow b1 p16", f"bfloat16 int8 fastflow b1 p16 {other}"]
    assert worker_env("/c", todo[1]["code"])["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)
    assert "PYTHONPATH" not in worker_env("/c") or worker_env("/c")["PYTHONPATH"] == os.environ.get("PYTHONPATH")
    speeds = ([10.0, 12.0, 11.0], [9.0, 12.0, 9.9], [20.0, 20.0, 20.0], [21.0, 20.0, 22.0])
    results = [{**r, "decode_tok_s": statistics.median(s), "decode_tok_s_all": s} for r, s in zip(todo, speeds)]
    versus_this_checkout(results, paired=True)
    assert "vs_this_checkout" not in results[0] and "vs_this_checkout" not in results[2]
    assert results[1]["vs_this_checkout"] == pytest.approx(9.9 / 11.0)
    assert results[1]["vs_this_checkout_paired"] == pytest.approx(0.9)  # median of 0.9, 1.0, 0.9
    assert results[3]["vs_this_checkout_paired"] == pytest.approx(1.05)


def test_code_must_be_a_checkout(tiny_folder, tmp_path):
    _one_line_error(_bench("--model", str(tiny_folder), "--code", str(tmp_path)), "--code", "no fastflow checkout")


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
    proc = _bench("--model", str(tiny_folder), "--backends", "eager", "--dtypes", "bfloat16", "--new-tokens", "2",
                  "--repeats", "2", "--prompt-lens", "4", "--no-progress", "--no-warm-compile", "--code", str(other),
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [(label(r), r.get("checkout")) for r in rows] == [("bfloat16 eager b1 p4", None),
                                                             ("bfloat16 eager b1 p4 @other", "other")]
    assert rows[1]["vs_this_checkout_paired"] > 0 and "bfloat16 eager b1 p4 @other vs this checkout" in proc.stderr
