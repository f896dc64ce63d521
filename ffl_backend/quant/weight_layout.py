"""How sibling projections' weights are laid out in memory -- linears of one module that read the
same input (q/k/v, gate/up). Laid out as consecutive slices of one tensor, the graph patterns'
horizontal fusion (patterns/horizontal.py, patterns/horizontal_int4.py) finds that tensor and needs no
fused copy. `share_fused_storage` does it for dense weights (optimize() calls it before compiling),
`share_sibling_packs` for the CPU forms of int4 weights (quantize() and the loaders call it).
"""
from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from .. import numerics as P
from ..kernels.quant_linear import int4_cpu_pack
from .file_pages import file_mappings, release_pages
from .modules import Int4Linear, QuantizedModule

# Sibling projections HF models keep separate; fused when they read the same input.
FUSABLE_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def sibling_groups(model: torch.nn.Module, kind: type) -> Iterator[list]:
    """Every complete group of FUSABLE_SIBLINGS submodules that are all instances of `kind`."""
    for module in model.modules():
        for names in FUSABLE_SIBLINGS:
            members = [getattr(module, n, None) for n in names]
            if all(isinstance(m, kind) for m in members):
                yield members


def shared_base(tensors):
    """A tensor over the storage these already fill as consecutive row blocks (the layout
    `share_fused_storage` and `share_sibling_packs` make), or None. Detected by storage and offsets:
    `.data` re-pointing does not set `_base`."""
    first = tensors[0]
    ptr, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != ptr or t.storage_offset() != offset or not t.is_contiguous():
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                            (rows, *first.shape[1:]))


@torch.no_grad()
def _share_params(params, ranges) -> None:
    """Re-point `params` to consecutive slices of their concatenation. The fused tensor is the one
    copy: where the originals were views of a file mapping (from_pretrained's safetensors), the pages
    the copy just read leave RSS at once (`file_pages.release_pages`), so at most one group is
    resident twice, never the model."""
    originals = [p.detach() for p in params]
    fused = torch.cat(originals, dim=0)
    start = 0
    for p in params:
        p.data = fused[start:start + p.shape[0]]
        start += p.shape[0]
    if ranges:
        for t in originals:
            release_pages(t, ranges)


