"""Checkpoints and config dicts written before the per-scheme configs (tests/data/pre_refactor_checkpoints,
its README: the commit and command) load with the current code and compute what they computed then."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ffl_backend
from ffl_backend.quant import register_with_transformers
from ffl_backend.quant.schemes import PRESETS, resolve, resolve_steps

DATA = Path(__file__).resolve().parents[1] / "data" / "pre_refactor_checkpoints"
REFERENCE = load_file(str(DATA / "reference.safetensors"))
DICTS = json.loads((DATA / "configs.json").read_text())
NAMES = sorted(k.removesuffix(".logits") for k in REFERENCE if k.endswith(".logits"))
# The same CPU vector ISA and torch as when the references were made, and the built-in kernel choices
# (FFL_AUTOTUNE=0, set by conftest.py): the same kernels run, so the logits must be bit-equal.
SAME_KERNELS = (DICTS["made_with"] == {"torch": torch.__version__,
                                       "cpu_capability": torch.backends.cpu.get_cpu_capability()})


def _maker():
    """make_checkpoints.py, for the model and inputs the references were made from."""
    spec = importlib.util.spec_from_file_location("make_checkpoints", DATA / "make_checkpoints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tolerance(expected: torch.Tensor) -> float:
    """0 where the same kernels run. Elsewhere another ISA picks other CPU kernels (fastflow's C++
    GEMV or torch's int8/int4 kernels), which round the activations to bf16 and sum in another
    order: two bf16 roundings (2 * 2^-8 relative) of the largest logit bound that. A misread format
    (wrong scale, group or zero point) moves logits by a large fraction of their size."""
    return 0.0 if SAME_KERNELS else 2 * 2.0 ** -8 * expected.abs().max().item()


def _load_with_from_pretrained(folder):
    from transformers import AutoModelForCausalLM

    register_with_transformers()
    return AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("load", [ffl_backend.load_quantized, _load_with_from_pretrained],
                         ids=["load_quantized", "from_pretrained"])
@pytest.mark.parametrize("name", NAMES)
def test_old_checkpoint_gives_its_reference_logits(name, load):
    model = load(DATA / name)
    expected = REFERENCE[f"{name}.logits"]
    with torch.no_grad():
        got = model(REFERENCE["input_ids"]).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=_tolerance(expected))


@pytest.mark.skipif(not SAME_KERNELS, reason="calibration and int4 grid fits sum in the ISA's order")
@pytest.mark.parametrize("name", NAMES)
def test_quantizing_with_the_saved_config_gives_the_saved_tensors(name):
    """The config dict each checkpoint carries, quantized with today's code, gives the same bytes."""
    maker = _maker()
    manifest = json.loads((DATA / name / "ffl_quant.json").read_text())
    dtype = getattr(torch, manifest["dtype"])
    model = ffl_backend.quantize(maker.tiny_llama(dtype), manifest["quant_config"], calibration_data=maker.CALIB)
    saved = load_file(str(DATA / name / "model.safetensors"))
    state = model.state_dict()
    for key, tensor in saved.items():
        assert torch.equal(state[key], tensor), key


def _same_meaning(old: dict, new: dict) -> None:
    """`new` (today's to_dict) keeps every value `old` gave its fields; the fields it dropped held
    the values that meant "not used" for this scheme."""
    unused = {"group_size": None, "symmetric": None, "grid": None, "static": False, "static_range_limit": 8.0,
              "smoothquant_alpha": None, "algorithm": "rtn", "clip_search": False, "min_output_sqnr": None}
    assert {k: old[k] for k in new} == new
    assert {k: old[k] for k in old if k not in new} == {k: unused[k] for k in old if k not in new}


@pytest.mark.parametrize("label", sorted(DICTS["configs"]))
def test_old_config_dicts_resolve_to_the_same_config(label):
    old = DICTS["configs"][label]
    config = resolve(old)
    _same_meaning(old, config.to_dict())
    assert ffl_backend.QuantConfig.from_dict(old) == config == resolve(config.to_dict())


@pytest.mark.parametrize("name", sorted(DICTS["names"]))
def test_scheme_and_preset_names_mean_what_they_meant(name):
    _same_meaning(DICTS["names"][name], resolve(name).to_dict())


def test_presets_have_the_same_steps():
    assert sorted(DICTS["presets"]) == sorted(PRESETS)
    for preset, old_steps in DICTS["presets"].items():
        steps = resolve_steps(preset)
        assert len(steps) == len(old_steps)
        for old, step in zip(old_steps, steps):
            _same_meaning(old, step.to_dict())
