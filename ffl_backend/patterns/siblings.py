"""Sibling projections -- linears of one module that read the same input (q/k/v, gate/up) -- and
the one-storage layout in which they need no fused copy. Shared by the dense horizontal fusion and
its int4 counterpart, and by the helpers that lay weights out that way before compiling."""
from __future__ import annotations

from collections.abc import Iterator

import torch

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
