"""A quantization scheme of one's own, registered from outside the library (quant/handlers.py).

"int8-toy" rounds each weight row to a coarse symmetric grid of `levels` steps and multiplies by the
dequantized weight with F.linear. Its config, module, handler and registration all live in this file:
no library module knows of it, yet QuantConfig, quantize, the per-layer report, the CLIs' options and
save/load take it. A real scheme puts the same pieces in the files docs/extending.md lists.
"""
import copy
import dataclasses

import pytest
import torch
from torch import nn

import ffl_backend
from ffl_backend.quant import QuantConfig, SchemeHandler, register_scheme, save_quantized, unregister_scheme
from ffl_backend.quant.modules import QuantizedLinear
from ffl_backend.quant.quantizer import quantized_modules
from tests.tiny_models import tiny_model

TOY = "int8-toy"


@dataclasses.dataclass(frozen=True)
class ToyConfig(QuantConfig):
    """levels  grid steps on each side of zero, per output row (1..127)."""

    scheme = TOY
    cli_options = (("--toy-levels", "levels", dict(type=int, default=15, help="int8-toy: grid steps per side")),)

    levels: int = 15

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.levels <= 127:
            raise ValueError(f"int8-toy levels must be in 1..127, got {self.levels}")


def toy_round(w: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8, scale (N,) fp32): w ~ codes * scale, |codes| <= levels."""
    scale = w.detach().float().abs().amax(1).clamp_min(1e-8) / levels
    return torch.round(w.detach().float() / scale[:, None]).clamp(-levels, levels).to(torch.int8), scale


class ToyLinear(QuantizedLinear):
    scheme = TOY

    def __init__(self, in_features, out_features, dtype, has_bias, device=None):
        super().__init__(in_features, out_features, dtype, has_bias, device)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.empty(out_features, dtype=torch.float32, device=device))

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: ToyConfig) -> "ToyLinear":
        m = cls(linear.in_features, linear.out_features, linear.weight.dtype, linear.bias is not None)
        m.qweight, m.scale = toy_round(linear.weight, config.levels)
        m._set_bias(linear)
        return m

    def dequantized_weight(self):
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x):
        return nn.functional.linear(x, self.dequantized_weight().to(x.dtype), self.bias)


@pytest.fixture
def toy():
    register_scheme(ToyConfig, SchemeHandler(ToyLinear))
    yield
    unregister_scheme(TOY)


def _reference(model: nn.Module, levels: int) -> nn.Module:
    """`model` with every linear quantize selects by default holding its toy-rounded weight."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, m in ref.named_modules():
            if type(m) is nn.Linear and ToyConfig().selects(name):
                q, scale = toy_round(m.weight, levels)
                m.weight.copy_(q.float() * scale[:, None])
    return ref


def test_config_factory_builds_the_registered_config(toy):
    assert QuantConfig(TOY, levels=7) == ToyConfig(levels=7)
    assert QuantConfig.from_dict(ToyConfig(levels=3).to_dict()) == ToyConfig(levels=3)
    assert ffl_backend.quant.resolve(TOY) == ToyConfig()
    with pytest.raises(ValueError, match="levels must be in 1..127"):
        QuantConfig(TOY, levels=0)
    with pytest.raises(ValueError, match="group_size applies to the int4 scheme only, not int8-toy"):
        QuantConfig(TOY, group_size=32)
    with pytest.raises(ValueError, match="levels applies to the int8-toy scheme only, not int4"):
        QuantConfig("int4", levels=7)


@pytest.mark.parametrize("config", [TOY, ToyConfig(levels=7)], ids=["name", "config"])
def test_quantize_takes_the_toy_scheme(toy, config):
    model = tiny_model("llama")
    levels = ffl_backend.quant.resolve(config).levels
    expected_model = _reference(model, levels)
    quantized = ffl_backend.quantize(model, config)
    modules = quantized_modules(quantized)
    assert len(modules) == 7 * quantized.config.num_hidden_layers
    assert all(type(m) is ToyLinear for m in modules.values())
    assert int(max(m.qweight.abs().max() for m in modules.values())) == levels
    ids = torch.randint(3, 128, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(quantized(ids).logits, expected_model(ids).logits, rtol=0, atol=0)
    assert quantized._ffl_quant["config"] == ffl_backend.quant.resolve(config).to_dict()


def test_report_save_and_load_need_no_toy_code(toy, tmp_path):
    llama = tiny_model("llama")
    calib = [torch.randint(3, 128, (1, 24))]
    rep = ffl_backend.quant.report(llama, TOY, calib)
    assert len(rep["layers"]) == 7 * llama.config.num_hidden_layers and rep["config"]["scheme"] == TOY
    model = ffl_backend.quantize(llama, ToyConfig(levels=5))
    save_quantized(model, tmp_path)
    loaded = ffl_backend.load_quantized(tmp_path)
    assert all(type(m) is ToyLinear for m in quantized_modules(loaded).values())
    ids = torch.randint(3, 128, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    unregister_scheme(TOY)
    with pytest.raises(ValueError, match="no handler for quantization scheme 'int8-toy'"):
        ffl_backend.load_quantized(tmp_path)


def test_cli_options_come_from_the_registered_config(toy):
    import argparse

    from ffl_backend.quant import cli

    parser = argparse.ArgumentParser()
    cli._common(parser)
    args = parser.parse_args(["--text", "t.txt", "--toy-levels", "9", "--skip", "*.down_proj"])
    assert cli._config(args, TOY) == ToyConfig(levels=9, skip=(*ffl_backend.quant.schemes.DEFAULT_SKIP, "*.down_proj"))


def test_unknown_scheme_lists_the_registered_ones(toy):
    for call in (lambda: QuantConfig("int9"), lambda: ffl_backend.quantize(tiny_model("llama"), "int9")):
        with pytest.raises(ValueError, match=r"unknown quantization scheme 'int9'; registered: \(.*'int8-toy'"):
            call()
    unregister_scheme(TOY)
    with pytest.raises(ValueError, match="unknown quantization scheme 'int8-toy'") as info:
        QuantConfig(TOY)
    assert "'int8', 'int4', 'w8a8', 'fp8'" in str(info.value)


def test_registering_a_scheme_twice_needs_replace(toy):
    with pytest.raises(ValueError, match="already registered"):
        register_scheme(ToyConfig, SchemeHandler(ToyLinear))

    @dataclasses.dataclass(frozen=True)
    class Other(ToyConfig):
        pass

    register_scheme(Other, SchemeHandler(ToyLinear), replace=True)
    assert type(QuantConfig(TOY)) is Other
