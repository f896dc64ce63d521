"""Small, shared helpers for reading and editing Dynamo FX graphs.

Dynamo graphs are torch-level: the same math shows up as `torch.rsqrt(x)`, `x.rsqrt()` or
`operator.mul`, depending on how the model wrote it. `is_op` hides those spellings so each pattern
family states its structure once.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..kernels.user_ops import USER_NAMESPACE

# Each logical op: the call_function targets and call_method names Dynamo may emit for it.
_OPS: dict[str, tuple[set, set]] = {
    "add": ({operator.add, operator.iadd, torch.add}, {"add"}),
    "sub": ({operator.sub, torch.sub}, {"sub"}),
    "mul": ({operator.mul, operator.imul, torch.mul}, {"mul"}),
    "neg": ({operator.neg, torch.neg}, {"neg"}),
    "pow": ({operator.pow, torch.pow}, {"pow"}),
    "mean": ({torch.mean}, {"mean"}),
    "rsqrt": ({torch.rsqrt}, {"rsqrt"}),
    "tanh": ({torch.tanh}, {"tanh"}),
    "cat": ({torch.cat, torch.concat}, set()),
    "getitem": ({operator.getitem}, set()),
    "linear": ({torch._C._nn.linear, F.linear}, set()),
    "silu": ({F.silu, torch.nn.functional.silu, torch._C._nn.silu}, {"silu"}),
    "gelu": ({F.gelu, torch._C._nn.gelu}, set()),
    "layer_norm": ({F.layer_norm, torch.layer_norm}, set()),
    "unsqueeze": ({torch.unsqueeze}, {"unsqueeze"}),
    # dtype conversions: x.to(dtype), x.float(), x.type_as(y), x.to(dtype=...)
    "cast": (set(), {"to", "float", "type_as", "half", "bfloat16", "type"}),
}


def is_op(node, name: str) -> bool:
    """Whether `node` computes the logical op `name` (any of its Dynamo spellings)."""
    if not isinstance(node, fx.Node):
        return False
    funcs, methods = _OPS[name]
    if node.op == "call_function":
        return node.target in funcs
    if node.op == "call_method":
        return node.target in methods
    return False


def arg(node: fx.Node, index: int, name: str | None = None, default=None):
    """Positional argument `index`, or keyword `name`, or `default`."""
    if len(node.args) > index:
        return node.args[index]
    if name is not None and name in node.kwargs:
        return node.kwargs[name]
    return default


def value(node):
    """The example value Dynamo recorded for a node (a FakeTensor), or None."""
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def same_shape(*tensors) -> bool:
    """Whether the (fake) tensors all have one shape. Under dynamic shapes sizes are SymInts, which
    cannot be hashed (a set of shapes raises); one counts as equal only where it provably is (the
    same symbol), so the check adds no guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    first = tuple(tensors[0].shape)
    return all(len(t.shape) == len(first) and all(statically_known_true(a == b) for a, b in zip(t.shape, first))
               for t in tensors[1:])


def dtype_of(node):
    v = value(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def strip_casts(node):
    """Follow dtype casts back to the first non-cast node."""
    while is_op(node, "cast"):
        node = node.args[0]
    return node


def other_operand(binary: fx.Node, known):
    """For a commutative binary op with `known` as one operand, the other operand (or None)."""
    a, b = binary.args[0], binary.args[1] if len(binary.args) > 1 else None
    if a is known:
        return b
    if b is known:
        return a
    return None


def single_user(node: fx.Node):
    """The only user of `node`, or None when it has zero or several."""
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def scalar(x):
    """A Python number argument (literal in the graph), or None."""
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def copy_meta(new: fx.Node, old: fx.Node) -> fx.Node:
    """Carry Dynamo's metadata (example value, source location) to a replacement node."""
    for key in ("example_value", "val", "stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in old.meta:
            new.meta[key] = old.meta[key]
    return new


def erase_dead(graph: fx.Graph, nodes) -> None:
    """Erase the given matched nodes once nothing uses them (reverse topological order).

    Only nodes a pattern matched are erased: a graph-wide dead-code pass could drop the
    in-place KV-cache writes (`index_copy_`) that have no users but must stay.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(nodes), key=lambda n: order.get(n, -1), reverse=True):
        if node.graph is graph and not node.users and node.op in ("call_function", "call_method"):
            graph.erase_node(node)


def sibling_groups(graph: fx.Graph, classify) -> list:
    """Groups of >= 2 nodes a horizontal fusion may merge, in graph order: `classify(node)` gives
    (key, member) for a candidate, None otherwise; members with equal keys form a group."""
    groups: dict = {}
    for node in graph.nodes:
        found = classify(node)
        if found is not None:
            groups.setdefault(found[0], []).append(found[1])
    return [(key, members) for key, members in groups.items() if len(members) >= 2]


def replace_by_slices(graph: fx.Graph, nodes: list, fused: fx.Node) -> None:
    """Replace each of `nodes` by its slice of `fused`, their outputs concatenated along the last dim
    in this order (a horizontal fusion's one call), then erase them."""
    sizes = [value(n).shape[-1] for n in nodes]
    with graph.inserting_after(fused):
        parts = graph.call_function(torch.split, (fused, sizes), {"dim": -1})
    with graph.inserting_after(parts):
        outs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(nodes))]
    for old, new in zip(nodes, outs):
        copy_meta(new, old)
        old.replace_all_uses_with(new)
    erase_dead(graph, nodes)


def call_op(graph: fx.Graph, op, args, like: fx.Node, n_outputs: int = 1):
    """Insert `op(*args)` before `like`; return the node, or its `n_outputs` getitem nodes."""
    with graph.inserting_before(like):
        node = graph.call_function(op, tuple(args))
        if n_outputs == 1:
            return node
        return node, [graph.call_function(operator.getitem, (node, i)) for i in range(n_outputs)]


def attach_constant(gm: fx.GraphModule, tensor, prefix: str) -> str:
    """Register `tensor` as a buffer of `gm` under a fresh `prefix_<n>` name and return the name.
    AOT autograd lifts buffers to inputs and wants a Dynamo source for each (for guard dedup); a
    constant source names it, as it has no user origin."""
    from torch._dynamo.source import ConstantSource

    taken = {n for n, _ in gm.named_buffers()}
    name = next(f"{prefix}_{i}" for i in range(len(taken) + 1) if f"{prefix}_{i}" not in taken)
    gm.register_buffer(name, tensor)
    if hasattr(gm, "_param_name_to_source"):
        gm._param_name_to_source[name] = ConstantSource(name)
    return name


def fastflow_op_name(node: fx.Node) -> str | None:
    """"rms_norm" for a call to `torch.ops.fastflow.rms_norm` (overload or packet), the qualified
    "fastflow_user::<name>" for an op made with register_op, else None. By name: some ops (the
    quantized linears) register only once their module is imported."""
    target = node.target if node.op == "call_function" else None
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if not isinstance(target, torch._ops.OpOverloadPacket):
        return None
    namespace, _, name = target._qualified_op_name.partition("::")
    if namespace == "fastflow":
        return name
    return target._qualified_op_name if namespace == USER_NAMESPACE else None
