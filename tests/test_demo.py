"""The README demo's headline: fastflow against the fastest Inductor row of the machine (whichever
dtype that is) and against llama.cpp when its rows ran."""
from ffl_backend.demo import headline


def _row(backend, dtype, tok_s, **extra):
    return {"backend": backend, "dtype": dtype, "decode_tok_s": tok_s, **extra}


def test_headline_compares_with_the_fastest_inductor_row_and_llama_cpp():
    grid = {"results": [_row("inductor", "float32", 32.0), _row("inductor", "bfloat16", 40.0),
                        _row("fastflow", "float32", 60.0), _row("fastflow", "bfloat16", 100.0),
                        _row("llamacpp", "bfloat16", 50.0, gguf_type="F16")]}
    text = headline(grid, "bfloat16")
    assert "2.50x the fastest Inductor row here (bfloat16, 40.0 tok/s)" in text
    assert "2.00x llama.cpp F16" in text


def test_headline_without_llama_cpp_or_with_a_failed_row():
    grid = {"results": [_row("inductor", "float32", 30.0), _row("fastflow", "float32", 45.0)]}
    assert "llama.cpp" not in headline(grid, "float32") and "1.50x" in headline(grid, "float32")
    grid["results"][1]["error"] = "boom"
    assert "did not finish" in headline(grid, "float32")
