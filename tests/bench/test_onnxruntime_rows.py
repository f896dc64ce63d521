"""bench/onnxruntime_rows.py: ONNX Runtime rows beside eager."""
import json

import pytest

from .conftest import RESULT_KEYS, run_bench


@pytest.mark.slow  # measured cost and the fast set's budget: docs/testing.md
def test_onnxruntime_rows_time_the_export_beside_eager(tiny_folder, tmp_path, monkeypatch):
    """The export is written once into the cache (FFL_CACHE_DIR), timed in the same rounds, its tokens
    compared with eager's; bfloat16 rows are skipped in one line (ONNX Runtime's CPU has no bf16)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    monkeypatch.setenv("FFL_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "ort"
    proc = run_bench("--model", str(tiny_folder), "--backends", "eager", "onnxruntime", "--dtypes", "float32",
                  "bfloat16", "--prompt-lens", "8", "--new-tokens", "6", "--repeats", "2", "--threads", "1",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ONNX Runtime's CPU kernels have no bfloat16" in proc.stdout + proc.stderr
    grid = json.loads(out.with_suffix(".json").read_text())
    ort_row = next(r for r in grid["results"] if r["backend"] == "onnxruntime")
    assert RESULT_KEYS <= set(ort_row) and ort_row["dtype"] == "float32" and ort_row["tokens_equal_eager"]
    assert grid["environment"]["onnxruntime"]["onnxruntime"]
    assert list((tmp_path / "cache" / "onnx").iterdir())  # the cached export
