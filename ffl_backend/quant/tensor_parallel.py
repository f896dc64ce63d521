"""Tensor-parallel models as plain local tensors: what fastflow's patterns and quantized modules read.

transformers (`from_pretrained(..., tp_plan="auto")` under torchrun) shards a model's parameters as
DTensors and replaces each sharded module's `forward` by a wrapper that moves between local tensors
and DTensors and all-reduces row-parallel outputs. fastflow's passes expect plain parameters:
quantization copies weights into new modules (which would drop the wrapper and with it the
all-reduce), storage sharing reads data pointers, horizontal fusion matches parameters. `localize`
therefore rewrites such a model, in place, into the equivalent plain form:

- column-parallel linears (style "colwise": each rank computes its slice of the output features, e.g.
  q/k/v, gate/up) keep their local rows as a plain Parameter, `out_features` the local count;
- row-parallel linears ("rowwise": o_proj, down_proj) keep their local input columns and get a
  forward hook that all-reduces their output over the tensor-parallel group (the bias, replicated,
  is kept on rank 0 only so the sum adds it once). `quantize` carries hooks over to the module
  that replaces a linear, so the all-reduce survives quantization, and under torch.compile it is a
  functional collective in the graph that no fastflow pattern spans;
- every other sharded parameter (vocabulary-parallel embeddings, the gathered lm_head, styles this
  module does not shard) is gathered whole on every rank: correct, only not split;
- the config's head counts and MLP width become the local ones when attention and MLP are split, so
  static caches are sized for the heads this rank holds.
"""
from __future__ import annotations

import dataclasses
import logging

from torch import nn

from .schemes import GROUP_SIZES

logger = logging.getLogger("ffl_backend")

COLUMN_STYLES = ("ColwiseParallel",)
ROW_STYLES = ("RowwiseParallel",)
SHARD_ATTR = "_ffl_tensor_parallel"  # set on each split linear: its ShardInfo


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """How one linear is split: along "out" (column-parallel) or "in" (row-parallel) features."""

    dim: str
    world_size: int
    full_features: int  # the split dimension's size before sharding


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether `model` still holds DTensor parameters (sharded by transformers, not yet localized)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def localize(model: nn.Module) -> nn.Module:
    """Rewrite a transformers tensor-parallel model into plain local tensors (module docstring), in
    place; a model without DTensor parameters is returned unchanged. Every rank must call it."""
    if not is_tensor_parallel(model):
        return model
    import torch.distributed as dist

    split = {"out": 0, "in": 0}
    for name, module in model.named_modules():
        sharded = {k: p for k, p in module._parameters.items() if p is not None and _is_dtensor(p)}
        if not sharded:
            continue
        style = _style(module)
        placement = _weight_placement(module)
        group = next(iter(sharded.values())).device_mesh.get_group()
        if isinstance(module, nn.Linear) and style in COLUMN_STYLES and _shard_dim(placement) == 0 \
                and _local_output(module):
            _make_local(module, sharded, "out", dist.get_world_size(group))
            split["out"] += 1
        elif isinstance(module, nn.Linear) and style in ROW_STYLES and _shard_dim(placement) in (1, -1) \
                and _sharded_input(module):
            _make_local(module, sharded, "in", dist.get_world_size(group))
            _keep_bias_once(module, dist.get_rank(group))
            module.register_forward_hook(_all_reduce_hook(group))
            split["in"] += 1
        else:
            _gather_whole(module, sharded)
            logger.info("tensor parallel: %s (%s) gathered whole on every rank", name, style or type(module).__name__)
        module.__dict__.pop("forward", None)  # transformers' wrapper: the class forward is the local one now
    _localize_config(model, split)
    logger.info("tensor parallel: %d column-parallel and %d row-parallel linears localized", split["out"], split["in"])
    return model


def shard_of(module: nn.Module) -> ShardInfo | None:
    """The ShardInfo `localize` attached to a split linear, or None."""
    return getattr(module, SHARD_ATTR, None)


def _is_dtensor(p) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _tp_layer(module: nn.Module):
    """transformers' parallel style object behind a module's installed forward wrapper, or None."""
    forward = module.__dict__.get("forward")
    for cell in getattr(forward, "__closure__", None) or ():
        obj = cell.cell_contents
        if type(obj).__module__.startswith("transformers.") and hasattr(obj, "install_forward"):
            return obj
    return None