@torch.no_grad()
def share_fused_storage(model: torch.nn.Module) -> int:
    """Re-point sibling projections (q/k/v, gate/up) to consecutive slices of one tensor, so the
    horizontal pass uses that tensor as the fused weight and copies nothing. Values and parameter
    objects are unchanged; returns the number of groups shared. Call before compiling.

    Memory: the fused tensor replaces the originals (one copy of each weight). A checkpoint's mapped
    originals are released group by group as they are copied (3B figures:
    docs/performance.md#memory-one-copy-of-each-weight). `restore()` leaves
    the layout as it is: the parameters are the same objects with the same values, slices of one
    tensor, and a model so laid out computes, saves and reloads exactly as before (tests/test_memory.py);
    un-fusing would only cost a second copy while it runs."""
    groups = 0
    ranges = None
    for linears in sibling_groups(model, torch.nn.Linear):
        if len({(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in linears}) != 1:
            continue
        if shared_base([m.weight for m in linears]) is None:
            ranges = file_mappings() if ranges is None else ranges  # read once: fusing maps nothing
            _share_params([m.weight for m in linears], ranges)
            if linears[0].bias is not None:
                _share_params([m.bias for m in linears], ranges)
        groups += 1
    return groups


def _forms_concatenate(packs: list, rows: tuple, in_features: int, group_size: int) -> bool:
    """Whether the CPU form of row-concatenated weights is the concatenation of the members' forms:
    always in fastflow's layout (blocks of 16 rows), checked on torch's packing otherwise."""
    return packs[0].dim() == 3 or _packs_concatenate(rows, in_features, group_size)


@functools.lru_cache(maxsize=None)
def _packs_concatenate(rows: tuple, in_features: int, group_size: int) -> bool:
    """Whether torch's CPU pack of row-concatenated int4 weights equals the concatenation of each
    part's pack, for parts of these row counts (checked on the real packing, once per shape)."""
    gen = torch.Generator().manual_seed(0)
    codes = [torch.randint(0, 16, (n, in_features), dtype=torch.uint8, generator=gen) for n in rows]
    scales = [torch.ones(n, in_features // group_size, dtype=torch.bfloat16) for n in rows]
    parts = [int4_cpu_pack(P.pack_int4(q), s, s, group_size)[0] for q, s in zip(codes, scales)]
    whole = int4_cpu_pack(P.pack_int4(torch.cat(codes)), torch.cat(scales), torch.cat(scales), group_size)[0]
    return whole is not None and all(p is not None for p in parts) and torch.equal(torch.cat(parts), whole)


def completed_group(model: torch.nn.Module, name: str, kind: type) -> list | None:
    """The FUSABLE_SIBLINGS group the module called `name` belongs to, when every member is now a
    `kind` (the last of them just replaced, as quantize() goes linear by linear), else None."""
    parent_name, _, child = name.rpartition(".")
    for names in FUSABLE_SIBLINGS:
        if child in names:
            parent = model.get_submodule(parent_name) if parent_name else model
            members = [getattr(parent, n, None) for n in names]
            return members if all(isinstance(m, kind) for m in members) else None
    return None


@torch.no_grad()
def share_sibling_group(members: list) -> bool:
    """`share_sibling_packs` for one group of sibling int4 linears: whether they now share one form."""
    if any(m.cpu_packed is None for m in members) or len({(m.in_features, m.group_size) for m in members}) != 1:
        return False
    packs = [m.cpu_packed for m in members]
    if len({p.dim() for p in packs}) != 1:
        return False
    if shared_base(packs) is None:
        rows = tuple(m.out_features for m in members)
        if not _forms_concatenate(packs, rows, members[0].in_features, members[0].group_size):
            return False
        _share(members, "cpu_packed")
    if packs[0].dim() == 3 and shared_base([m.cpu_scale_zeros for m in members]) is None:
        _share(members, "cpu_scale_zeros")  # fastflow's layout: the tables concatenate as well
    return True


@torch.no_grad()
def share_sibling_packs(model: torch.nn.Module) -> int:
    """Re-point the CPU forms of sibling int4 linears (q/k/v, gate/up) to consecutive slices of one
    tensor where that tensor is exactly the form of their concatenation, so fusing them later copies
    nothing. Values and results are unchanged; returns the number of groups sharing one form.
    quantize() shares each group as soon as its last member is made (`completed_group`): done here
    at the end, every group's old forms would be freed only after all the new ones exist (the peak
    holding every sibling group's form twice)."""
    return sum(share_sibling_group(members) for members in sibling_groups(model, Int4Linear))


def _share(members: list, name: str) -> None:
    """Re-point each member's tensor `name` to its slice of their concatenation (along dim 0, in
    whole units of that dim: rows, or blocks of 16 rows in fastflow's layout)."""
    parts = [getattr(m, name) for m in members]
    fused, start = torch.cat(parts), 0
    for m, part in zip(members, parts):
        setattr(m, name, fused[start:start + part.shape[0]])
        start += part.shape[0]


def finalization_units(model: torch.nn.Module) -> list[list]:
    """Every quantized module of `model` once, in lists to finalize together (`finalize_units`): the
    members of a sibling group of int4 linears of one in_features and group size together (their CPU
    forms made as one, already laid out as `share_sibling_packs` wants), every other module alone."""
    units, grouped = [], set()
    for members in sibling_groups(model, Int4Linear):
        if len({(m.in_features, m.group_size) for m in members}) == 1 and not grouped & {id(m) for m in members}:
            units.append(members)
            grouped.update(id(m) for m in members)
    seen = set(grouped)
    for m in model.modules():
        if isinstance(m, QuantizedModule) and id(m) not in seen:
            units.append([m])
            seen.add(id(m))
    return units


def finalize_unit(unit: list) -> None:
    """Finalize the modules of one `finalization_units` list."""
    if len(unit) > 1:
        Int4Linear.finalize_siblings(unit)
    else:
        unit[0].finalize()
