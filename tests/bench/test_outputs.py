"""bench/outputs.py: the table, JSON, CSV and chart of a grid."""
import csv
import os


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


def test_results_files_declare_the_schedule_and_why(tmp_path):
    """The markdown header says how the processes ran and why that schedule; the JSON keeps both in
    its settings; the alternating schedule's speedups are per-round ratios, as interleaved ones are."""
    import json

    from ffl_backend.bench.outputs import header, write_all

    def grid(schedule, reason):
        return {"environment": {"machine": "test cpu", "torch": "x", "transformers": "y", "torch_threads": 2,
                                "date": "today"},
                "settings": {"model": "/m/tiny", "new_tokens": 4, "repeats": 3, "warmup": 1, "schedule": schedule,
                             "schedule_reason": reason},
                "results": [{"backend": "eager", "dtype": "bfloat16", "quant": "none", "batch": 1, "prompt_len": 4,
                             "decode_tok_s": 5.0, "ttft_s": 0.1, "peak_rss_mb": 900.0, "tokens": [1],
                             "speedup_vs_inductor": 1.1, "speedup_vs_inductor_paired": 1.2}]}

    why = "interleaved would not fit: ~31.2 GB memory needed for all configurations at once, 20.1 GB available"
    alternating = grid("alternating", why)
    text = header(alternating)
    assert f"(schedule alternating: {why})" in text and "alternating round by round" in text
    write_all(alternating, str(tmp_path / "a"))
    assert "median of the per-round ratios" in text and "| 1.20x |" in (tmp_path / "a.md").read_text()
    assert json.loads((tmp_path / "a.json").read_text())["settings"]["schedule_reason"] == why
    interleaved = header(grid("interleaved", "every configuration fits in memory at once (~3 GB ...)"))
    assert "(schedule interleaved: every configuration fits" in interleaved and "timed round robin" in interleaved
    assert "one process after another (schedule sequential: requested)" in header(grid("sequential", "requested"))
    old = grid("interleaved", None)
    del old["settings"]["schedule_reason"]  # files written before the reason was recorded
    assert "timed round robin (one generate each per round), so" in header(old)
