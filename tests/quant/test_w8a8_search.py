"""w8a8 calibration by measured error (quant/w8a8_search.py): clip and alpha search, min_output_sqnr."""
import copy
import logging

import pytest
import torch
from torch import nn

import ffl_backend
from ffl_backend import numerics as P
from ffl_backend.quant import calibration, report
from ffl_backend.quant import w8a8_search as S
from ffl_backend.quant.modules import W8A8Linear
from ffl_backend.quant.quantizer import quantized_modules
from ffl_backend.quant.schemes import QuantConfig
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _calib(n=2, length=32):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (1, length), generator=g) for _ in range(n)]


def _held_out_error(x, linear, alpha, clip, static=True):
    """The search's measure, rebuilt from the public pieces: each half of x quantized with s and
    the static scale fitted on the other half (W8A8Linear, own smoothing), token-balanced error."""
    noise = signal = 0.0
    halves = (x[: len(x) // 2], x[len(x) // 2:])
    for fit, held in (halves, halves[::-1]):
        fit_absmax = fit.abs().amax(dim=0)
        lin = copy.deepcopy(linear)
        smooth = None
        if alpha is not None:
            s = calibration.smoothing_factors(fit_absmax, [lin.weight], alpha)
            lin.weight.data.mul_(s)
            fit_absmax, smooth = fit_absmax / s, 1.0 / s
        m = W8A8Linear.from_linear(lin, None, x_absmax=clip * fit_absmax.max().item() if static else None,
                                   smooth=smooth)
        ref = held @ linear.weight.T
        w = 1.0 / (ref.pow(2).sum(1) + ref.pow(2).sum(1).mean())
        noise += ((m(held) - ref).pow(2).sum(1) * w).sum().item()
        signal += (ref.pow(2).sum(1) * w).sum().item()
    return noise / signal


def _outlier_layer(outlier_channel=3, outlier_tokens=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 64, generator=g)
    x[:, outlier_channel] *= 40.0  # an outlier channel: what SmoothQuant is for
    for t in outlier_tokens:  # rare huge tokens (attention sinks): what clipping is for
        x[t] *= 12.0
    linear = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=g) * 0.1)
    return x, linear


@torch.no_grad()
def test_clip_search_never_worse_than_absmax_and_matches_the_module():
    for seed, tokens in ((0, (5, 200)), (1, ()), (2, (17, 130, 131))):
        x, linear = _outlier_layer(outlier_tokens=tokens, seed=seed)
        _, absmax_only = S.search_group(x, {"l": linear}, False, {"l"}, (0.5,), (1.0,))
        _, searched = S.search_group(x, {"l": linear}, False, {"l"}, (0.5,), S.CLIP_GRID)
        clip, err = searched["l"]
        assert err <= absmax_only["l"][1]
        # the reported error is what the real module does with that scale on held-out rows
        assert err == pytest.approx(_held_out_error(x, linear, 0.5, clip), rel=1e-3)
        best = min(_held_out_error(x, linear, 0.5, c) for c in S.CLIP_GRID)
        assert err == pytest.approx(best, rel=1e-3)
    # unsmoothed, with a 12x token in each half: clipping pays (the search picks 0.6)
    x, linear = _outlier_layer(outlier_tokens=(5, 200))
    assert S.search_group(x, {"l": linear}, False, {"l"}, (None,), S.CLIP_GRID)[1]["l"][0] < 1.0


@torch.no_grad()
def test_alpha_search_picks_the_best_grid_point():
    x, linear = _outlier_layer()
    for static in (True, False):
        alpha, per_layer = S.search_group(x, {"l": linear}, False, {"l"} if static else set(), S.ALPHA_GRID, (1.0,))
        errors = {a: _held_out_error(x, linear, a, 1.0, static) for a in S.ALPHA_GRID}
        assert alpha == min(errors, key=errors.get)
        assert per_layer["l"][1] == pytest.approx(errors[alpha], rel=1e-3)
        # smoothing the outlier channel beats none by a wide margin
        assert per_layer["l"][1] < 0.1 * _held_out_error(x, linear, None, 1.0, static)


def _with_outlier_input(model, layer=0, channel=5, factor=1000.0):
    """Same function, but layer `layer`'s q/k/v input gets a 1000x channel: the norm's weight is
    scaled up and the q/k/v columns down. Per-token int8 of that input leaves the other channels
    about zero levels, so without smoothing these three layers are hopeless."""
    model = copy.deepcopy(model)
    block = model.model.layers[layer]
    with torch.no_grad():
        block.input_layernorm.weight[channel] *= factor
        for proj in (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj):
            proj.weight[:, channel] /= factor
    return model


