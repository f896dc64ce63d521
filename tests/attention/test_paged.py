"""fastflow::paged_decode: CPU path and Triton kernel (interpreter) against the float64 reference,
opcheck, and the kernel compiled ahead of time for sm_80 / sm_90."""
import os

import pytest
import torch

from ffl_backend.attention.paged import paged_decode_cpu, paged_decode_ref, paged_decode_triton


def make_case(bsz, hq, hkv, d, block, lens, dtype=torch.float32, num_blocks=None):
    """Pools with random content and a shuffled, non-contiguous block assignment per row."""
    need = [-(-n // block) for n in lens]
    num_blocks = num_blocks or sum(need) + 3
    max_blocks = max(need) + 2
    k_pool = torch.randn(num_blocks, block, hkv, d, dtype=dtype)
    v_pool = torch.randn(num_blocks, block, hkv, d, dtype=dtype)
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()  # never the dummy block 0
    table = torch.zeros(bsz, max_blocks, dtype=torch.int32)
    for b, nb in enumerate(need):
        table[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    q = torch.randn(bsz, hq, d, dtype=dtype)
    return q, k_pool, v_pool, table, torch.tensor(lens, dtype=torch.int32)


CASES = [  # (B, Hq, Hkv, D, block, lengths): odd lengths, GQA groups 1/3/4, a one-token row
    (1, 4, 4, 64, 16, [1]),
    (3, 9, 3, 64, 16, [5, 123, 33]),
    (5, 8, 2, 40, 8, [1, 17, 64, 65, 200]),
    (2, 6, 6, 24, 4, [7, 9]),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_matches_reference(case, dtype):
    q, k, v, table, lens = make_case(*case, dtype=dtype)
    scale = case[3] ** -0.5
    ref = paged_decode_ref(q.double(), k.double(), v.double(), table, lens, scale)
    out = paged_decode_cpu(q, k, v, table, lens, scale)
    plain = paged_decode_ref(q, k, v, table, lens, scale)  # the same math in the input dtype
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and out.shape == q.shape
    err, plain_err = (out.double() - ref).abs().max(), (plain.double() - ref).abs().max()
    assert err <= 2 * plain_err + atol, (err, plain_err)


def test_padding_rows_and_unused_table_entries_are_ignored():
    """Rows point past their length at garbage blocks: nothing beyond seq_lens may leak in."""
    q, k, v, table, lens = make_case(2, 4, 2, 32, 16, [20, 3])
    out = paged_decode_cpu(q, k, v, table, lens, 0.2)
    table2 = table.clone()
    table2[1, 1:] = table[0, 0]  # row 1 needs 1 block; the rest of its row now points at real data
    assert torch.equal(paged_decode_cpu(q, k, v, table2, lens, 0.2), out)


def test_opcheck():
    import ffl_backend.attention.paged  # noqa: F401

    q, k, v, table, lens = make_case(3, 9, 3, 64, 16, [5, 40, 17])
    torch.library.opcheck(torch.ops.fastflow.paged_decode.default, (q, k, v, table, lens, 0.125))


def test_op_is_opaque_under_compile():
    """One graph, the op called as is, and no recompile when lengths and tables change."""
    from torch._dynamo.testing import CompileCounter

    import ffl_backend.attention.paged  # noqa: F401

    cnt = CompileCounter()
    fn = torch.compile(lambda *a: torch.ops.fastflow.paged_decode(*a) * 2, backend=cnt, dynamic=False)
    for lengths in ([5, 40, 17], [6, 41, 18], [60, 1, 2]):
        q, k, v, table, lens = make_case(3, 8, 4, 32, 16, lengths, num_blocks=20)
        table = torch.nn.functional.pad(table, (0, 8 - table.shape[1]))
        assert torch.allclose(fn(q, k, v, table, lens, 0.1), 2 * paged_decode_cpu(q, k, v, table, lens, 0.1))
    assert cnt.frame_count == 1


@pytest.mark.parametrize("case", [(2, 4, 2, 32, 16, [5, 40]), (3, 9, 3, 64, 16, [1, 17, 33])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_interpreter_matches_reference(case, dtype):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (tests/conftest.py)")
    q, k, v, table, lens = make_case(*case, dtype=dtype)
    scale = case[3] ** -0.5
    ref = paged_decode_ref(q.double(), k.double(), v.double(), table, lens, scale)
    out = paged_decode_triton(q, k, v, table, lens, scale)
    plain = paged_decode_ref(q, k, v, table, lens, scale)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref).abs().max() <= 2 * (plain.double() - ref).abs().max() + atol


def test_triton_rejects_non_power_of_two_blocks():
    q, k, v, table, lens = make_case(1, 4, 2, 32, 8, [5])
    with pytest.raises(ValueError, match="power-of-two"):
        paged_decode_triton(q, k, v, table, lens, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_consecutive_blocks_view_path(dtype):
    """One row whose blocks are consecutive takes the no-gather path; same result as the reference."""
    k = torch.randn(12, 16, 2, 32, dtype=dtype)
    v = torch.randn_like(k)
    table = torch.zeros(1, 8, dtype=torch.int32)
    table[0, :4] = torch.arange(5, 9)
    q, lens = torch.randn(1, 6, 32, dtype=dtype), torch.tensor([53], dtype=torch.int32)
    ref = paged_decode_ref(q.double(), k.double(), v.double(), table, lens, 0.17)
    plain = paged_decode_ref(q, k, v, table, lens, 0.17)
    out = paged_decode_cpu(q, k, v, table, lens, 0.17)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref).abs().max() <= 2 * (plain.double() - ref).abs().max() + atol


def _freed(table, lens, block, window):
    """The engine's view after freeing: blocks wholly before each row's window point at the dummy."""
    table = table.clone()
    for b, n in enumerate(lens.tolist()):
        table[b, :max(0, n - window) // block] = 0
    return table


WINDOW_CASES = [  # (B, Hq, Hkv, D, block, lengths, window, softcap)
    (3, 9, 3, 64, 16, [5, 123, 33], 20, 0.0),
    (2, 8, 1, 40, 16, [70, 200], 33, 1.5),
    (3, 4, 4, 24, 16, [1, 17, 48], 0, 1.5),
]


@pytest.mark.parametrize("case", WINDOW_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windows_and_softcap_match_reference(case, dtype):
    """Sliding windows (blocks before the window freed to the dummy, which holds other data) and
    soft-capping, CPU and Triton paths."""
    *shape, window, softcap = case
    q, k, v, table, lens = make_case(*shape, dtype=dtype)
    q = q * 3  # scores where the cap bends them
    scale = shape[3] ** -0.5
    ref = paged_decode_ref(q.double(), k.double(), v.double(), table, lens, scale, window, softcap)
    plain = paged_decode_ref(q, k, v, table, lens, scale, window, softcap)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    freed = _freed(table, lens, shape[4], window) if window else table
    paths = [paged_decode_cpu]
    if os.environ.get("TRITON_INTERPRET") == "1":
        paths.append(paged_decode_triton)
    for path in paths:
        out = path(q, k, v, freed, lens, scale, window, softcap)
        assert (out.double() - ref).abs().max() <= 2 * (plain.double() - ref).abs().max() + atol, path.__name__


def test_window_and_softcap_opcheck():
    import ffl_backend.attention.paged  # noqa: F401

    q, k, v, table, lens = make_case(3, 9, 3, 64, 16, [5, 40, 17])
    torch.library.opcheck(torch.ops.fastflow.paged_decode.default, (q, k, v, table, lens, 0.125, 9, 2.0))
