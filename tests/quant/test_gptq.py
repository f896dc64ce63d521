"""GPTQ (quant/gptq.py): lower output error than round-to-nearest on correlated inputs, on exactly
RTN's grid and storage layout, and wired into quantize / save / load with clear errors."""
import copy

import pytest
import torch
from torch import nn

import ffl_backend
from ffl_backend import numerics as P
from ffl_backend.quant import gptq as G
from ffl_backend.quant import handlers as H
from ffl_backend.quant import modules as M
from ffl_backend.quant.quantizer import quantized_modules
from tests.tiny_models import tiny_model

N, K, GROUP, TOKENS = 24, 96, 32, 256


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _layer(dtype):
    """A linear and correlated inputs with uneven channel scales: what GPTQ's error feedback exploits."""
    torch.manual_seed(0)
    mix = torch.randn(K, K) / K ** 0.5
    x = (torch.randn(TOKENS, K) @ mix) * torch.linspace(0.2, 3.0, K)
    return nn.Linear(K, N, bias=True).to(dtype), x.to(dtype)


def _output_error(linear, x, w):
    """Mean squared output error of weight `w` against the layer's exact (float64) output on x."""
    exact = x.double() @ linear.weight.double().T
    return (x.double() @ w.double().T - exact).pow(2).mean().item()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("symmetric", (False, True))