def test_min_output_sqnr_keeps_a_bad_layer_in_high_precision(llama, caplog):
    bad = _with_outlier_input(llama)
    ids = torch.randint(3, 128, (2, 16))
    assert P.sqnr(llama(ids).logits, bad(ids).logits) > 60.0  # the same model
    with caplog.at_level(logging.WARNING, logger="ffl_backend"):
        model = ffl_backend.quantize(copy.deepcopy(bad), QuantConfig("w8a8", min_output_sqnr=20.0),
                                     calibration_data=_calib())
    names = {f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")}
    kept = model._ffl_quant["kept"]
    assert names <= set(kept) and len(quantized_modules(model)) == 14 - len(kept)
    assert all("min_output_sqnr 20 dB" in kept[n] and "output SQNR" in kept[n] for n in names)
    assert all(type(model.get_submodule(n)) is nn.Linear for n in names)
    assert "keeping" in caplog.text and "min_output_sqnr" in caplog.text
    assert P.sqnr(llama(ids).logits, model(ids).logits) > 25.0
    plain = ffl_backend.quantize(copy.deepcopy(bad), "w8a8")
    assert P.sqnr(llama(ids).logits, plain(ids).logits) < 15.0  # what keeping them avoided


def test_min_output_sqnr_agrees_with_the_report_and_keeps_smoothing_exact(llama):
    """Half the layers kept, in folded (q/k/v, gate/up) and unfolded (o_proj, down_proj) groups:
    kept layers in a folded group must take W * s, those in an unfolded group must not."""
    ids = torch.randint(3, 128, (2, 16))
    cfg = dict(scheme="w8a8", static=True, smoothquant_alpha="auto", clip_search=True)
    rep = report(llama, QuantConfig(min_output_sqnr=0.0, **cfg), _calib())
    sqnrs = sorted(r["searched_sqnr_db"] for r in rep["layers"])
    threshold = (sqnrs[6] + sqnrs[7]) / 2
    model = ffl_backend.quantize(copy.deepcopy(llama), QuantConfig(min_output_sqnr=threshold, **cfg),
                                 calibration_data=_calib())
    below = {r["name"] for r in rep["layers"] if r["searched_sqnr_db"] < threshold}
    assert set(model._ffl_quant["kept"]) == below and len(below) == 7
    assert P.sqnr(llama(ids).logits, model(ids).logits) > 25.0
    everything = ffl_backend.quantize(copy.deepcopy(llama), QuantConfig(min_output_sqnr=1e9, **cfg),
                                      calibration_data=_calib())
    assert not quantized_modules(everything)  # all kept: nothing smoothed either, the model is unchanged
    assert torch.equal(llama(ids).logits, everything(ids).logits)


@torch.no_grad()
def test_smooth_leaves_kept_layers_of_an_unfolded_group_alone():
    """No norm to fold into: each quantized layer scales its own input by 1/s, so a layer kept in
    high precision reads X unscaled and must keep W unscaled."""
    torch.manual_seed(0)
    a, b = nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)
    wa, wb = a.weight.clone(), b.weight.clone()
    absmax = {"a": torch.rand(8) * 10 + 0.5}
    absmax["b"] = absmax["a"].clone()
    own = calibration.smooth({"a": a, "b": b}, [calibration.InputGroup(["a", "b"])], absmax, 0.5, keep={"b"})
    assert set(own) == {"a"} and torch.equal(b.weight, wb) and not torch.equal(a.weight, wa)
    x = torch.randn(3, 8)
    torch.testing.assert_close((x * own["a"]) @ a.weight.T, x @ wa.T)
    torch.testing.assert_close(absmax["b"], absmax["a"] * calibration.smoothing_factors(absmax["b"], [wa, wb], 0.5))


def test_searched_model_is_all_static_and_close(llama):
    calib = _calib(4)
    base = ffl_backend.quantize(copy.deepcopy(llama), QuantConfig("w8a8", static=True, smoothquant_alpha=0.8),
                                calibration_data=calib)
    searched = ffl_backend.quantize(copy.deepcopy(llama), QuantConfig(
        "w8a8", static=True, smoothquant_alpha="auto", clip_search=True), calibration_data=calib)
    assert all(m.x_scale is not None for m in quantized_modules(searched).values())
    ids = torch.cat(calib)
    assert P.sqnr(llama(ids).logits, searched(ids).logits) > 25.0
    assert P.sqnr(llama(ids).logits, base(ids).logits) > 25.0


