"""fastflow_cpu::gemm / int4_gemm (a prompt's linears on CPUs without bf16 matrix instructions) and
fastflow_cpu::prefill_attention: reference equality on odd shapes and every dtype (vs float64, within
twice torch's own error at the input precision), opcheck, clear errors, and the per-machine choice of
the rows from which a prompt takes them. tests/kernels/test_cpu_isa_paths.py reruns the reference tests
in each instruction-set build (AVX2, portable) in processes of their own."""
import json

import pytest
import torch

from ffl_backend import numerics as P
from ffl_backend.attention.reference import attention_ref
from ffl_backend.kernels import autotune, cpu_gemm, cpu_lib, int4_layout
from ffl_backend.kernels.quant_linear import int4_cpu_scale_zeros
from tests.helpers import assert_matches_reference

pytestmark = pytest.mark.skipif(not cpu_lib.load(), reason=f"CPU kernels not built: {cpu_lib.load_error()}")

X_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, N, K): odd sizes, edges of the 6 x 16 tile, several K blocks (256) and row blocks (96), K not a
# multiple of 8 (the widening's scalar tail)
SHAPES = [(5, 123, 123), (1, 16, 8), (13, 33, 300), (200, 40, 600), (3, 2, 1000), (97, 17, 7)]


def _weight(dtype, n, k, gen):
    if dtype == torch.int8:
        return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)


@pytest.mark.parametrize("xdtype", X_DTYPES)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("rows,n,k", SHAPES)
def test_gemm_matches_reference(xdtype, wdtype, rows, n, k):
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).to(xdtype)
    w = _weight(wdtype, n, k, gen)
    scale = torch.rand(n, generator=gen) / 127 + 1e-3 if wdtype == torch.int8 else None
    bias = torch.randn(n, generator=gen).to(xdtype) if n % 2 else None
    args = (x, w, scale, bias)
    assert_matches_reference(torch.ops.fastflow_cpu.gemm(*args), cpu_gemm.gemm_ref, args, interpreted=False)


def test_gemm_keeps_leading_dims_and_nan():
    x = torch.randn(2, 3, 40, dtype=torch.bfloat16)
    x[0, 1, 5] = float("nan")
    w = torch.randn(24, 40, dtype=torch.bfloat16)
    y = torch.ops.fastflow_cpu.gemm(x, w, None, None)
    assert y.shape == (2, 3, 24) and y.dtype == torch.bfloat16
    assert y[0, 1].isnan().all() and not y[0, 0].isnan().any()


def _int4(n, k, group_size, gen):
    q, s, z = P.quantize_int4(torch.randn(n, k, generator=gen), group_size)
    return int4_layout.int4_layout(q, int4_cpu_scale_zeros(s, z), group_size)


@pytest.mark.parametrize("xdtype", X_DTYPES)
@pytest.mark.parametrize("rows,n,k,group_size", [(1, 16, 8, 8), (7, 48, 40, 8), (100, 96, 576, 32),
                                                 (13, 32, 1024, 128), (30, 64, 512, 256)])
def test_int4_gemm_matches_reference(xdtype, rows, n, k, group_size):
    gen = torch.Generator().manual_seed(rows + n + k)
    packed, sz = _int4(n, k, group_size, gen)
    x = torch.randn(rows, k, generator=gen).to(xdtype)
    bias = torch.randn(n, generator=gen).to(xdtype) if rows % 2 else None
    args = (x, packed, sz, bias, group_size)
    assert_matches_reference(torch.ops.fastflow_cpu.int4_gemm(*args), cpu_gemm.int4_gemm_ref, args,
                             interpreted=False)


def test_opcheck():
    import ffl_backend.attention.prefill  # noqa: F401  (registers prefill_attention's fake: run alone, nothing else has)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 40, generator=gen, dtype=torch.bfloat16)
    w = torch.randint(-127, 128, (24, 40), generator=gen, dtype=torch.int8)
    torch.library.opcheck(torch.ops.fastflow_cpu.gemm.default, (x, w, torch.rand(24), torch.randn(24)))
    packed, sz = _int4(32, 64, 32, gen)
    torch.library.opcheck(torch.ops.fastflow_cpu.int4_gemm.default, (torch.randn(5, 64), packed, sz, None, 32))
    q, k, v = torch.randn(1, 4, 9, 32), torch.randn(1, 2, 12, 32), torch.randn(1, 2, 12, 32)
    torch.library.opcheck(torch.ops.fastflow_cpu.prefill_attention.default, (q, k, v, 0.2, 0))


