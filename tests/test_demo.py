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


def test_main_generates_through_optimize_then_prints_the_grid(tmp_path, monkeypatch, capsys):
    """main() on the smallest configuration: a tiny Llama folder (word-level tokenizer) stands in
    for SmolLM2 and is loaded, optimize()d and generated from in this process as the demo does;
    the benchmark grid it then asks for (one process per row, run for real with fastflow rows by
    tests/bench/) is recorded and answered with fixed rows, so the table and the headline
    print from them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ffl_backend.bench
    import ffl_backend.models
    from ffl_backend.bench import llamacpp
    from ffl_backend.demo import main
    from tests.helpers import NoFallbacks
    from tests.tiny_models import save_tiny_folder

    folder = save_tiny_folder(tmp_path / "tiny")
    loaded = []

    def load_tiny(dtype=None, cache_dir=None):
        loaded.append(dtype)
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval(), AutoTokenizer.from_pretrained(folder)

    grids = []

    def recorded_grid(model, **kwargs):
        grids.append((model, kwargs))
        return {"results": [_row("inductor", "float32", 40.0, quant="none", batch=1, prompt_len=16, ttft_s=0.01,
                                 peak_rss_mb=500.0),
                            _row("fastflow", "float32", 100.0, quant="none", batch=1, prompt_len=16, ttft_s=0.01,
                                 peak_rss_mb=500.0)]}

    monkeypatch.setattr(ffl_backend.models, "load_smollm2", load_tiny)
    monkeypatch.setattr(ffl_backend.models, "smollm2_path", lambda cache_dir=None: folder)
    monkeypatch.setattr(ffl_backend.bench, "run_grid", recorded_grid)
    prompt = "It is a truth universally acknowledged"
    model, tok = load_tiny(torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    expected = tok.decode(model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None)[0, ids.shape[1]:],
                          skip_special_tokens=True)

    with NoFallbacks():  # the demo's generate compiled through fastflow, every family applied
        assert main(["--dtype", "float32", "--new-tokens", "5", "--prompt", prompt]) == 0
    out = capsys.readouterr().out
    assert loaded[-1] == torch.float32
    assert f">>> {prompt}\n{expected}\n" in out  # eager's greedy tokens, from the optimized model
    ((path, kwargs),) = grids
    backends = ("inductor", "fastflow") + (("llamacpp",) if llamacpp.import_error() is None else ())
    assert path == str(folder) and kwargs["backends"] == backends
    assert kwargs["dtypes"] == ("float32", "bfloat16") and kwargs["new_tokens"] == 5
    assert kwargs["warm_compile"] is False
    assert "| float32 fastflow b1 p16 | 100.0 |" in out
    assert "fastflow float32: 100.0 tok/s = 2.50x the fastest Inductor row here (float32, 40.0 tok/s)" in out
