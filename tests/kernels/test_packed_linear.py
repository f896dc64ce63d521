import pytest
import torch

from ffl_backend.kernels import packed_linear as P
from ffl_backend.kernels import weight_cache
from tests.helpers import assert_matches_reference

SHAPES = [((1, 576), 960), ((5, 123), 77), ((2, 3, 64), 200)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("xshape,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_reference(dtype, xshape, n, with_bias, monkeypatch):
    """The oneDNN-packed GEMM against a float64 linear: <= 2x plain F.linear's error at `dtype`. Where
    oneDNN packs no such weights (AVX2-only CPUs) the op *is* F.linear and there is nothing to compare:
    skipped, and test_cpu_without_a_packed_path_keeps_f_linear covers that path."""
    if not P.cpu_packs(dtype):
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU: packed_linear is F.linear here")
    packed = []
    prepack = P.prepack
    monkeypatch.setattr(P, "prepack", lambda w, hint=1: packed.append(w) or prepack(w, hint))
    x = torch.randn(xshape, dtype=dtype)
    w = torch.nn.Parameter(torch.randn(n, xshape[-1], dtype=dtype) / xshape[-1] ** 0.5)
    b = torch.randn(n, dtype=dtype) if with_bias else None
    out = torch.ops.fastflow.packed_linear(x, w, b)
    assert packed and packed[-1] is w, "the packed path did not run"
    assert_matches_reference(out, P.packed_linear_ref, (x, w, b), interpreted=False)


PACKS_BF16 = pytest.mark.skipif(not P.cpu_packs(torch.bfloat16),
                                reason="oneDNN packs no bf16 weights on this CPU (needs AVX-512 or AVX-NE-CONVERT)")


def test_cpu_without_a_packed_path_keeps_f_linear(monkeypatch):
    """Where oneDNN cannot pack (AVX2-only CPUs), can_pack says no and the op is F.linear."""
    w = torch.nn.Parameter(torch.randn(24, 40, dtype=torch.bfloat16))
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    monkeypatch.setattr(P, "cpu_packs", lambda dtype: False)
    assert not P.can_pack(w)
    assert torch.equal(torch.ops.fastflow.packed_linear(x, w), torch.nn.functional.linear(x, w))


def test_fp32_weights_are_never_packed():
    """fp32 is not a packed dtype (PACKED_DTYPES): the op is exactly F.linear, on every CPU."""
    w, x, b = torch.nn.Parameter(torch.randn(24, 40)), torch.randn(3, 40), torch.randn(24)
    assert not P.can_pack(w)
    assert torch.equal(torch.ops.fastflow.packed_linear(x, w, b), torch.nn.functional.linear(x, w, b))


@PACKS_BF16
def test_in_place_weight_update_is_repacked_not_served_stale():
    w = torch.nn.Parameter(torch.randn(64, 32, dtype=torch.bfloat16))
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    before = torch.ops.fastflow.packed_linear(x, w)
    with torch.no_grad():
        w.mul_(-1)
    after = torch.ops.fastflow.packed_linear(x, w)
    torch.testing.assert_close(after, -before)
    torch.testing.assert_close(after, torch.nn.functional.linear(x, w))


@PACKS_BF16
def test_freed_weight_leaves_no_entry_behind():
    w = torch.nn.Parameter(torch.randn(48, 32, dtype=torch.bfloat16))
    key = weight_cache._key("onednn", w)
    P.prepack(w)
    assert key in weight_cache._cache
    del w
    assert key not in weight_cache._cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_opcheck(dtype):
    x, w = torch.randn(3, 32, dtype=dtype), torch.randn(16, 32, dtype=dtype)
    torch.library.opcheck(torch.ops.fastflow.packed_linear.default, (x, w, torch.randn(16, dtype=dtype)))
    torch.library.opcheck(torch.ops.fastflow.packed_linear.default, (x, w, None))
