"""Every torch.compile mode through every way in: `torch.compile(model, backend="fastflow", mode=...)`,
`model.compile(backend="fastflow", mode=...)` and transformers' `CompileConfig(backend="fastflow")`
(whose default mode is "reduce-overhead"), on tiny models of the 8 architectures: greedy tokens in
fp32 equal eager. With --slow each (architecture, mode) pair runs once, the way in rotating with
them, so every mode meets every way in and every architecture meets every mode; the fast set keeps one
architecture per mode, every way in among them (FAST_CASES). FFL_FULL_MODE_MATRIX=1 runs the whole
product (96 compiles, ~8 min on 2 cores; its last run is benchmarks/results/modes_full_matrix_cpu.log)."""
import os

import pytest
import torch

import ffl_backend
from tests.tiny_models import ARCHS, tiny_model

pytestmark = pytest.mark.usefixtures("no_fallbacks")  # no pattern family fell back, no anchor left

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
ENTRIES = ("torch.compile", "model.compile", "CompileConfig")
NEW = 6
CASES = ([(arch, mode, entry) for arch in ARCHS for mode in MODES for entry in ENTRIES]
         if os.environ.get("FFL_FULL_MODE_MATRIX") == "1" else
         [(arch, mode, ENTRIES[(a + m) % len(ENTRIES)])
          for a, arch in enumerate(ARCHS) for m, mode in enumerate(MODES)])
# The fast set: every mode and every way in at least once, on four architectures (cases of CASES).
FAST_CASES = {("llama", "default", "torch.compile"), ("gpt2", "reduce-overhead", "model.compile"),
              ("qwen3", "max-autotune", "CompileConfig"), ("gemma", "max-autotune-no-cudagraphs", "model.compile")}
assert FAST_CASES <= set(CASES)


def _static_greedy(model, ids):
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                              cache_implementation="static")


def _greedy_through_forward(forward, ids):
    """Greedy tokens through a compiled forward (what `torch.compile(model)` gives: its `.generate`
    would run the uncompiled model), re-reading the whole sequence each step."""
    seq = ids
    with torch.inference_mode():
        for _ in range(NEW):
            seq = torch.cat([seq, forward(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


def _compiled_greedy(model, ids, mode, entry):
    if entry == "torch.compile":
        return _greedy_through_forward(torch.compile(model, backend="fastflow", mode=mode), ids)
    if entry == "model.compile":
        model.compile(backend="fastflow", mode=mode)
        return _static_greedy(model, ids)
    from transformers import CompileConfig

    config = CompileConfig(backend="fastflow") if mode == "reduce-overhead" else CompileConfig(backend="fastflow",
                                                                                                mode=mode)
    assert CompileConfig().mode == "reduce-overhead"  # what "default CompileConfig" means here
    config._compile_all_devices = True  # transformers compiles only on CUDA otherwise
    model.generation_config.compile_config = config
    return _static_greedy(model, ids)


@pytest.mark.parametrize("arch,mode,entry", [c if c in FAST_CASES else pytest.param(*c, marks=pytest.mark.slow)
                                              for c in CASES], ids=[f"{a}-{m}-{e}" for a, m, e in CASES])
def test_mode_generates_eager_tokens(arch, mode, entry):
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (1, 7))
    eager = (_greedy_through_forward(model, ids) if entry == "torch.compile" else _static_greedy(model, ids))
    before = len(ffl_backend.fusion_reports())
    assert torch.equal(_compiled_greedy(model, ids, mode, entry), eager)
    assert len(ffl_backend.fusion_reports()) > before, "nothing compiled through fastflow"


def test_cpu_reduce_overhead_compiles_the_cpp_wrapper():
    """On CPU "reduce-overhead" is the C++ wrapper (the compiled graph's calls never re-enter Python);
    the report says which mode and settings each graph was compiled with."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 5))
    with torch.inference_mode():
        torch.compile(model, backend="fastflow", mode="reduce-overhead")(ids)
        report = ffl_backend.last_report()
        assert report.mode == "reduce-overhead" and report.inductor_config["cpp_wrapper"] is True
        torch.compile(model, backend="fastflow", options={"mode": "reduce-overhead",
                                                          "inductor_config": {"cpp_wrapper": False}})(ids)
        assert ffl_backend.last_report().inductor_config["cpp_wrapper"] is False  # options= still apply