def _style(module: nn.Module) -> str | None:
    layer = _tp_layer(module)
    return type(layer).__name__ if layer is not None else None


def _local_output(module: nn.Module) -> bool:
    """Column-parallel with its output left sharded (not gathered: "colwise_gather_output")."""
    from torch.distributed.tensor import Shard

    out = getattr(_tp_layer(module), "output_layouts", None)
    return isinstance(out, Shard)


def _sharded_input(module: nn.Module) -> bool:
    """Row-parallel reading an input already split by the column-parallel layer before it."""
    from torch.distributed.tensor import Shard

    return isinstance(getattr(_tp_layer(module), "input_layouts", None), Shard)


def _weight_placement(module: nn.Module):
    w = module._parameters.get("weight")
    return w.placements[0] if w is not None and _is_dtensor(w) else None


def _shard_dim(placement) -> int | None:
    return getattr(placement, "dim", None)


def _make_local(module: nn.Linear, sharded: dict, dim: str, world_size: int) -> None:
    full = module.out_features if dim == "out" else module.in_features
    for key, p in sharded.items():
        module._parameters[key] = nn.Parameter(p.to_local().contiguous(), requires_grad=False)
    module.out_features, module.in_features = module.weight.shape
    setattr(module, SHARD_ATTR, ShardInfo(dim, world_size, full))


def _keep_bias_once(module: nn.Linear, rank: int) -> None:
    if module.bias is not None and rank != 0:
        module.bias.data.zero_()


def _gather_whole(module: nn.Module, sharded: dict) -> None:
    for key, p in sharded.items():
        module._parameters[key] = nn.Parameter(p.full_tensor().contiguous(), requires_grad=False)


def _all_reduce_hook(group):
    def hook(_module, _args, output):
        import torch.distributed as dist

        dist.all_reduce(output, group=group)
        return output
    return hook


def _localize_config(model: nn.Module, split: dict) -> None:
    """Local head counts and MLP width, when every rank holds an equal share of them."""
    sizes = {shard_of(m).world_size for m in model.modules() if shard_of(m) is not None}
    if len(sizes) != 1:
        return
    world = sizes.pop()
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(cfg, key, None)
        if isinstance(heads, int) and split["out"] and heads % world:
            raise ValueError(f"tensor parallel over {world} ranks splits attention heads, but {key}={heads} does not "
                             f"divide by {world}: ranks would hold parts of a head. Use a degree dividing {heads}.")
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and split["out"] and value % world == 0:
            setattr(cfg, key, value // world)


def carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """Give `new` (replacing `old` in a model) old's forward hooks and pre-hooks, with their kwargs flags:
    the tensor-parallel all-reduce and users' own hooks outlive quantization."""
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                 "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
        if hasattr(old, attr):
            getattr(new, attr).update(getattr(old, attr))


def check_int4_groups(name: str, linear: nn.Module, group_size: int | None) -> None:
    """Raise before any work when sharding is what keeps an int4 group size from dividing a layer's
    input features: name the layer and the group sizes that would divide this rank's shard."""
    info = shard_of(linear)
    if info is None or info.dim != "in":
        return
    local = linear.in_features
    sizes = (group_size,) if group_size is not None else GROUP_SIZES
    if any(local % g == 0 for g in sizes) or not any(info.full_features % g == 0 for g in sizes):
        return
    fits = [g for g in GROUP_SIZES if local % g == 0]
    hint = (f"group_size={max(fits)} would" if fits else
            f"none of {', '.join(map(str, GROUP_SIZES))} does: skip it (int8 takes any width) or use another "
            "tensor-parallel degree")
    asked = f"group size {group_size} does not divide it" if group_size is not None else "no int4 group size divides it"
    raise ValueError(f"int4: {name} holds {local} of its {info.full_features} input features on this rank "
                     f"(tensor parallel over {info.world_size}) and {asked}; {hint}")


def all_reduce_count(model: nn.Module) -> int:
    """Row-parallel linears (each all-reduces its output once per forward)."""
    return sum(1 for m in model.modules() if (s := shard_of(m)) is not None and s.dim == "in")


def world_size(model: nn.Module) -> int:
    sizes = {s.world_size for m in model.modules() if (s := shard_of(m)) is not None}
    return sizes.pop() if len(sizes) == 1 else 1
