"""Tensor parallelism: a model transformers shards (tp_plan="auto", torchrun, gloo on CPU) runs under
fastflow, quantize() and optimize() with the greedy tokens of the whole model in one process
(quant/tensor_parallel.py). The ranks run in subprocesses (tests/distributed/tp_worker.py)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn

import ffl_backend
from ffl_backend.quant.tensor_parallel import ShardInfo, carry_hooks, check_int4_groups, localize
from tests.tiny_models import ARCHS, perturb_vectors, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed" / "tp_worker.py"
PROMPT = [5, 9, 17, 33, 62, 7]
NEW_TOKENS = 8
# transformers ships no tensor-parallel plan for GPT-2 (Conv1D layers): it cannot be loaded with tp_plan
TP_ARCHS = tuple(a for a in ARCHS if a != "gpt2")


def _folder(tmp_path: pathlib.Path, arch: str, intermediate: int = 128) -> str:
    """A tiny model whose MLP width splits into int4 groups of 32 on each of 2 ranks (64 each)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch)
    config.intermediate_size = intermediate
    torch.manual_seed(0)
    folder = tmp_path / arch
    perturb_vectors(AutoModelForCausalLM.from_config(config).eval()).save_pretrained(folder)
    return str(folder)


def _single_process(folder: str, quant: str | None) -> tuple[list, torch.Tensor]:
    """(greedy tokens, last-position logits of the prompt) of the whole model in this process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if quant is not None:
        ffl_backend.quantize(model, quant)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
        logits = model(torch.tensor([PROMPT])).logits[0, -1]
    return out[0, len(PROMPT):].tolist(), logits


def _run_ranks(folders: list, cases: list, out: pathlib.Path, ranks: int = 2) -> list[dict]:
    out.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(WORKER),
           "--folders", *folders, "--cases", *cases, "--prompt", *map(str, PROMPT), "--new-tokens", str(NEW_TOKENS),
           "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def _check(tmp_path, archs: list, cases: list) -> None:
    """Tokens equal the whole model's; "logits" cases (the localized model's, unquantized) match to fp32
    rounding, which tokens of a tiny model that repeats one token could not show. One launch for all."""
    folders = {arch: _folder(tmp_path, arch) for arch in archs}
    quants = {c.split(":")[1] for c in cases}
    expected = {(a, q): _single_process(f, None if q == "none" else q) for a, f in folders.items() for q in quants}
    for rank, results in enumerate(_run_ranks(list(folders.values()), cases, tmp_path / "out")):
        for arch, folder in folders.items():
            for case in cases:
                entry, quant = case.split(":")
                got, (tokens, logits) = results[f"{folder}|{case}"], expected[arch, quant]
                if entry == "logits":
                    torch.testing.assert_close(torch.tensor(got), logits, rtol=1e-4, atol=1e-4,
                                               msg=lambda m: f"{arch} {case} rank {rank}: {m}")
                else:
                    assert got == tokens, f"{arch} {case} rank {rank}: {got}"


@pytest.mark.slow  # measured cost and the fast set's budget: docs/testing.md
def test_llama_two_ranks_equal_one_process_under_every_entry_point(tmp_path):
    _check(tmp_path, ["llama"], ["logits:none", "eager:none", "compile:none", "model_compile:none",
                                 "optimize:none", "compile:int8", "optimize:int8", "optimize:int4"])


@pytest.mark.slow
def test_architectures_two_ranks_equal_one_process(tmp_path):
    _check(tmp_path, [a for a in TP_ARCHS if a != "llama"], ["logits:none", "compile:none", "optimize:int8",
                                                              "optimize:int4"])


def test_gpt2_has_no_plan_to_shard_with():
    """Why TP_ARCHS leaves GPT-2 out: transformers gives it no tensor-parallel plan to load with."""
    assert not getattr(tiny_config("gpt2"), "base_model_tp_plan", None)
    assert all(tiny_config(a).base_model_tp_plan for a in TP_ARCHS)


def test_a_group_size_that_cannot_divide_a_shard_is_named_before_any_work():
    linear = nn.Linear(48, 8)  # this rank's half of a 96-wide down_proj
    linear._ffl_tensor_parallel = ShardInfo("in", 2, 96)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj holds 48 of its 96 input features.*"
                                         r"no int4 group size divides it"):
        check_int4_groups("model.layers.0.mlp.down_proj", linear, None)
    linear64 = nn.Linear(96, 8)  # 192 over 2 ranks: 96 each
    linear64._ffl_tensor_parallel = ShardInfo("in", 2, 192)
    with pytest.raises(ValueError, match=r"group size 64 does not divide it; group_size=32 would"):
        check_int4_groups("o_proj", linear64, 64)
    check_int4_groups("o_proj", linear64, None)  # the default takes 32, which divides 96
    check_int4_groups("q_proj", nn.Linear(48, 8), None)  # not a shard: the usual high-precision fallback


def test_quantize_raises_before_touching_any_layer(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_folder(tmp_path, "llama", intermediate=192)).eval()
    down = model.model.layers[1].mlp.down_proj
    down.weight = nn.Parameter(down.weight.detach()[:, :96].clone())  # as localize leaves rank 0's half
    down.in_features = 96
    down._ffl_tensor_parallel = ShardInfo("in", 2, 192)
    with pytest.raises(ValueError, match="layers.1.mlp.down_proj holds 96 of its 192"):
        ffl_backend.quantize(model, {"scheme": "int4", "group_size": 64})
    assert not any(type(m).__name__.startswith("Int4") for m in model.modules())


def test_quantize_keeps_the_hooks_of_the_layers_it_replaces():
    model = nn.Sequential(nn.Linear(64, 32))
    calls = []
    model[0].register_forward_hook(lambda _m, _a, out: calls.append(out.shape) or out * 2)
    model[0].register_forward_pre_hook(lambda _m, args: calls.append("pre"))
    x = torch.randn(3, 64)
    expected = model(x)
    ffl_backend.quantize(model, {"scheme": "int8", "skip": ()})
    assert type(model[0]).__name__ == "Int8Linear"
    calls.clear()
    torch.testing.assert_close(model(x), expected, rtol=0.05, atol=0.05)
    assert calls == ["pre", torch.Size([3, 32])]


def test_localize_leaves_a_plain_model_alone():
    model = nn.Sequential(nn.Linear(4, 4))
    assert localize(model) is model and not hasattr(model[0], "_ffl_tensor_parallel")


def test_carry_hooks_copies_kwargs_flags():
    old, new = nn.Linear(2, 2), nn.Linear(2, 2)
    old.register_forward_pre_hook(lambda m, args, kwargs: (args, kwargs), with_kwargs=True)
    carry_hooks(old, new)
    assert len(new._forward_pre_hooks) == 1 and len(new._forward_pre_hooks_with_kwargs) == 1


def test_the_engine_refuses_a_split_model_with_the_reason():
    from ffl_backend.engine.engine import OptimizedInferenceEngine
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    model.model.layers[0].self_attn.o_proj._ffl_tensor_parallel = ShardInfo("in", 2, 64)
    with pytest.raises(NotImplementedError, match="lock-step"):
        OptimizedInferenceEngine(model, warmup=False)
