"""Users' fused ops: `ffl_backend.register_op` defines `torch.ops.fastflow_user.<name>` from a pure-torch
reference, with an optional CPU path and an optional Triton launcher for CUDA.

The ops live in their own namespace, apart from `torch.ops.fastflow`, so a user's name can never
collide with a built-in op a later release adds. Each is a `torch.library.custom_op`: opaque to
Inductor, which calls it as one kernel -- the body is the user's, and a compiled graph calls
whatever implementation is registered at run time (Inductor's on-disk cache cannot hold a stale
copy of it). Importing this module registers nothing.
"""
from __future__ import annotations

from typing import Callable

import torch

USER_NAMESPACE = "fastflow_user"

# name -> the op's torch.library definition, in registration order
_ops: dict = {}


def register_op(name: str, reference: Callable, *, cpu: Callable | None = None, triton: Callable | None = None,
                fake: Callable | None = None, schema: str | None = None, mutates_args=(), replace: bool = False):
    """Define `torch.ops.fastflow_user.<name>` and return it (the op packet; `.default` is the overload).

    reference:  pure-torch function, the op's meaning and the implementation wherever no other is
                given; its type annotations give the op's schema (or pass `schema`, e.g.
                "(Tensor x, float alpha) -> Tensor").
    cpu:        implementation for CPU tensors (same signature), e.g. a C++ extension or a version
                with fewer temporaries.
    triton:     implementation for CUDA tensors, typically a function that launches a Triton kernel.
    fake:       shape/dtype-only implementation for tracing. Default: the reference itself, which,
                being pure torch, runs on fake tensors.
    The outputs must be new tensors (no views or aliases of the inputs), as torch.library requires;
    `torch.library.opcheck(op.default, args)` checks an op. A name already registered is an error
    unless `replace=True`, which redefines the op (recompile graphs that call it: docs/extending.md).
    """
    _check_name(name, replace)
    for role, fn in (("reference", reference), ("cpu", cpu), ("triton", triton), ("fake", fake)):
        if fn is not None and not callable(fn):
            raise TypeError(f"fastflow: register_op {name!r}: {role} must be callable, got {type(fn).__name__}")
    op = torch.library.custom_op(f"{USER_NAMESPACE}::{name}", reference, mutates_args=mutates_args, schema=schema)
    # device kernels override the reference (registered for every device) on their device only
    if cpu is not None:
        op.register_kernel("cpu", cpu)
    if triton is not None:
        op.register_kernel("cuda", triton)
    op.register_fake(fake if fake is not None else reference)
    _ops[name] = op
    return getattr(getattr(torch.ops, USER_NAMESPACE), name)


def _check_name(name: str, replace: bool) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"fastflow: an op name must be an identifier, got {name!r}")
    if name in _ops and not replace:
        raise ValueError(f"fastflow: op {USER_NAMESPACE}::{name} is already registered "
                         "(replace=True to redefine it)")

