"""Activation families: gated activations (SwiGLU / GeGLU) and GeLU with bias and residual.

    LlamaMLP (modeling_llama.py):   down(act_fn(gate_proj(x)) * up_proj(x))     act = silu
    GemmaMLP (modeling_gemma.py):   same, act = gelu_pytorch_tanh              -> gelu(approximate="tanh")
    Phi3MLP (modeling_phi3.py):     gate, up = gate_up_proj(x).chunk(2); up * act(gate)
    NewGELUActivation (GPT-2):      0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from . import fx_utils as U

OPS = torch.ops.fastflow


def _same_layout(*nodes) -> bool:
    vals = [U.value(n) for n in nodes]
    return all(v is not None for v in vals) and len({v.dtype for v in vals}) == 1 and U.same_shape(*vals)


def gated_act_pass(gm: fx.GraphModule, ctx) -> int:
    """`act(gate) * up` -> `fastflow.silu_mul` / `fastflow.gelu_mul`."""
    graph, count = gm.graph, 0
    for act in [n for n in graph.nodes if U.is_op(n, "silu") or U.is_op(n, "gelu")]:
        mul = U.single_user(act)
        if not U.is_op(mul, "mul"):
            continue
        gate, up = act.args[0], U.other_operand(mul, act)
        if not isinstance(up, fx.Node) or not _same_layout(gate, up, mul):
            ctx.decline("gated_act", mul, "gate and up differ in shape or dtype")
            continue
        if U.is_op(act, "silu"):
            op, args = OPS.silu_mul.default, (gate, up)
        else:
            op, args = OPS.gelu_mul.default, (gate, up, U.arg(act, 1, "approximate", "none"))
        new = U.copy_meta(U.call_op(graph, op, args, mul), mul)
        mul.replace_all_uses_with(new)
        U.erase_dead(graph, [mul, act])
        count += 1
    return count


def _match_new_gelu(tanh: fx.Node):
    """From `tanh`: (x, end, nodes) for GPT-2's NewGELU written out in torch ops, else None."""
    inner = tanh.args[0]  # sqrt(2/pi) * (x + 0.044715 * x**3)
    one_plus = U.single_user(tanh)
    if not U.is_op(inner, "mul") or not U.is_op(one_plus, "add") or 1.0 not in one_plus.args:
        return None
    c = next((U.scalar(a) for a in inner.args if U.scalar(a) is not None), None)
    poly = next((a for a in inner.args if isinstance(a, fx.Node)), None)
    if c is None or abs(c - math.sqrt(2.0 / math.pi)) > 1e-6 or not U.is_op(poly, "add"):
        return None
    cube_term = next((a for a in poly.args if U.is_op(a, "mul")), None)
    x = U.other_operand(poly, cube_term) if cube_term is not None else None
    cube = next((a for a in cube_term.args if U.is_op(a, "pow")), None) if cube_term is not None else None
    if x is None or cube is None or cube.args[0] is not x or U.arg(cube, 1, "exponent") != 3.0:
        return None
    end = U.single_user(one_plus)  # (0.5 * x) * (1 + tanh(...))
    half = U.other_operand(end, one_plus) if U.is_op(end, "mul") else None
    if not U.is_op(half, "mul") or x not in half.args or 0.5 not in half.args:
        return None
    return x, end, [end, half, one_plus, tanh, inner, poly, cube_term, cube]


def gelu_pass(gm: fx.GraphModule, ctx) -> int:
    """GeLU (F.gelu or GPT-2's written-out tanh form), absorbing a following residual add, ->
    `fastflow.gelu_residual(x, bias=None, residual, approximate)`. Gated GeLUs are taken first by
    the gated family, so only stand-alone activations reach this pass."""
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        if node.graph is not graph:
            continue
        if U.is_op(node, "tanh"):
            found = _match_new_gelu(node)
            if found is None:
                continue
            (x, end, nodes), approximate = found, "tanh"
        elif U.is_op(node, "gelu"):
            x, end, nodes, approximate = node.args[0], node, [node], U.arg(node, 1, "approximate", "none")
        else:
            continue
        residual = None
        add = U.single_user(end)
        if U.is_op(add, "add") and not add.kwargs and _same_layout(end, add, U.other_operand(add, end)):
            residual, nodes, end = U.other_operand(add, end), [add, *nodes], add
        new = U.copy_meta(U.call_op(graph, OPS.gelu_residual.default, (x, None, residual, approximate), end), end)
        end.replace_all_uses_with(new)
        U.erase_dead(graph, nodes)
        count += 1
    return count
