"""`ffl_backend.optimize` end to end: SmolLM2-135M greedy tokens equal eager, one decode graph for
every prompt length, pipelines, and the Accelerate recipe (examples/accelerate_generate.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ffl_backend
from ffl_backend.bench.agreement import NEW_TOKENS as AGREE_NEW
from ffl_backend.bench.agreement import PROMPTS as AGREE_PROMPTS
from ffl_backend.bench.agreement import first_divergence, greedy_rows, reference_rows
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


# Greedy tokens of optimize()'s bf16 SmolLM2 against bf16 eager (HF defaults), AGREE_NEW new tokens
# after each of AGREE_PROMPTS. bf16 weights ("bf16", and with an int8 KV cache "kv-int8"): each row may
# leave eager's path only where eager's own top-2 logits are closer than the variant's error can move
# them -- TIE_TOLERANCE, relative to the logit: bf16 rounds each logit by half a unit in the last of its
# 8 bits (2**-9 relative), two of them and a differently ordered sum of the same bf16 products round to
# 2**-7; an int8 KV cache adds its rounding step, half of 1/127 of each row's largest value, to every K
# and V element, allowed once per side (2/127). A different CPU picks different kernels and so a
# different side of a tie, which a count of agreeing tokens would fail on. Quantized weights move logits
# by more than their rounding alone explains: how often they agree is a measurement
# (benchmarks/greedy_agreement.py), not a test. Compiled in mode "default": the kernels and numerics of
# optimize()'s "reduce-overhead" (which adds the C++ wrapper only), ~15 s less compile per model.
TIE_TOLERANCE = {"bf16": 2 ** -7, "kv-int8": 2 ** -7 + 2 / 127}


@pytest.fixture(scope="module")
def bf16_eager():
    """(prompt ids, bf16 eager greedy tokens per prompt, eager's logits at each new token's position):
    unpatched SmolLM2 with HF's defaults."""
    return reference_rows(*ffl_backend.load_smollm2(torch.bfloat16), AGREE_PROMPTS, AGREE_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(TIE_TOLERANCE))
def test_smollm2_bf16_greedy_leaves_eager_only_at_ties(bf16_eager, variant):
    rows, eager, eager_logits = bf16_eager
    model, _ = ffl_backend.load_smollm2(torch.bfloat16)
    with NoFallbacks():
        kv = variant[3:] if variant.startswith("kv-") else None  # bf16 weights, a quantized KV cache
        ffl_backend.optimize(model, max_seq_len=64, mode="default", kv_cache_dtype=kv,
                             quant=None)
        fast = greedy_rows(model, rows, AGREE_NEW)
    same = sum(int((a == b).sum()) for a, b in zip(fast, eager))
    agreement = same / (AGREE_NEW * len(rows))
    prefixes = [first_divergence(f, e) for f, e in zip(fast, eager)]
    print(f"\nSmolLM2 {variant} vs bf16 eager: agreement {agreement:.2f} ({same}/{AGREE_NEW * len(rows)}); "
          f"first divergence {prefixes}")
    for row, (i, f, e, logits) in enumerate(zip(prefixes, fast, eager, eager_logits)):
        if i == AGREE_NEW:
            continue
        top = logits[i, e[i]]
        gap = float(top - logits[i, f[i]])
        assert gap <= TIE_TOLERANCE[variant] * abs(float(top)), (
            f"row {row} left eager's path at token {i} ({int(f[i])} for {int(e[i])}) where eager's logits "
            f"differ by {gap:.3f} of {float(top):.2f}: more than {variant}'s error explains")


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
