"""Fitted int4 grids (quant/int4_fit.py): never worse than [min, max] by their weighted error, the
stored layout unchanged, importance from calibration data, and QuantConfig.grid choosing between them."""
import pytest
import torch
from torch import nn

import ffl_backend
from ffl_backend import numerics as P
from ffl_backend.kernels import cpu_quantize
from ffl_backend.quant.calibration import input_mean_squares
from ffl_backend.quant.int4_fit import quantize_int4_fitted
from ffl_backend.quant.modules import Int4Linear
from ffl_backend.quant.schemes import QuantConfig
from tests.tiny_models import tiny_model


def _weight(n, k, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen, dtype=torch.float64)
    w[:, :: max(1, k // 7)] *= 6.0  # a few outlier channels, as real layers have
    return w.to(dtype)


def _group_errors(w, q, scale, zero, group, weight):
    deq = P.dequantize_int4(P.pack_int4(q), scale, zero, group, torch.float64)
    err = weight * (deq - w.double()).square()
    return err.reshape(w.shape[0], -1, group).sum(-1)


@pytest.mark.parametrize("n,k,group", [(5, 96, 32), (17, 128, 64), (3, 256, 128)])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fitted_grid_is_never_worse_than_min_max(n, k, group, symmetric, dtype):
    w = _weight(n, k, seed=n + k, dtype=dtype)
    importance = torch.rand(k, generator=torch.Generator().manual_seed(k), dtype=torch.float64) * 4
    fitted = quantize_int4_fitted(w, group, symmetric, importance=importance.float())
    minmax = P.quantize_int4(w, group, symmetric)
    weight = importance[None].expand(n, k)
    got, base = _group_errors(w, *fitted, group, weight), _group_errors(w, *minmax, group, weight)
    # the candidates are compared in fp32; float64 here may disagree by rounding on near-ties
    assert (got <= base * (1 + 1e-5) + 1e-12).all()
    assert got.sum() < 0.95 * base.sum()  # and the search finds clearly better grids overall
    codes, scale, zero = fitted
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert scale.dtype == zero.dtype == dtype and (scale > 0).all()
    if symmetric:
        assert (zero == 8).all()


def test_codes_are_on_the_stored_grid():
    """Dequantizing the stored scale and zero reproduces the reconstruction the fit measured: the codes
    are round(w / scale + zero) of exactly the stored values (numerics.int4_codes)."""
    w = _weight(9, 64, dtype=torch.bfloat16)
    q, scale, zero = quantize_int4_fitted(w, 32)
    g = w.float().reshape(9, 2, 32)
    assert torch.equal(q.reshape(9, 2, 32), P.int4_codes(g, scale.float()[..., None], zero.float()[..., None]))


def test_importance_moves_error_off_the_important_channels():
    w = _weight(32, 64, seed=3)
    importance = torch.ones(64)
    importance[5] = 1000.0
    plain_q = quantize_int4_fitted(w, 32, importance=torch.ones(64))
    weighted_q = quantize_int4_fitted(w, 32, importance=importance)
    plain = P.dequantize_int4(P.pack_int4(plain_q[0]), *plain_q[1:], 32)
    weighted = P.dequantize_int4(P.pack_int4(weighted_q[0]), *weighted_q[1:], 32)
    assert (weighted[:, 5] - w[:, 5]).abs().mean() < 0.5 * (plain[:, 5] - w[:, 5]).abs().mean()


def test_degenerate_groups_stay_finite():
    w = torch.zeros(4, 64)
    w[1, :32] = 0.25  # one constant group, one all-zero group per row
    importance = torch.zeros(64)  # dead channels
    q, scale, zero = quantize_int4_fitted(w, 32, importance=importance)
    assert torch.isfinite(scale).all() and torch.isfinite(zero).all()
    torch.testing.assert_close(P.dequantize_int4(P.pack_int4(q), scale, zero, 32), w, atol=1e-6, rtol=0)


def test_row_blocks_do_not_change_the_result(monkeypatch):
    """The pure-torch reference works in row blocks (the C++ op in groups: tests/kernels/test_cpu_quantize.py)."""
    w = _weight(37, 96, seed=11)
    whole = cpu_quantize.quantize_int4_fitted_ref(w, 32)
    monkeypatch.setattr(cpu_quantize, "BLOCK_ELEMENTS", 96 * 5)  # 5 rows per block, a ragged last block
    for got, want in zip(cpu_quantize.quantize_int4_fitted_ref(w, 32), whole):
        assert torch.equal(got, want)


def test_grid_option_is_validated():
    with pytest.raises(ValueError, match="grid applies to the int4 scheme only"):
        QuantConfig(scheme="int8", grid="minmax")
    with pytest.raises(ValueError, match="one of"):
        QuantConfig(scheme="int4", grid="mse")
    assert QuantConfig(scheme="int4").fits_grid
    assert not QuantConfig(scheme="int4", grid="minmax").fits_grid
    assert not QuantConfig(scheme="int4", algorithm="gptq").fits_grid


def test_minmax_grid_is_plain_round_to_nearest_and_fit_is_the_default():
    linear = nn.Linear(64, 24, bias=False)
    minmax = Int4Linear.from_linear(linear, QuantConfig(scheme="int4", grid="minmax", group_size=32))
    q, scale, zero = P.quantize_int4(linear.weight.detach(), 32)
    assert torch.equal(minmax.scale, scale) and torch.equal(minmax.zero, zero)
    fitted = Int4Linear.from_linear(linear, QuantConfig(scheme="int4", group_size=32))
    w = linear.weight.detach()
    err = {name: (m.dequantized_weight() - w).square().sum() for name, m in (("fit", fitted), ("minmax", minmax))}
    assert err["fit"] < err["minmax"]


def test_input_mean_squares_match_the_inputs_each_linear_sees():
    model = tiny_model("llama")
    calib = [torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))]
    name = "model.layers.0.mlp.down_proj"
    seen = []
    handle = model.get_submodule(name).register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    got = input_mean_squares(model, [name], calib)[name]
    handle.remove()
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen]).double()
    torch.testing.assert_close(got, x.square().mean(0).float())


def test_quantize_weighs_the_fit_with_calibration_data():
    """With calibration data, int4 grids follow the inputs: the layer's output error on those inputs
    is lower than when fitted by the weights alone."""
    base = tiny_model("llama")  # seeded: every tiny_model("llama") has these weights
    calib = [torch.randint(3, 100, (1, 32), generator=torch.Generator().manual_seed(2))]
    name = "model.layers.1.mlp.down_proj"
    linear = base.get_submodule(name)
    x = []
    handle = linear.register_forward_pre_hook(lambda _m, args: x.append(args[0].reshape(-1, args[0].shape[-1])))
    base(input_ids=calib[0])
    handle.remove()
    exact = linear(x[0])
    errors = {}
    for label, data in (("weights", None), ("calibration", calib)):
        model = ffl_backend.quantize(tiny_model("llama"), QuantConfig(scheme="int4", group_size=32),
                                     calibration_data=data)
        errors[label] = (model.get_submodule(name)(x[0]) - exact).square().sum().item()
    assert errors["calibration"] < errors["weights"]