def test_gptq_beats_rtn_in_the_int4_layout(dtype, symmetric):
    linear, x = _layer(dtype)
    cfg = ffl_backend.QuantConfig("int4", group_size=GROUP, symmetric=symmetric)
    (codes, scale, zero), w_hat = H.gptq_weight(linear, G.hessian(x), cfg)
    assert codes.dtype == torch.uint8 and codes.shape == (N, K) and int(codes.max()) <= 15
    assert scale.shape == zero.shape == (N, K // GROUP) and scale.dtype == zero.dtype == dtype
    if symmetric:
        assert torch.all(zero == 8)
    rtn = P.dequantize_int4(P.pack_int4(P.quantize_int4(linear.weight, GROUP, symmetric)[0]),
                            *P.quantize_int4(linear.weight, GROUP, symmetric)[1:], GROUP)
    # measured ratio ~0.70-0.77 (fp32 and bf16); RTN's own error would give 1.0
    assert _output_error(linear, x, w_hat) < 0.85 * _output_error(linear, x, rtn)
    # the stored layout dequantizes to exactly the weight GPTQ optimised, and the module uses it
    module = M.Int4Linear.from_linear(linear, cfg, quantized=(codes, scale, zero))
    deq = P.dequantize_int4(module.portable_qweight(), module.scale, module.zero, GROUP)
    assert torch.equal(deq, w_hat) and torch.equal(module.dequantized_weight(), w_hat)
    ref = nn.functional.linear(x.float(), deq, linear.bias.float()).to(dtype)
    torch.testing.assert_close(module(x), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("symmetric", (False, True))
def test_uncorrelated_inputs_give_exactly_rtn(symmetric):
    """With H = I no error is fed forward: GPTQ must then be round-to-nearest, code for code, which
    pins down that both share one grid (scale and zero rounded to bf16 the same way)."""
    linear, _ = _layer(torch.bfloat16)
    cfg = ffl_backend.QuantConfig("int4", group_size=GROUP, symmetric=symmetric)
    (codes, scale, zero), _ = H.gptq_weight(linear, torch.eye(K), cfg)
    for got, want in zip((codes, scale, zero), P.quantize_int4(linear.weight, GROUP, symmetric)):
        assert torch.equal(got, want)


def test_lazy_block_updates_match_one_block(monkeypatch):
    """Deferring updates to block ends is exact algebra: blocks of 32 columns (3 here) must give
    what one 128-column block gives, up to float reassociation."""
    linear, x = _layer(torch.float32)
    cfg = ffl_backend.QuantConfig("int4", group_size=GROUP)
    (codes, _, _), w_hat = H.gptq_weight(linear, G.hessian(x), cfg)
    monkeypatch.setattr(G, "BLOCK", GROUP)
    (codes_b, _, _), w_hat_b = H.gptq_weight(linear, G.hessian(x), cfg)
    assert (codes_b != codes).float().mean() < 0.01
    assert _output_error(linear, x, w_hat_b) < 1.02 * _output_error(linear, x, w_hat)


def test_group_grid_comes_from_the_error_updated_weights():
    linear, x = _layer(torch.float32)
    seen = []
    rtn = G.int4_grid(GROUP, False, torch.float32)
    grid = G.Grid(GROUP, 0, 15, lambda wg: seen.append(wg.clone()) or rtn.params(wg), torch.uint8)
    G.gptq(linear.weight, G.hessian(x), grid)
    assert len(seen) == K // GROUP
    assert torch.equal(seen[0], linear.weight[:, :GROUP])  # nothing rounded before the first group
    assert not torch.allclose(seen[1], linear.weight[:, GROUP:2 * GROUP])  # earlier errors fed in


def test_int8_gptq_keeps_rtn_scales_and_lowers_error():
    linear, x = _layer(torch.float32)
    (q, scale), w_hat = H.gptq_weight(linear, G.hessian(x), ffl_backend.QuantConfig("int8"))
    q_rtn, s_rtn = P.quantize_int8(linear.weight)
    assert q.dtype == torch.int8 and torch.equal(scale, s_rtn) and int(q.abs().max()) <= 127
    assert torch.equal(P.dequantize_int8(q, scale), w_hat)
    assert _output_error(linear, x, w_hat) < 0.85 * _output_error(linear, x, P.dequantize_int8(q_rtn, s_rtn))


def test_padding_rows_are_left_out_of_the_hessian():
    x = torch.randn(2, 5, K)
    valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    rows = torch.cat([x[0], x[1, :3]])
    torch.testing.assert_close(G.hessian(x, valid), rows.T @ rows / 8)


def test_quantize_with_gptq_end_to_end(llama, tmp_path):
    torch.manual_seed(1)
    calib = [torch.randint(3, 128, (1, 48)), torch.randint(3, 128, (2, 31))]  # ragged: padded into one batch
    ids = torch.randint(3, 128, (2, 16))
    cfg = ffl_backend.QuantConfig("int4", group_size=32, algorithm="gptq")
    model = ffl_backend.quantize(copy.deepcopy(llama), cfg, calibration_data=calib)
    swapped = quantized_modules(model)
    assert len(swapped) == 7 * llama.config.num_hidden_layers
    assert all(isinstance(m, M.Int4Linear) for m in swapped.values())
    assert not any(m._forward_hooks for m in model.modules())  # calibration hooks removed
    assert P.sqnr(llama(ids).logits, model(ids).logits) > 15.0  # the int4 RTN floor in test_quantize
    rtn = ffl_backend.quantize(copy.deepcopy(llama), ffl_backend.QuantConfig("int4", group_size=32))
    rtn_modules = quantized_modules(rtn)
    assert any(not torch.equal(m.portable_qweight(), rtn_modules[n].portable_qweight()) for n, m in swapped.items())
    ffl_backend.quant.save_quantized(model, tmp_path)  # same layout: save/load need no GPTQ knowledge
    loaded = ffl_backend.load_quantized(tmp_path)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_int8_gptq_through_quantize(llama):
    ids = torch.randint(3, 128, (2, 16))
    cfg = ffl_backend.QuantConfig("int8", algorithm="gptq")
    model = ffl_backend.quantize(copy.deepcopy(llama), cfg, calibration_data=[torch.randint(3, 128, (2, 32))])
    assert all(isinstance(m, M.Int8Linear) for m in quantized_modules(model).values())
    assert P.sqnr(llama(ids).logits, model(ids).logits) > 38.0  # the int8 RTN floor in test_quantize


def test_sequential_and_parallel_calibration_differ_and_leave_weights_alone(llama):
    model = copy.deepcopy(llama)
    targets = {n: m for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"}
    before = {n: m.weight.clone() for n, m in targets.items()}
    calib = [torch.randint(3, 128, (2, 32))]
    cfg = ffl_backend.QuantConfig("int4", group_size=32, algorithm="gptq")
    seq = H.gptq_layers(model, targets, cfg, calib)
    par = H.gptq_layers(model, targets, cfg, calib, sequential=False)
    assert all(torch.equal(m.weight, before[n]) for n, m in targets.items())
    first, last = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"
    assert torch.equal(seq[first]["quantized"][0], par[first]["quantized"][0])  # same input to the first layer
    assert not torch.equal(seq[last]["quantized"][0], par[last]["quantized"][0])  # inputs through quantized layers


def test_gptq_needs_calibration_data(llama):
    with pytest.raises(ValueError, match="algorithm='gptq' needs calibration_data"):
        ffl_backend.quantize(copy.deepcopy(llama), ffl_backend.QuantConfig("int4", algorithm="gptq"))


def test_gptq_config_errors():
    for kwargs in (dict(scheme="w8a8", algorithm="gptq"), dict(scheme="fp8", algorithm="gptq"),
                   dict(scheme="int4", algorithm="awq")):
        with pytest.raises(ValueError, match="algorithm"):
            ffl_backend.QuantConfig(**kwargs)
    cfg = ffl_backend.QuantConfig("int4", algorithm="gptq")
    assert cfg.needs_calibration and not ffl_backend.QuantConfig("int4").needs_calibration
    assert ffl_backend.quant.resolve(cfg.to_dict()) == cfg
