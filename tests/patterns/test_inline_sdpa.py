"""inline_sdpa family: single-query CPU SDPA becomes dot products + softmax under Inductor,
matching SDPA; everything else (several query rows, causal, grouped heads, no Inductor) is left alone."""
import pytest
import torch
import torch.nn.functional as F

import ffl_backend
from ffl_backend.patterns.inline_sdpa import attention_single_query
from tests.helpers import assert_matches_reference


def _inputs(dtype, heads=3, kv_heads=None, q_rows=1, length=13, dim=24, mask=None):
    q = torch.randn(1, heads, q_rows, dim, dtype=dtype)
    k = torch.randn(1, kv_heads or heads, length, dim, dtype=dtype)
    v = torch.randn(1, kv_heads or heads, length, dim, dtype=dtype)
    if mask == "bool":  # a static cache: the last positions are not filled yet
        m = torch.ones(1, 1, q_rows, length, dtype=torch.bool)
        m[..., length - 4:] = False
    elif mask == "float":
        m = torch.zeros(1, 1, q_rows, length, dtype=dtype)
        m[..., length - 4:] = torch.finfo(dtype).min
        m[..., :3] += torch.randn(3).to(dtype)  # a position bias, not only 0 / -inf
    else:
        m = None
    return q, k, v, m


def _sdpa(q, k, v, mask, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_reference_matches_sdpa(dtype, mask, scale):
    q, k, v, m = _inputs(dtype, mask=mask)
    out = attention_single_query(q, k, v, m, scale if scale is not None else q.shape[-1] ** -0.5)
    assert_matches_reference(out, _sdpa, (q, k, v, m, scale))


def _compiled(fn, **options):
    torch._dynamo.reset()
    ffl_backend.clear_reports()
    return torch.compile(fn, backend="fastflow", options={"on_error": "raise", **options})


@pytest.mark.parametrize("dtype,mask", [(torch.float32, "bool"), (torch.bfloat16, "float"), (torch.float32, None)])
def test_single_query_sdpa_is_rewritten_under_inductor(dtype, mask):
    q, k, v, m = _inputs(dtype, heads=5, length=37, dim=16, mask=mask)
    out = _compiled(_sdpa)(q, k, v, m)
    assert ffl_backend.last_report().matches["inline_sdpa"] == 1
    assert_matches_reference(out, _sdpa, (q, k, v, m))


@pytest.mark.parametrize("case", ["two query rows", "causal", "grouped heads", "dropout", "no inductor"])
def test_other_attention_is_left_alone(case):
    q, k, v, m = _inputs(torch.float32, q_rows=2 if case == "two query rows" else 1,
                         kv_heads=1 if case == "grouped heads" else None)
    options = {"inductor": False} if case == "no inductor" else {}

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=case == "causal",
                                              enable_gqa=case == "grouped heads",
                                              dropout_p=0.5 if case == "dropout" else 0.0)

    out = _compiled(attend, **options)(q, k, v)
    assert ffl_backend.last_report().matches["inline_sdpa"] == 0
    if case != "dropout":
        torch.testing.assert_close(out, attend(q, k, v))


def test_the_former_name_still_selects_the_family(caplog):
    """Options written when the family was called decode_attention keep working, with a warning."""
    from ffl_backend.config import BackendOptions

    with caplog.at_level("WARNING", logger="ffl_backend"):
        opts = BackendOptions.parse(None, {"disable_patterns": "decode_attention"})
    assert opts.disable_patterns == ("inline_sdpa",)
    assert "now called 'inline_sdpa'" in caplog.text
    q, k, v, _ = _inputs(torch.float32)
    _compiled(F.scaled_dot_product_attention, disable_patterns=["decode_attention"])(q, k, v)
    assert ffl_backend.last_report().matches["inline_sdpa"] == 0
