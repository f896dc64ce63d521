"""fastflow_cpu::int4_gemv, the CPU decode GEMV for group-wise int4 weights: its layout round trip,
reference equality on odd shapes and dtypes, opcheck, clear errors, and its use by decode_gemv."""
import pytest
import torch

from ffl_backend import numerics as P
from ffl_backend.generation import configure_generate
from ffl_backend.kernels import cpu_lib, int4_layout
from ffl_backend.kernels.quant_linear import int4_cpu_linear, int4_cpu_pack, int4_cpu_scale_zeros
from tests.helpers import assert_matches_reference
from tests.tiny_models import LAYERS

pytestmark = pytest.mark.skipif(not cpu_lib.load(), reason=f"CPU GEMV kernel not built: {cpu_lib.load_error()}")

INT16_STEPS = 2 * 32639  # the kernel reads x per group as int16 in [-32639, 32639]: error <= max|x_g| / this


def _quantized(n, k, group_size, seed=0):
    """(codes, torch CPU scale/zero table, torch pack or None) of a random (n, k) weight."""
    gen = torch.Generator().manual_seed(seed)
    q, s, z = P.quantize_int4(torch.randn(n, k, generator=gen), group_size)
    return q, int4_cpu_scale_zeros(s, z), int4_cpu_pack(P.pack_int4(q), s, z, group_size)[0]


def _operands(n, k, group_size, xshape, xdtype, biased):
    codes, scale_zeros, _ = _quantized(n, k, group_size)
    packed, sz = int4_layout.int4_layout(codes, scale_zeros, group_size)
    x = torch.randn(*xshape, k, dtype=xdtype)
    bias = torch.randn(n, dtype=xdtype) if biased else None
    return x, packed, sz, bias, group_size


def _x_rounding_bound(x, packed, scale_zeros, bias, group_size):
    """The most reading x as int16 per group can move an output: sum_k step_g / 2 * |w_k| (+ fp32 slack)."""
    w = int4_layout.int4_gemv_ref(torch.eye(packed.shape[1] * 8, dtype=torch.float64), packed, scale_zeros, None,
                               group_size).T.abs()  # (N, K) dequantized weights
    rows = x.double().reshape(-1, x.shape[-1])
    step = rows.abs().reshape(rows.shape[0], -1, group_size).amax(-1).repeat_interleave(group_size, -1) / INT16_STEPS
    return (step @ w.T).max().item() + 1e-5


def test_layout_round_trips_the_codes():
    codes, scale_zeros, _ = _quantized(48, 40, 8)
    packed, sz = int4_layout.int4_layout(codes, scale_zeros, 8)
    assert packed.shape == (3, 5, 64) and sz.shape == (3, 5, 2, 16) and sz.dtype == torch.bfloat16
    assert torch.equal(int4_layout.int4_layout_codes(packed), codes)
    assert int4_layout.int4_layout_fits(48, 40, 8) and not int4_layout.int4_layout_fits(40, 40, 8)
    assert not int4_layout.int4_layout_fits(48, 40, 12) and not int4_layout.int4_layout_fits(48, 36, 8)


@pytest.mark.parametrize("n,k,group_size", [(64, 64, 32), (960, 576, 32), (576, 1536, 128), (128, 512, 256),
                                            (192, 96, 32)])
def test_reference_equals_torchs_int4_kernel_grid(n, k, group_size):
    """The layout holds torch's grid w = (q - 8) s + z': the reference's weight (read through the
    identity) is torch's int4 kernel's, which rounds its output to bf16."""
    codes, scale_zeros, torch_pack = _quantized(n, k, group_size)
    packed, sz = int4_layout.int4_layout(codes, scale_zeros, group_size)
    eye = torch.eye(k)
    expected = int4_cpu_linear(eye, torch_pack, scale_zeros, group_size, None)
    torch.testing.assert_close(int4_layout.int4_gemv_ref(eye, packed, sz, None, group_size), expected,
                               rtol=2.0**-8, atol=1e-6)


