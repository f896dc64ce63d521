"""int4 on CPU keeps its codes once, in the CPU kernel's form (fastflow's layout, or torch's pack where
fastflow's kernel is not built); the portable `qweight` is rebuilt from it for saving, reports and
moves, and stays where the form's layout is not known (torch's pack of rows not in blocks of 64)."""
import copy

import pytest
import torch

import ffl_backend
from ffl_backend import numerics as P
from ffl_backend.kernels import quant_linear as K
from ffl_backend.quant import QuantConfig, save_quantized
from ffl_backend.quant.modules import Int4Linear, is_stand_in
from ffl_backend.quant.quantizer import quantized_modules
from tests.tiny_models import tiny_model


def _torch_pack(qweight):
    ones = torch.ones(qweight.shape[0], qweight.shape[1] * 2 // 32)
    return K.int4_cpu_pack(qweight, ones, ones, 32)[0]


@pytest.mark.parametrize("n,k", [(64, 32), (128, 96), (192, 576), (576, 1536)])
def test_unpack_inverts_torchs_pack(n, k):
    qweight = P.pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8))
    assert torch.equal(K.int4_cpu_unpack(_torch_pack(qweight), n, k), qweight)


@pytest.mark.parametrize("n", [16, 48, 80, 112])
def test_unpack_declines_row_counts_of_another_layout(n):
    qweight = P.pack_int4(torch.randint(0, 16, (n, 64), dtype=torch.uint8))
    assert K.int4_cpu_unpack(_torch_pack(qweight), n, 64) is None


def _module(out_features, in_features=96):
    linear = torch.nn.Linear(in_features, out_features)
    codes, _, _ = P.quantize_int4(linear.weight.detach(), 32)
    return Int4Linear.from_linear(linear, QuantConfig("int4", group_size=32, grid="minmax")), P.pack_int4(codes)


def test_module_keeps_one_copy_and_rebuilds_its_codes(int4_form):
    m, qweight = _module(128)
    assert m.cpu_packed.dim() == (3 if int4_form == "fastflow" else 2)
    assert is_stand_in(m.qweight) and m.qweight.untyped_storage().nbytes() == 1
    assert torch.equal(m.portable_qweight(), qweight)
    x = torch.randn(3, 96)
    expected = torch.ops.fastflow.int4_linear(x, qweight, m.scale, m.zero, 32, m.bias, m.cpu_packed, m.cpu_scale_zeros)
    torch.testing.assert_close(m(x), expected, rtol=0, atol=0)
    saved = m.state_dict()["qweight"]
    assert torch.equal(saved, qweight) and saved.is_contiguous()
    torch.testing.assert_close(m.dequantized_weight(), P.dequantize_int4(qweight, m.scale, m.zero, 32))


@pytest.mark.parametrize("change", ["finalize", "deepcopy", "float", "load_state_dict"])
def test_codes_survive_what_users_do_to_modules(change, int4_form):
    m, qweight = _module(128)
    if change == "finalize":
        m.finalize()
    elif change == "deepcopy":
        m = copy.deepcopy(m)
    elif change == "float":
        m = m.to(torch.float64).float()
    else:
        fresh, _ = _module(128)
        fresh.load_state_dict(m.state_dict())
        m = fresh.finalize()
    assert is_stand_in(m.qweight) and torch.equal(m.portable_qweight(), qweight)
    assert torch.equal(K.int4_cpu_codes(m.cpu_packed, 128, 96), qweight)


def test_moving_off_cpu_carries_the_real_codes(int4_form):
    m, qweight = _module(128)
    moved = m.to("meta")
    assert not is_stand_in(moved.qweight) and moved.qweight.shape == qweight.shape


def test_rows_of_an_unknown_layout_keep_their_portable_codes(int4_form):
    m, qweight = _module(48)  # torch packs 48 rows in another layout: nothing to rebuild from
    assert m.cpu_packed is not None and torch.equal(m.portable_qweight(), qweight)
    assert is_stand_in(m.qweight) == (int4_form == "fastflow")  # fastflow's layout takes any 16 rows


def test_quantized_model_round_trips_through_stand_ins(tmp_path, int4_form):
    """A tiny Llama's int4 linears keep one copy (in torch's pack only its 64-row ones; its 32- and
    96-row ones two); saving writes the real codes and loading gives the same logits."""
    model = ffl_backend.quantize(tiny_model("llama"), QuantConfig("int4", group_size=32))
    held = {n for n, m in quantized_modules(model).items() if is_stand_in(m.qweight)}
    rows = {n: m.out_features for n, m in quantized_modules(model).items()}
    assert held == {n for n, r in rows.items() if r % (16 if int4_form == "fastflow" else 64) == 0}
    assert set(rows.values()) == {32, 64, 96}
    save_quantized(model, tmp_path)
    loaded = ffl_backend.load_quantized(tmp_path)
    assert {n for n, m in quantized_modules(loaded).items() if is_stand_in(m.qweight)} == held
    ids = torch.randint(3, 128, (2, 12))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_siblings_finalized_together_share_one_form_equal_to_their_own(int4_form):
    """q/k/v-like siblings (64, 16 and 48 rows) finalized together: in fastflow's layout one form made
    in one pass, each member's form a slice of it and equal to the form it makes alone; in torch's
    pack each member makes its own."""
    from ffl_backend.quant.weight_layout import shared_base

    config = QuantConfig("int4", group_size=32, grid="minmax")
    alone = [Int4Linear.from_linear(torch.nn.Linear(96, n), config) for n in (64, 16, 48)]
    together = copy.deepcopy(alone)
    Int4Linear.finalize_siblings(together)
    assert (shared_base([m.cpu_packed for m in together]) is not None) == (int4_form == "fastflow")
    for a, t in zip(alone, together):
        assert torch.equal(a.cpu_packed, t.cpu_packed) and torch.equal(a.cpu_scale_zeros, t.cpu_scale_zeros)
        assert is_stand_in(t.qweight) == is_stand_in(a.qweight)
        assert torch.equal(t.portable_qweight(), a.portable_qweight())


@pytest.mark.parametrize("block", [0, -1])
def test_a_form_that_is_not_the_weights_keeps_the_portable_codes(block, int4_form):
    """The codes become a stand-in only where the form gives them back: fastflow's layout is checked on
    its first and last block of 16 rows (its op's tests prove the rest), torch's pack whole."""
    m, qweight = _module(128)
    form = m.cpu_packed.clone()
    form[block].view(-1)[0] ^= 0x11  # one byte of the first or last block (of rows) changed
    m.qweight, m.cpu_packed = qweight.clone(), form
    m._keep_codes_in_pack()
    assert not is_stand_in(m.qweight) and torch.equal(m.portable_qweight(), qweight)
