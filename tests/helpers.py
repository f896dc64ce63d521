"""Shared test helpers: dtype-aware comparison against a high-precision reference."""
from __future__ import annotations

import torch

# Absolute slack per dtype, on top of twice PyTorch's own low-precision error.
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DTYPES = (torch.float32, torch.bfloat16)
# The Triton interpreter rounds fp32 -> bf16/fp16 by truncation (triton/runtime/interpreter.py,
# cast_impl), which doubles each rounding error relative to the GPU's round-to-nearest-even. Only
# interpreted low-precision outputs get this factor; compiled GPU runs are held to the plain bound.
INTERPRETER_ROUNDING_FACTOR = 2.0


def as_f64(args):
    return [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def assert_matches_reference(kernel_out, ref_fn, args, kwargs=None, atol=None, interpreted=True):
    """Kernel error vs a float64 run of `ref_fn` must be <= 2x plain PyTorch's own error at the
    input precision (ref_fn on the low-precision inputs) + atol. Handles tuple outputs."""
    kwargs = kwargs or {}
    lowp = ref_fn(*args, **kwargs)
    exact = ref_fn(*as_f64(args), **kwargs)
    outs = kernel_out if isinstance(kernel_out, (tuple, list)) else (kernel_out,)
    lowps = lowp if isinstance(lowp, (tuple, list)) else (lowp,)
    exacts = exact if isinstance(exact, (tuple, list)) else (exact,)
    assert len(outs) == len(lowps)
    for out, lo, ex in zip(outs, lowps, exacts):
        assert out.shape == lo.shape, (out.shape, lo.shape)
        assert out.dtype == lo.dtype, (out.dtype, lo.dtype)
        tol = atol if atol is not None else ATOL[lo.dtype]
        torch_err = (lo.double() - ex).abs().max().item()
        err = (out.double() - ex).abs().max().item()
        factor = 2.0
        if interpreted and lo.dtype in (torch.bfloat16, torch.float16):
            factor *= INTERPRETER_ROUNDING_FACTOR
        assert err <= factor * torch_err + tol, f"kernel error {err:.3g} > {factor} x torch error {torch_err:.3g} + {tol}"
