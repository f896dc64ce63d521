"""Fixtures and helpers of the ffl-bench tests."""
import os
import subprocess
import sys

import pytest

from tiny_models import save_tiny_folder

# Keys every successful result row carries in the JSON (the CSV holds the scalar ones).
RESULT_KEYS = {"backend", "dtype", "quant", "batch", "prompt_len", "new_tokens", "load_s", "compile_cold_s",
               "compile_warm_s", "ttft_s", "prefill_tok_s", "decode_tok_s", "decode_tok_s_all",
               "decode_tok_s_min", "decode_tok_s_max", "decode_spread_pct", "peak_rss_mb", "recompiles",
               "weight_bytes", "effective_gbs", "ceiling_gbs", "pct_of_ceiling", "tokens", "rows_equal"}


def run_bench(*args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # workers run real code paths
    return subprocess.run([sys.executable, "-m", "ffl_backend.bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama with a word-level tokenizer, saved as a Hugging Face folder (no download)."""
    return save_tiny_folder(tmp_path_factory.mktemp("tiny_llama"))


def one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ffl-bench: error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for fragment in fragments:
        assert fragment in lines[0]