def test_clear_errors():
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="K = x.size"):
        torch.ops.fastflow_cpu.gemm(x, torch.randn(8, 31, dtype=torch.bfloat16), None, None)
    with pytest.raises(RuntimeError, match="bfloat16, float16 or int8"):
        torch.ops.fastflow_cpu.gemm(x, torch.randn(8, 32), None, None)
    with pytest.raises(RuntimeError, match="scale must be"):
        torch.ops.fastflow_cpu.gemm(x, torch.ones(8, 32, dtype=torch.int8), torch.ones(7), None)
    packed, sz = _int4(16, 32, 8, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="multiple of group_size"):
        torch.ops.fastflow_cpu.int4_gemm(x, packed, sz, None, 12)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        q = torch.randn(1, 2, 4, 24)
        torch.ops.fastflow_cpu.prefill_attention(q, q, q, 0.2, 0)


# (batch, q heads, kv heads, queries, keys, head dim, window): MHA, GQA, MQA, queries after a filled
# prefix, windows, head dims 16..256, a single row
ATTENTION_SHAPES = [(1, 9, 3, 130, 130, 64, 0), (2, 4, 1, 37, 100, 256, 0), (1, 4, 2, 70, 70, 64, 16),
                    (1, 2, 2, 5, 5, 80, 0), (2, 8, 8, 61, 61, 128, 50), (1, 3, 1, 1, 1, 16, 0),
                    (1, 6, 2, 50, 200, 32, 7)]


@pytest.mark.parametrize("dtype", X_DTYPES)
@pytest.mark.parametrize("b,hq,hkv,lq,n,d,window", ATTENTION_SHAPES)
def test_prefill_attention_matches_reference(dtype, b, hq, hkv, lq, n, d, window):
    gen = torch.Generator().manual_seed(lq * n + d)
    q = torch.randn(b, hq, lq, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, hkv, n, d, generator=gen).to(dtype) for _ in range(2))
    args = (q, k, v, d**-0.5, window)
    assert_matches_reference(torch.ops.fastflow_cpu.prefill_attention(*args), attention_ref, args, interpreted=False)


def test_prefill_attention_reads_views_of_a_cache():
    """k/v as slices of a longer cache (strided rows per head), as the decode path passes them."""
    gen = torch.Generator().manual_seed(1)
    cache_k, cache_v = (torch.randn(2, 2, 64, 32, generator=gen) for _ in range(2))
    q = torch.randn(2, 4, 20, 32, generator=gen)
    k, v = cache_k[:, :, :20], cache_v[:, :, :20]
    args = (q, k, v, 0.3, 0)
    assert_matches_reference(torch.ops.fastflow_cpu.prefill_attention(*args), attention_ref,
                             (q, k.contiguous(), v.contiguous(), 0.3, 0), interpreted=False)


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_threshold_is_searched_once_per_shape(tuning, kind):
    from ffl_backend.kernels import quant_linear

    make = None if kind == "bf16" else quant_linear._gemm_paths(kind, 64, 128)
    rows = cpu_gemm.prompt_gemm_min_rows(kind, 64, 128, make)
    assert rows in cpu_gemm.MIN_ROWS_CHOICES
    saved = json.loads(tuning.read_text())[autotune.machine_key()]
    assert saved[f"prompt_gemm_min_rows:{kind}[64, 128]"] == rows
    assert cpu_gemm.prompt_gemm_min_rows(kind, 64, 128, lambda: pytest.fail("searched twice")) == rows
    x = torch.randn(max(2, min(rows, 256)), 128, dtype=torch.bfloat16)
    assert cpu_gemm.use_gemm(x, kind, 64, 128, make) == (rows <= x.shape[0] and cpu_gemm.available())
