"""Single-row CPU int4 linears -> `fastflow_cpu::int4_gemv` calls (part of the decode_gemv family).

torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) rounds x to bf16 and converts each nibble
to a float before multiplying: at batch 1 on SmolLM2's shapes it streams ~10 GB/s, so int4 decode ran
no faster than int8, with half the bytes. `int4_gemv` (kernels/cpu_gemv.cpp) multiplies the codes as
they load with AVX512-VNNI, x read as int16 per group: 2x faster per layer (SmolLM2 layer, 2 threads:
torch 128 us, int4_gemv 60 us).

It reads its own layout (16 rows to a vector, `cpu_gemv.int4_layout`), made from the torch pack the
module (or int4_siblings' fused call) already holds, as a compile-time constant cached per weight
(weight_cache), like the dense family's bf16 copies; multi-row graphs (prefill) keep torch's kernel.
So a compiled int4 model holds both forms (+0.5 byte per weight). Changing weights after compiling
needs `torch._dynamo.reset()`.

Taken: `fastflow.int4_linear` calls with a torch CPU pack and the fused `int4_cpu_linear` calls of
int4_siblings, whose x is one row, when the kernel is available (option `cpu_gemv`), the pack's rows
are a multiple of 64 (the torch layout `int4_cpu_unpack` reads back exactly) and the group size a
multiple of 8.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor

from ..kernels import cpu_gemv, weight_cache
from ..kernels.quant_linear import INT4_CPU_UNPACK_ROWS, int4_cpu_linear, int4_cpu_unpack
from ..quant import primitives as P
from . import fx_utils as U

LAYOUT_PREFIX = "_fastflow_int4_gemv"


def _operands(node: fx.Node):
    """(x, torch pack, scale/zero table, group size, bias) argument nodes of an int4 linear call, or None."""
    if U.fastflow_op_name(node) == "int4_linear":
        return (node.args[0], U.arg(node, 6, "cpu_packed"), U.arg(node, 7, "cpu_scale_zeros"),
                U.arg(node, 4, "group_size"), U.arg(node, 5, "bias"))
    if node.op == "call_function" and node.target is int4_cpu_linear:
        return tuple(U.arg(node, i) for i in range(5))
    return None


def _real(gm: fx.GraphModule, ctx, node):
    """The real tensor behind a graph input or constant node, or None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        return getattr(gm, node.target, None)
    return ctx.tensor(node)


def _layout(packed: Tensor, scale_zeros: Tensor, rows: int, in_features: int, group_size: int):
    """`int4_gemv`'s (packed, scale_zeros) from torch's CPU form, made once per pack."""
    def make(_):
        codes = P.unpack_int4(int4_cpu_unpack(packed, rows, in_features))
        return cpu_gemv.int4_layout(codes, scale_zeros, group_size)
    return weight_cache.derived(f"int4_gemv:{scale_zeros.data_ptr()}", packed, make)


def rewrite_int4(gm: fx.GraphModule, ctx, node: fx.Node, single_row, use_kernel) -> bool:
    """Replace one int4 linear call of a single row with `int4_gemv`; False where it does not apply."""
    found = _operands(node)
    if found is None:
        return False
    x, packed_node, sz_node, group_size, bias = found
    packed, scale_zeros = _real(gm, ctx, packed_node), _real(gm, ctx, sz_node)
    if packed is None or scale_zeros is None or not isinstance(group_size, int) or not single_row(x):
        return False
    rows, in_features = packed.shape[0], packed.shape[1] * 2
    if (packed.device.type != "cpu" or packed.dtype != torch.uint8 or packed.dim() != 2
            or rows % INT4_CPU_UNPACK_ROWS or not cpu_gemv.int4_layout_fits(rows, in_features, group_size)
            or U.dtype_of(x) not in cpu_gemv.ACTIVATION_DTYPES):
        return False
    if not use_kernel(ctx.options):
        return False
    layout = _layout(packed, scale_zeros, rows, in_features, group_size)
    with gm.graph.inserting_before(node):
        consts = [gm.graph.get_attr(U.attach_constant(gm, t, LAYOUT_PREFIX)) for t in layout]
    new = U.copy_meta(U.call_op(gm.graph, torch.ops.fastflow_cpu.int4_gemv.default,
                                (x, *consts, bias, group_size), node), node)
    node.replace_all_uses_with(new)
    U.erase_dead(gm.graph, [node])
    for old in (packed_node, sz_node):  # int4_siblings' fused constants, now read by no one
        U.drop_unused_constant(gm, old)
    return True