def _portable(n, k, group_size, dtype, seed):
    """Random portable codes (N, K/2) and an (N, K/G) scale and zero point in `dtype`: fitted-grid-like
    zero points (not integers), tiny, huge and negative-zero scales, and a zero point beyond 8."""
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // group_size, generator=gen, dtype=torch.float64) * 0.1).to(dtype)
    zero = (torch.rand(n, k // group_size, generator=gen, dtype=torch.float64) * 17 - 1).to(dtype)
    scale[0, 0], scale[-1, -1] = 1e-12, -0.0
    scale[n // 2, 0] = 6.0e4 if dtype == torch.float16 else 1e30
    zero[0, -1] = 8.0
    return qweight, scale, zero


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("n,k,group_size", [(16, 8, 8), (48, 40, 8), (64, 96, 32), (960, 576, 32),
                                            (32, 512, 256), (80, 192, 64), (112, 3072, 128), (16, 120, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_layout_pack_matches_reference(n, k, group_size, dtype):
    """fastflow_cpu::int4_layout_pack: the layout and the bf16 scale/zero table byte for byte equal to
    torch's unpack / stack / permute (int4_layout_from_portable_ref), and unpack gives the codes back."""
    qweight, scale, zero = _portable(n, k, group_size, dtype, seed=n + k)
    packed, sz = torch.ops.fastflow_cpu.int4_layout_pack([qweight], [scale], [zero], group_size)
    want_packed, want_sz = int4_layout.int4_layout_from_portable_ref(qweight, scale, zero, group_size)
    assert _same_bits(packed, want_packed) and _same_bits(sz, want_sz)
    assert torch.equal(torch.ops.fastflow_cpu.int4_layout_unpack(packed), qweight)
    assert torch.equal(P.pack_int4(int4_layout.int4_layout_codes(packed)), qweight)


def test_layout_pack_matches_reference_on_unaligned_strided_and_threaded_inputs():
    """Codes at an odd address (a weight mapped from a file sits anywhere), a column slice of a wider
    tensor, and enough row blocks for several threads (the op runs threads from 4 MB of output a
    thread) over 1-3 threads: the same bytes."""
    n, k, g = 2048, 8192, 32
    qweight, scale, zero = _portable(n, k, g, torch.bfloat16, seed=3)
    odd = torch.empty(qweight.numel() + 1, dtype=torch.uint8)[1:].view(n, k // 2)
    odd.copy_(qweight)
    wide = torch.cat([qweight, qweight], dim=1)[:, : k // 2]
    want = int4_layout.int4_layout_from_portable_ref(qweight, scale, zero, g)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for codes in (odd, wide):
                got = torch.ops.fastflow_cpu.int4_layout_pack([codes], [scale], [zero], g)
                assert all(_same_bits(a, b) for a, b in zip(got, want))
                assert torch.equal(torch.ops.fastflow_cpu.int4_layout_unpack(got[0]), qweight)
    finally:
        torch.set_num_threads(previous)


def test_layout_pack_keeps_nan_scales_nan():
    qweight, scale, zero = _portable(16, 64, 32, torch.float32, seed=1)
    scale[3, 1], zero[4, 0] = float("nan"), float("nan")
    sz = torch.ops.fastflow_cpu.int4_layout_pack([qweight], [scale], [zero], 32)[1]
    want = int4_layout.int4_layout_from_portable_ref(qweight, scale, zero, 32)[1]
    assert torch.equal(sz.isnan(), want.isnan()) and torch.equal(sz.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,) * 3, (torch.float16,) * 3,
                                    (torch.bfloat16, torch.float32, torch.float16)])
def test_layout_pack_of_siblings_matches_reference(dtypes):
    """Several weights of one K (q/k/v: 64, 16 and 48 rows) packed in one call: the layout of their row
    concatenation (the fused form sibling projections share), each member's part a slice of blocks;
    members of different scale dtypes go through fp32 as the reference's .float() does."""
    members = [_portable(n, 96, 32, dtype, seed=n) for n, dtype in zip((64, 16, 48), dtypes)]
    qweights, scales, zeros = (list(parts) for parts in zip(*members))
    packed, sz = torch.ops.fastflow_cpu.int4_layout_pack(qweights, scales, zeros, 32)
    want = int4_layout.int4_layout_from_portable_ref(torch.cat(qweights), torch.cat([s.float() for s in scales]),
                                                     torch.cat([z.float() for z in zeros]), 32)
    assert _same_bits(packed, want[0]) and _same_bits(sz, want[1])
    first = 0
    for q, s, z in members:
        alone = torch.ops.fastflow_cpu.int4_layout_pack([q], [s], [z], 32)
        blocks = q.shape[0] // 16
        assert _same_bits(packed[first:first + blocks], alone[0]) and _same_bits(sz[first:first + blocks], alone[1])
        first += blocks


def test_layout_table_matches_reference():
    """fastflow_cpu::int4_layout_table: the scale/zero half of int4_layout_pack alone (codes saved in
    the layout), for one weight and for siblings, byte for byte."""
    members = [_portable(n, 256, 64, torch.bfloat16, seed=n) for n in (32, 16)]
    qweights, scales, zeros = (list(parts) for parts in zip(*members))
    table = torch.ops.fastflow_cpu.int4_layout_table(scales, zeros, 64)
    assert _same_bits(table, torch.ops.fastflow_cpu.int4_layout_pack(qweights, scales, zeros, 64)[1])
    assert _same_bits(table[:2], int4_layout.int4_layout_from_portable_ref(*members[0], 64)[1])
    torch.library.opcheck(torch.ops.fastflow_cpu.int4_layout_table.default, (scales, zeros, 64))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.fastflow_cpu.int4_layout_table(scales, zeros, 0)


def test_layout_pack_opcheck_and_errors():
    qweight, scale, zero = _portable(32, 64, 32, torch.bfloat16, seed=2)
    other = _portable(16, 64, 32, torch.bfloat16, seed=5)
    op = torch.ops.fastflow_cpu.int4_layout_pack
    torch.library.opcheck(op.default, ([qweight], [scale], [zero], 32))
    torch.library.opcheck(op.default, ([qweight, other[0]], [scale, other[1]], [zero, other[2]], 32))
    packed = op([qweight], [scale], [zero], 32)[0]
    torch.library.opcheck(torch.ops.fastflow_cpu.int4_layout_unpack.default, (packed,))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op([qweight[:24]], [scale[:24]], [zero[:24]], 32)
    with pytest.raises(RuntimeError, match="multiple of 8 dividing"):
        op([qweight], [scale], [zero], 12)
    with pytest.raises(RuntimeError, match=r"\(N, K/G\)"):
        op([qweight], [scale[:, :1]], [zero[:, :1]], 32)
    with pytest.raises(RuntimeError, match="of one K"):
        op([qweight, qweight[:, :16]], [scale, scale], [zero, zero], 32)
    with pytest.raises(RuntimeError, match="as many qweights"):
        op([qweight, qweight], [scale], [zero], 32)
    with pytest.raises(RuntimeError, match=r"\(N/16, K/8, 64\) uint8"):
        torch.ops.fastflow_cpu.int4_layout_unpack(packed.view(-1))


def test_layout_wrappers_take_the_reference_without_the_library(monkeypatch):
    qweight, scale, zero = _portable(32, 64, 32, torch.bfloat16, seed=4)
    want = int4_layout.int4_layout_from_portable(qweight, scale, zero, 32)
    monkeypatch.setattr(cpu_lib, "load", lambda: False)
    got = int4_layout.int4_layout_from_portable(qweight, scale, zero, 32)
    assert all(_same_bits(a, b) for a, b in zip(got, want))
    assert torch.equal(int4_layout.portable_codes(got[0]), qweight)
    two = int4_layout.int4_layout_from_portables([qweight, qweight], [scale, scale], [zero, zero], 32)
    assert all(_same_bits(a, torch.cat([b, b])) for a, b in zip(two, want))
    assert _same_bits(int4_layout.int4_layout_tables([scale, scale], [zero, zero], 32), two[1])


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group_size", [(16, 8, 8), (48, 40, 8), (64, 96, 32), (960, 576, 32),
                                            (32, 512, 256), (80, 192, 64)])
@pytest.mark.parametrize("xshape", [(1,), (1, 1), (3,)])
@pytest.mark.parametrize("biased", [False, True])
def test_matches_reference(xdtype, n, k, group_size, xshape, biased):
    args = _operands(n, k, group_size, xshape, xdtype, biased)
    out = torch.ops.fastflow_cpu.int4_gemv(*args)
    assert_matches_reference(out, int4_layout.int4_gemv_ref, args, atol=_x_rounding_bound(*args), interpreted=False)


def test_a_zero_group_and_tiny_values():
    """A group of x that is all zeros (step 0) adds nothing; x scaled by 2^-100 (each group keeps its
    own step) gives exactly the output scaled by 2^-100 -- no underflow to a coarse grid."""
    args = _operands(32, 64, 32, (1,), torch.float32, False)
    x, packed, sz, _, g = args
    x[0, :32] = 0
    out = torch.ops.fastflow_cpu.int4_gemv(*args)
    assert_matches_reference(out, int4_layout.int4_gemv_ref, args, atol=_x_rounding_bound(*args), interpreted=False)
    tiny = torch.ops.fastflow_cpu.int4_gemv(x * 2.0**-100, packed, sz, None, g)
    assert torch.equal(tiny, out * 2.0**-100)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_largest_codes_and_x_do_not_overflow(sign):
    """Every code 15 and every x at its group's largest magnitude: the kernel's narrow integer sums
    (int16 pairs on AVX2, over up to four chunks) meet their largest values; a long group (256)
    spans many such runs. The output must still match the reference."""
    n, k, group_size = 32, 512, 256
    codes = torch.full((n, k), 15, dtype=torch.uint8)
    scale_zeros = int4_cpu_scale_zeros(torch.rand(n, k // group_size) + 0.5, torch.zeros(n, k // group_size))
    packed, sz = int4_layout.int4_layout(codes, scale_zeros, group_size)
    args = (torch.full((2, k), sign), packed, sz, None, group_size)
    out = torch.ops.fastflow_cpu.int4_gemv(*args)
    assert_matches_reference(out, int4_layout.int4_gemv_ref, args, atol=_x_rounding_bound(*args), interpreted=False)


def test_threads_split_row_blocks():
    args = _operands(80, 64, 32, (1,), torch.float32, True)
    outs = []
    for threads in (1, 2, 3):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            outs.append(torch.ops.fastflow_cpu.int4_gemv(*args))
        finally:
            torch.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])  # blocks are independent


def test_opcheck():
    torch.library.opcheck(torch.ops.fastflow_cpu.int4_gemv.default, _operands(32, 64, 32, (1,), torch.bfloat16, True))


def test_bad_operands_raise_clear_errors():
    x, packed, sz, _, g = _operands(32, 64, 32, (1,), torch.float32, False)
    op = torch.ops.fastflow_cpu.int4_gemv
    with pytest.raises(RuntimeError, match="multiple of 8 dividing K"):
        op(x, packed, sz, None, 12)
    with pytest.raises(RuntimeError, match=r"\(N/16, K/8, 64\) uint8"):
        op(torch.randn(1, 72), packed, sz, None, 8)
    with pytest.raises(RuntimeError, match=r"\(N/16, K/G, 2, 16\) bf16"):
        op(x, packed, sz.float(), None, g)
    with pytest.raises(RuntimeError, match="vector of its weight's 32 rows"):
        op(x, packed, sz, torch.ones(31), g)


def _int4_llama(dtype):
    """A tiny Llama, int4 group 32: q/o 64 rows, k/v 32, gate/up 96 (multiples of 16, not all of 64)."""
    from ffl_backend.quant import quantize
    from tests.tiny_models import tiny_model

    model = tiny_model("llama", dtype=dtype)
    quantize(model, {"scheme": "int4", "group_size": 32})
    return model


def _int4_gemv_calls(fn):
    """fn()'s result and its calls of fastflow's int4 kernels: the row kernel or, for prompts past the
    rows this machine chose (kernels/cpu_gemm.py), the prompt GEMM."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    kernels = ("fastflow_cpu::int4_gemv", "fastflow_cpu::int4_gemm")
    return out, sum(e.count for e in prof.key_averages() if e.key in kernels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_runs_every_int4_linear_on_the_kernel(dtype):
    """Eager and compiled (fastflow) generate: every int4 linear of the prefill and of each decode
    step is one kernel call (compiled: q/k/v and gate/up fused, 4 per layer), and both decode alike."""
    model = _int4_llama(dtype)
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
    eager, eager_calls = _int4_gemv_calls(lambda: model.generate(ids, **kw))
    assert eager_calls == 10 * 7 * LAYERS  # the prefill and 9 decode steps, 7 linears per layer
    configure_generate(model, backend="fastflow", options={"on_error": "raise"})
    model.generate(ids, **kw)  # compiles
    compiled, calls = _int4_gemv_calls(lambda: model.generate(ids, **kw))
    assert calls == 7 * LAYERS + 9 * 4 * LAYERS  # the prefill's symbolic-length graph is not fused
    if dtype == torch.float32:
        assert torch.equal(compiled.sequences, eager.sequences)
    # bf16 greedy may part on a near tie; the logits are comparable up to that step (same prefix)
    differ = (compiled.sequences != eager.sequences)[0, ids.shape[1]:].nonzero()
    steps = int(differ[0]) + 1 if differ.numel() else len(eager.logits)
    for a, b in zip(compiled.logits[:steps], eager.logits[:steps]):
        torch.testing.assert_close(a, b, rtol=1e-3 if dtype == torch.float32 else 0.02,
                                   atol=1e-3 if dtype == torch.float32 else 0.05)


@pytest.mark.parametrize("rows,kernel", [(64, True), (48, True), (40, False)])
def test_rows_not_in_blocks_of_16_keep_the_reference(rows, kernel):
    """The layout holds 16 rows to a vector: other row counts (which torch's CPU pack refuses as well)
    run the reference; the result matches it either way."""
    from ffl_backend.kernels.quant_linear import int4_linear_ref
    from ffl_backend.quant import quantize

    model = torch.nn.Sequential(torch.nn.Linear(64, rows))
    quantize(model, {"scheme": "int4", "group_size": 32, "skip": ()})
    m, x = model[0], torch.randn(2, 64)
    out, calls = _int4_gemv_calls(lambda: model(x))
    assert calls == int(kernel) and (m.cpu_packed is not None) == kernel
    expected = int4_linear_ref(x, m.portable_qweight(), m.scale, m.zero, 32, m.bias)
    # the kernels' scale/zero table is bf16 (torch's grid): a relative error of ~2^-9 per weight
    assert ((out - expected).norm() / expected.norm()).item() < (4e-3 if kernel else 1e-6)


def test_float64_rows_go_through_fp32():
    """The kernel reads fp32/bf16/fp16; float64 rows (a reference check, say) are read as fp32 and the
    result comes back in float64."""
    from ffl_backend.kernels.quant_linear import int4_cpu_linear

    x, packed, sz, bias, g = _operands(32, 64, 32, (2,), torch.float32, True)
    out = int4_cpu_linear(x.double(), packed, sz, g, bias)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torch.ops.fastflow_cpu.int4_gemv(x, packed, sz, bias, g).double(), rtol=0, atol=0)


@pytest.mark.parametrize("n,k,group_size", [(16, 64, 32), (48, 96, 32), (80, 256, 128), (32, 40, 8)])
def test_int4_widen_equals_reference(n, k, group_size):
    """The prompt path's widening (cpu_widen.cpp): the bf16 weight of the layout, exactly or within
    one bf16 rounding (the kernel may fuse (q - 8) * s + z' into one FMA before rounding)."""
    codes, scale_zeros, _ = _quantized(n, k, group_size)
    packed, sz = int4_layout.int4_layout(codes, scale_zeros, group_size)
    got = torch.ops.fastflow_cpu.int4_widen(packed, sz, group_size)
    exact = int4_layout.int4_layout_weight(packed, sz, group_size)
    assert got.dtype == torch.bfloat16 and got.shape == (n, k)
    ulp = exact.abs().clamp_min(2**-126) * 2**-8
    assert ((got.float() - exact).abs() <= ulp).all()
    assert (got == int4_layout.int4_widen_ref(packed, sz, group_size)).float().mean() > 0.99
    torch.library.opcheck(torch.ops.fastflow_cpu.int4_widen.default, (packed, sz, group_size))
