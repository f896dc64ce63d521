"""`ffl_backend.optimize` end to end: SmolLM2-135M greedy tokens equal eager in fp32, one decode graph
for every prompt length, pipelines, and the Accelerate recipe (examples/accelerate_generate.py). bf16 and
quantized SmolLM2 against bf16 eager: tests/test_smollm2_variants.py."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ffl_backend
from tests.helpers import NoFallbacks

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
NEW = 64


@pytest.fixture(scope="module")
def smollm2():
    """(optimized fp32 model, tokenizer, eager greedy ids for PROMPT). Eager runs first, on the
    unpatched model with HF's defaults (dynamic cache, sdpa)."""
    torch._dynamo.reset()
    model, tokenizer = ffl_backend.load_smollm2(torch.float32)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        eager = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    ffl_backend.optimize(model, max_seq_len=2048)
    return model, tokenizer, eager


@pytest.mark.slow
def test_smollm2_greedy_equals_eager(smollm2):
    model, tokenizer, eager = smollm2
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode(), NoFallbacks():  # decode compiled through fastflow, every family applied
        out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, eager), tokenizer.decode(out[0]) + " vs " + tokenizer.decode(eager[0])
    assert model.config._attn_implementation == "fastflow"


@pytest.mark.slow
def test_smollm2_no_recompiles_across_prompt_lengths(smollm2):
    from ffl_backend.bench import prompt_ids

    model, tokenizer, _ = smollm2
    text = ROOT.parent / "shared" / "data" / "prideprejudice.txt"
    before = len(ffl_backend.fusion_reports())
    with torch.inference_mode(), NoFallbacks(require_graph=False):
        for length in (17, 100, 333, 512, 900):
            ids = prompt_ids(tokenizer, length, str(text))
            assert ids.shape[1] == length
            out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
            assert out.shape[1] == length + 3
    new = ffl_backend.fusion_reports()[before:]
    # 0 graphs when the decode graph already exists (test above), else exactly the first compile
    assert len(new) <= 1, [r.summary() for r in new]
    assert not any(r.recompile for r in new), [r.guard_failure for r in new]


@pytest.mark.slow
def test_pipeline_runs_compiled_after_optimize(smollm2):
    from transformers import pipeline

    model, tokenizer, eager = smollm2
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    with NoFallbacks(require_graph=False):
        out = pipe(PROMPT, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    prompt_len = len(tokenizer(PROMPT).input_ids)
    assert out == PROMPT + tokenizer.decode(eager[0, prompt_len:prompt_len + 8], skip_special_tokens=True)
    with pytest.raises(ValueError, match="max_seq_len"):
        pipe(PROMPT, max_new_tokens=4096)


def _launch(*launch_args, env=None):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch_args,
           str(ROOT / "examples" / "accelerate_generate.py"), "--tiny"]
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if line.startswith("rank ")]


def test_accelerate_recipe_cpu():
    """The documented command. Accelerate 1.16 runs `--cpu --num_processes 2` as ONE process (its
    simple launcher only fans out through mpirun with a hostfile)."""
    lines = _launch("--cpu", "--num_processes", "2")
    assert lines and all("equal_to_eager=True" in line for line in lines), lines


@pytest.mark.slow  # measured cost and the fast set's budget: docs/testing.md
def test_accelerate_recipe_two_cpu_processes():
    """Two real ranks on CPU (gloo, DDP-wrapped by prepare): the multi-process launcher plus
    ACCELERATE_USE_CPU, since `--cpu` and `--multi_gpu` are mutually exclusive flags."""
    lines = _launch("--multi_gpu", "--num_processes", "2", env={"ACCELERATE_USE_CPU": "1"})
    assert sorted(line.split(":")[0] for line in lines) == ["rank 0", "rank 1"], lines
    assert all("equal_to_eager=True" in line for line in lines), lines
