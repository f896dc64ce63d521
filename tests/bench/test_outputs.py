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
