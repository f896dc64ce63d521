"""CPU decode GEMV family: single-row linears become `fastflow_cpu::gemv` calls (or multiply + sum).

A batch-1 decode step multiplies one activation row by every weight matrix once: GEMVs, bound by
how fast the weights stream from cache. Inductor turns `(x[..., None, :] * w).sum(-1)` into one
vectorized reduction loop per output row, split across threads, with the weight converted in
registers and never materialized; at batch 1 that beats the library GEMVs it replaces (oneDNN on
pre-packed bf16 weights, torch's int8 kernel; fp32 MKL about equal). The hand-written kernel
(kernels/cpu_gemv.cpp; option `cpu_gemv`, default "auto") goes further: it prefetches ahead into L1
and L2, which Inductor's loop cannot (the A/B: benchmarks/ab_decode.py, option cpu_gemv "loops" vs
the default, benchmarks/results/cpu_gemv_ab_cpu.json). Siblings reading one row (q/k/v, gate/up)
become one call (decode_gemv_calls.py). Where the kernel cannot be built the family keeps the
multiply + sum loops.

So the family takes bf16 linears, `fastflow.int8_linear` (weight-only int8; the scale multiplies
the sum), and fp32 linears whose weight values are all exactly representable in bf16 (a bf16
checkpoint loaded in fp32, as SmolLM2 is): those read a bf16 copy of the weight, half the bytes,
with the same products and the same fp32 accumulation -- lossless. Other fp32 weights stay on MKL
(no measured gain), fp16 on packed_linear. int4 linears are not this family's: their modules
already run fastflow's int4 kernel (kernels/quant_linear.py), or torch's packed one where it cannot
be built (nibble unpacking does not vectorize in Inductor's C++).

Matched only where the activation has a static shape and exactly one row -- up to
cpu_gemv.MAX_ROWS rows (a small batch's decode step) where the kernel is used; prefill and larger
batches keep the GEMM libraries -- on CPU, and only when Inductor compiles the graph: run
eagerly the expression would materialize an (N, K) product.

Numerics (kernel and loops alike): products and the sum in fp32, as oneDNN and MKL accumulate, one
rounding to the activation dtype at the end; only the summation order differs from the library kernels. (For int8
this is closer to the reference than the ATen kernel, which first rounds fp32 activations to bf16.)
The bf16 copy is a compile-time constant, like horizontal fusion's fused weights: changing the
weights after compiling needs `torch._dynamo.reset()` (README, "Weights are constants").
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
from torch import Tensor

from ..kernels import cpu_gemv, cpu_lib, weight_cache
from ..numerics import acc_dtype
from . import fx_utils as U
from .decode_gemv_calls import KernelGemv, emit_kernel_calls
from .packed_linear import _weight_tensor

COMPACT_PREFIX = "_fastflow_bf16_weight"


def _row_dot(x: Tensor, weight: Tensor) -> Tensor:
    """x (..., K) times every row of weight (N, K) -> (..., N), in fp32 (or wider)."""
    acc = acc_dtype(x)
    # as_strided makes Inductor store x (in fp32) once. Otherwise it inlines x's producer (RMSNorm,
    # rotary, attention output) into the reduction and recomputes it for every weight row.
    row = x.to(acc)
    row = torch.as_strided(row, row.shape, row.stride())
    return (row.unsqueeze(-2) * weight.to(acc)).sum(-1)


def linear_rowwise(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """`F.linear(x, weight, bias)` for a single row of x, as multiply + sum in fp32 (x's dtype out)."""
    y = _row_dot(x, weight)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


def int8_linear_rowwise(x: Tensor, qweight: Tensor, scale: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """`fastflow.int8_linear` (per-output-channel int8 weights) for a single row of x."""
    y = _row_dot(x, qweight) * scale.to(acc_dtype(x))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


def is_bf16_exact(w: Tensor) -> bool:
    """Whether every fp32 value of `w` is a bf16 value (its low 16 mantissa bits are zero)."""
    return w.dtype == torch.float32 and not bool((w.detach().view(torch.int32) & 0xFFFF).any())


def _static_cpu_rows(x) -> Optional[int]:
    """How many rows of features x has, if it is a CPU tensor of static shape (else None)."""
    xv = U.value(x)
    if not isinstance(xv, torch.Tensor) or xv.device.type != "cpu" or xv.dim() < 1 or xv.shape[-1] == 0:
        return None
    if any(not isinstance(s, int) for s in xv.shape):  # a dynamic shape: the row count may change
        return None
    return xv.numel() // xv.shape[-1]


def _single_cpu_row(x) -> bool:
    return _static_cpu_rows(x) == 1


def _compact_weight(gm: fx.GraphModule, w_node, w: Tensor):
    """A get_attr node of the bf16 copy of `w` (shared across compiles of the same weight)."""
    copy = weight_cache.derived("bf16_exact", w, lambda t: t.detach().to(torch.bfloat16))
    with gm.graph.inserting_before(w_node if w_node.op == "get_attr" else _first_op(gm.graph)):
        return gm.graph.get_attr(U.attach_constant(gm, copy, COMPACT_PREFIX))


def _first_op(graph: fx.Graph) -> fx.Node:
    return next(n for n in graph.nodes if n.op != "placeholder")


def _drop_unused_constant(gm: fx.GraphModule, node) -> None:
    """Free a constant (e.g. a horizontally fused fp32 weight) whose only reader was replaced."""
    if isinstance(node, fx.Node) and node.op == "get_attr" and not node.users:
        target = node.target
        gm.graph.erase_node(node)
        if not any(n.op == "get_attr" and n.target == target for n in gm.graph.nodes):
            delattr(gm, target)


def _replace(gm: fx.GraphModule, node: fx.Node, fn, args) -> None:
    new = U.copy_meta(U.call_op(gm.graph, fn, args, node), node)
    node.replace_all_uses_with(new)
    U.erase_dead(gm.graph, [node])


def use_kernel(options) -> bool:
    """Whether single-row linears call `fastflow_cpu::gemv` (option `cpu_gemv`, see config.py)."""
    if options.cpu_gemv == "loops":
        return False
    if cpu_gemv.ready():
        return True
    if options.cpu_gemv == "kernel":
        raise RuntimeError("fastflow: cpu_gemv='kernel' but the CPU GEMV kernel is unavailable: "
                           f"{cpu_lib.load_error()}")
    return False


def _operand(gm: fx.GraphModule, node):
    """The tensor (real or fake) behind an argument node: a constant of gm or a recorded value."""
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return getattr(gm, node.target, None)
    return U.value(node)


def _kernel_fits(gm: fx.GraphModule, x, weight, *vectors) -> bool:
    """Whether the kernel takes these operand nodes (see `cpu_gemv.takes`); a present vector whose
    value is unknown does not fit."""
    values = [_operand(gm, v) for v in vectors if v is not None]
    return all(v is not None for v in values) and cpu_gemv.takes(U.value(x), _operand(gm, weight), *values)


def _rewrite_int8(gm: fx.GraphModule, ctx, node: fx.Node, kernel_gemvs: list) -> bool:
    x, qweight, scale, bias = node.args[0], node.args[1], node.args[2], U.arg(node, 3, "bias")
    qv, rows = U.value(qweight), _static_cpu_rows(x)
    if rows is None or not isinstance(qv, torch.Tensor) or qv.device.type != "cpu":
        return False
    if use_kernel(ctx.options) and _kernel_fits(gm, x, qweight, scale, bias):  # up to cpu_gemv.MAX_ROWS rows
        kernel_gemvs.append(KernelGemv(node, x, qweight, torch.int8, qv.shape[0], scale, bias))
    elif rows == 1:
        _replace(gm, node, int8_linear_rowwise, (x, qweight, scale, bias))
    else:
        return False
    return True


def _reads_as_bf16(ctx, x, w: Optional[Tensor]) -> bool:
    """Whether this family takes the linear x @ w.T (one row; up to cpu_gemv.MAX_ROWS where the kernel
    is used) and reads w as bf16: a bf16 weight, or an fp32 one whose values are all bf16 (read
    through a bf16 copy)."""
    rows = _static_cpu_rows(x)
    if w is None or w.device.type != "cpu" or rows is None or U.dtype_of(x) != w.dtype:
        return False
    if rows > 1 and not (rows <= cpu_gemv.MAX_ROWS and use_kernel(ctx.options)):
        return False
    return w.dtype == torch.bfloat16 or (
        w.dtype == torch.float32 and ctx.options.bf16_exact_weights and is_bf16_exact(w))


def kernel_reads_siblings(ctx, x, weights, biases) -> bool:
    """Whether this family will hand every one of these linears of the row `x` to the kernel, which
    reads siblings in one call (decode_gemv_calls.py) -- so fusing them first would only copy weights."""
    if not (ctx.options.inductor and "decode_gemv" in ctx.options.patterns):
        return False
    for w, b in zip(weights, biases):
        if not _reads_as_bf16(ctx, x, w):
            return False
        as_read = w if w.dtype == torch.bfloat16 else torch.empty(w.shape, dtype=torch.bfloat16, device="meta",
                                                                  requires_grad=w.requires_grad)
        if not cpu_gemv.takes(U.value(x), as_read, b):
            return False
    return use_kernel(ctx.options)  # last: it builds the kernel on first use


def _rewrite(gm: fx.GraphModule, ctx, node: fx.Node, kernel_gemvs: list) -> bool:
    x, w_node, b_node = node.args[0], U.arg(node, 1, "weight"), U.arg(node, 2, "bias")
    w = _weight_tensor(w_node, ctx)
    if not _reads_as_bf16(ctx, x, w):
        return False
    weight_arg = _compact_weight(gm, w_node, w) if w.dtype == torch.float32 else w_node
    if use_kernel(ctx.options) and _kernel_fits(gm, x, weight_arg, b_node):
        kernel_gemvs.append(KernelGemv(node, x, weight_arg, torch.bfloat16, w.shape[0], None, b_node))
        return True  # the fp32 weight's constant (if any) is dropped once the kernel call replaced node
    if not _single_cpu_row(x):  # several rows are the kernel's only
        _drop_unused_constant(gm, weight_arg)
        return False
    _replace(gm, node, linear_rowwise, (x, weight_arg, b_node))
    if weight_arg is not w_node:
        _drop_unused_constant(gm, w_node)
    return True


def decode_gemv_pass(gm: fx.GraphModule, ctx) -> int:
    if not ctx.options.inductor:  # eager would materialize the (N, K) product
        return 0
    count, kernel_gemvs = 0, []
    for node in list(gm.graph.nodes):
        if U.is_op(node, "linear"):
            count += _rewrite(gm, ctx, node, kernel_gemvs)
        elif U.fastflow_op_name(node) == "int8_linear":
            count += _rewrite_int8(gm, ctx, node, kernel_gemvs)
    replaced_weights = [U.arg(g.node, 1, "weight") for g in kernel_gemvs]
    emit_kernel_calls(gm, kernel_gemvs, cpu_gemv.int8_activations(ctx.options.int8_activations))
    for w_node in replaced_weights:
        _drop_unused_constant(gm, w_node)
    return count
