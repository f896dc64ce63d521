"""int4 sibling fusion: q/k/v and gate/up int4 linears on CPU become one packed call each, with
the same output as the unfused op."""
import pytest
import torch

import ffl_backend
from ffl_backend import numerics as P
from ffl_backend.kernels.quant_linear import int4_cpu_form, int4_cpu_linear, int4_cpu_pack, torch_pack_block_rows
from ffl_backend.patterns import horizontal_int4
from ffl_backend.patterns.registry import PATTERN_FAMILIES
from ffl_backend.quant import quantize, weight_layout
from ffl_backend.quant.weight_layout import share_sibling_packs, shared_base
from tests.tiny_models import LAYERS, tiny_model


def _packs(rows, group_size):
    quantized = [P.quantize_int4(torch.randn(n, 192), group_size) for n in rows]
    parts = [int4_cpu_pack(P.pack_int4(q), s, z, group_size) for q, s, z in quantized]
    whole = int4_cpu_pack(torch.cat([P.pack_int4(q) for q, _, _ in quantized]),
                          torch.cat([s for _, s, _ in quantized]), torch.cat([z for _, _, z in quantized]),
                          group_size)
    return parts, whole


def test_packed_rows_do_not_concatenate_unless_blocks_of_64():
    # why the fusion repacks from the portable form: torch blocks the packed rows in 64s
    parts, whole = _packs((48, 16, 32), 32)
    assert not torch.equal(torch.cat([p[0] for p in parts]), whole[0])
    parts, whole = _packs((64, 128, 32), 32)
    assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])


@pytest.mark.parametrize("group_size", [32, 64])
def test_repacked_siblings_give_each_members_rows(group_size):
    rows = (48, 16, 32)
    parts, whole = _packs(rows, group_size)
    x = torch.randn(3, 192, dtype=torch.bfloat16)
    fused = int4_cpu_linear(x, *whole, group_size, None)
    for got, (packed, scale_zeros) in zip(fused.split(rows, dim=-1), parts):
        torch.testing.assert_close(got, int4_cpu_linear(x, packed, scale_zeros, group_size, None), rtol=0, atol=0)


def _logits(model, ids, patterns):
    torch._dynamo.reset()
    ffl_backend.clear_reports()
    options = {"inductor": False, "on_error": "raise", "patterns": patterns}
    with torch.no_grad():
        return torch.compile(model, backend="fastflow", options=options)(ids).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v carry biases
def test_fused_int4_siblings_equal_the_unfused_ops(arch):
    model = tiny_model(arch, dtype=torch.bfloat16)
    quantize(model, {"scheme": "int4", "group_size": 32})
    ids = torch.randint(3, 128, (1, 9))
    unfused = _logits(model, ids, tuple(f for f in PATTERN_FAMILIES if f != "horizontal"))
    assert ffl_backend.last_report().ops.get("int4_linear", 0) == 7 * LAYERS
    fused = _logits(model, ids, PATTERN_FAMILIES)
    report = ffl_backend.last_report()
    assert report.matches["horizontal"] == 2 * LAYERS
    assert report.ops.get("int4_linear", 0) == 2 * LAYERS  # o_proj and down_proj stay single
    torch.testing.assert_close(fused, unfused, rtol=0, atol=0)


def test_layers_without_a_cpu_pack_are_left_alone():
    model = tiny_model("llama", dtype=torch.bfloat16)
    quantize(model, {"scheme": "int4", "group_size": 32})
    for layer in model.model.layers:  # as for a layer whose row count torch's CPU pack refuses
        layer.self_attn.k_proj.cpu_packed = None
        layer.self_attn.k_proj.cpu_scale_zeros = None
    ids = torch.randint(3, 128, (1, 5))
    with torch.no_grad():
        ref = model(ids).logits
    out = _logits(model, ids, PATTERN_FAMILIES)
    assert ffl_backend.last_report().matches["horizontal"] == 2 * LAYERS  # q+v and gate+up
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def _wide_llama():
    """A tiny Llama whose siblings have multiples of 64 rows (q 128, k/v 64, gate/up 128), as
    SmolLM2's do: their torch CPU packs concatenate."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def test_packs_concatenate_only_in_blocks_of_64():
    assert weight_layout._packs_concatenate((64, 128, 32), 192, 32)
    assert not weight_layout._packs_concatenate((48, 16, 32), 192, 32)


def test_quantize_shares_sibling_packs_and_fusion_copies_nothing(monkeypatch, int4_form):
    model = _wide_llama()
    ids = torch.randint(3, 128, (1, 9))
    quantize(model, {"scheme": "int4", "group_size": 32})
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for members in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        assert shared_base([m.cpu_packed for m in members]) is not None
        # fastflow's layout shares the scale/zero tables too (torch's run over rows in dim 1)
        assert (shared_base([m.cpu_scale_zeros for m in members]) is not None) == (int4_form == "fastflow")
    unfused = _logits(model, ids, tuple(f for f in PATTERN_FAMILIES if f != "horizontal"))
    packed_again = []
    monkeypatch.setattr(horizontal_int4, "int4_cpu_form", lambda *a: packed_again.append(1) or int4_cpu_form(*a))
    fused = _logits(model, ids, PATTERN_FAMILIES)
    assert ffl_backend.last_report().matches["horizontal"] == 2 * LAYERS
    assert packed_again == []  # the fused weight is the members' own shared pack
    torch.testing.assert_close(fused, unfused, rtol=0, atol=0)


def test_siblings_share_a_form_only_where_it_concatenates(int4_form):
    """The tiny Llama's siblings (q 64 rows, k/v 32, gate/up 96): fastflow's layout (blocks of 16
    rows) concatenates; torch's pack does where its row block (64 with AVX-512, 32 with AVX2 only)
    divides every sibling's rows."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    quantize(model, {"scheme": "int4", "group_size": 32})
    attn = model.model.layers[0].self_attn
    shared = shared_base([attn.q_proj.cpu_packed, attn.k_proj.cpu_packed, attn.v_proj.cpu_packed])
    block = torch_pack_block_rows()
    torch_concatenates = block is not None and all(rows % block == 0 for rows in (64, 32, 96))
    if int4_form == "fastflow" or torch_concatenates:
        assert shared is not None and share_sibling_packs(model) == 2 * LAYERS
    else:
        assert shared is None and share_sibling_packs(model) == 0