def test_capture_in_several_passes_matches_one(llama, monkeypatch):
    targets = {n: m for n, m in llama.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    _, _, groups = calibration.collect(llama, list(targets), _calib())
    one = {g.names[0]: x for g, x in S.captured_inputs(llama, groups, _calib())}
    monkeypatch.setattr(S, "CAPTURE_BYTES", 1)  # one group per pass
    monkeypatch.setattr(S, "MAX_ROWS", 40)
    several = {g.names[0]: x for g, x in S.captured_inputs(llama, groups, _calib())}
    assert len(one) == len(several) == 8
    assert all(several[n].shape[0] == 40 and torch.equal(several[n], one[n][:40]) for n in one)


def test_dynamic_smoothquant_stays_dynamic(llama):
    model = ffl_backend.quantize(copy.deepcopy(llama), QuantConfig("w8a8", smoothquant_alpha=0.5),
                                 calibration_data=_calib())
    assert all(m.x_scale is None for m in quantized_modules(model).values())


def test_smoothing_is_not_folded_into_a_norm_that_unquantized_layers_read(llama):
    """Only v_proj quantized: q and k read the same norm output, so 1/s must not go into that norm."""
    ids = torch.randint(3, 128, (2, 16))
    norm = llama.model.layers[0].input_layernorm.weight.clone()
    model = ffl_backend.quantize(copy.deepcopy(llama), QuantConfig(
        "w8a8", static=True, smoothquant_alpha=0.5, include=("*v_proj",)), calibration_data=_calib())
    assert torch.equal(model.model.layers[0].input_layernorm.weight, norm)
    assert model.model.layers[0].self_attn.v_proj.smooth is not None
    assert P.sqnr(llama(ids).logits, model(ids).logits) > 25.0


def test_config_validation():
    QuantConfig("w8a8", static=True, smoothquant_alpha="auto", clip_search=True, min_output_sqnr=25)
    QuantConfig("w8a8", min_output_sqnr=float("-inf"))
    bad = [dict(scheme="w8a8", smoothquant_alpha="best"), dict(scheme="w8a8", clip_search=True),
           dict(scheme="int8", min_output_sqnr=25.0), dict(scheme="w8a8", min_output_sqnr=float("nan")),
           dict(scheme="w8a8", min_output_sqnr="25"), dict(scheme="int8", smoothquant_alpha="auto")]
    for kwargs in bad:
        with pytest.raises(ValueError):
            QuantConfig(**kwargs)
    cfg = QuantConfig("w8a8", static=True, smoothquant_alpha="auto", clip_search=True, min_output_sqnr=22.0)
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg and cfg.needs_calibration and cfg.searches
    assert QuantConfig("w8a8", min_output_sqnr=20.0).needs_calibration
    with pytest.raises(ValueError, match="needs calibration_data"):
        ffl_backend.quantize(tiny_model("llama"), QuantConfig("w8a8", min_output_sqnr=20.0))


def test_w8a8_presets_are_the_searched_configs_and_need_calibration():
    from ffl_backend.quant.schemes import resolve_steps
    from tests.tiny_models import tiny_model

    (static,) = resolve_steps("w8a8-static")
    assert static.static and static.clip_search and static.smoothquant_alpha == "auto"
    assert static.min_output_sqnr == 22.0 and static.static_range_limit == 8.0
    (smooth,) = resolve_steps("w8a8-smooth")
    assert not smooth.static and smooth.smoothquant_alpha == "auto" and smooth.min_output_sqnr == 22.0
    for preset in ("w8a8-static", "w8a8-smooth"):
        with pytest.raises(ValueError, match="calibration"):
            ffl_backend.quantize(tiny_model("llama"), preset)


@pytest.mark.parametrize("preset", ["w8a8-smooth", "w8a8-static"])
def test_optimize_takes_calibration_data_for_the_presets_that_need_it(preset):
    """optimize(model, quant=preset, calibration_data=...) quantizes as quantize() does with that data
    (the same codes and scales) and then generates; without the data it fails before any work, as
    quantize() does; calibration data without a quant is a mistake said at once."""
    model, twin = tiny_model("llama"), tiny_model("llama")
    calib = _calib()
    ffl_backend.optimize(model, quant=preset, calibration_data=calib, max_seq_len=32, mode="default")
    ffl_backend.quantize(twin, preset, calibration_data=calib)
    ours, theirs = dict(model.named_buffers()), dict(twin.named_buffers())
    quantized = [n for n in ours if n.endswith("qweight")]
    assert quantized and all(torch.equal(ours[n], theirs[n]) for n in quantized)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 7)
    with pytest.raises(ValueError, match="calibration"):
        ffl_backend.optimize(tiny_model("llama"), quant=preset)
    with pytest.raises(ValueError, match="calibration_data is for quantization"):
        ffl_backend.optimize(tiny_model("llama"), calibration_data=calib)


def test_plain_w8a8_without_calibration_says_once_which_preset_loses_less(caplog):
    from ffl_backend.quant import handlers

    handlers._hint_plain_w8a8.cache_clear()
    caplog.set_level(logging.WARNING, logger="ffl_backend")
    for _ in range(2):
        ffl_backend.quantize(tiny_model("llama"), "w8a8")
    hints = [r.getMessage() for r in caplog.records if "w8a8-smooth" in r.getMessage()]
    assert hints == [handlers.PLAIN_W8A8_HINT] and "%%" not in hints[0]
    caplog.clear()
    ffl_backend.quantize(tiny_model("llama"), "w8a8-smooth", calibration_data=_calib())
    handlers._hint_plain_w8a8.cache_clear()
    ffl_backend.quantize(tiny_model("llama"), "w8a8", calibration_data=_calib())
    assert not [r for r in caplog.records if "w8a8-smooth" in r.getMessage()]
