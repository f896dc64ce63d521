"""What the GPU tests share: the device they run on, the marks that skip them elsewhere, and the
comparison against the float64 references of the CPU tests (tests/helpers.py).

FFL_CUDA_TESTS_DEVICE=cpu runs the same test bodies on CPU tensors, the kernels through the Triton
interpreter that tests/conftest.py turns on: slow, and meant only to check the tests themselves on a
machine without a GPU (ops then take their CPU paths, models compile with Inductor's C++ kernels).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import assert_matches_reference

DEVICE = os.environ.get("FFL_CUDA_TESTS_DEVICE", "cuda")
# Interpreted kernels round fp32 -> bf16 by truncation: tests/helpers.py widens their bound for it.
INTERPRETED = DEVICE == "cpu"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _skip_reason() -> str | None:
    if DEVICE == "cpu":
        return None
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (run scripts/gpu_check.sh on the device machine)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return ("TRITON_INTERPRET=1 would interpret the kernels instead of compiling them: run with "
                "FFL_NATIVE_TRITON=1 (scripts/gpu_check.sh sets it)")
    return None


SKIP_REASON = _skip_reason()
# Every module here: `pytestmark = CUDA_TESTS`.
CUDA_TESTS = [pytest.mark.cuda, pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]


# e4m3 tensor-core dots (FP8) exist from Hopper on; the interpreter runs them anywhere. (Without a
# usable GPU the CUDA_TESTS mark skips them, with its own reason.)
ON_GPU = DEVICE == "cuda" and SKIP_REASON is None
needs_sm90 = pytest.mark.skipif(ON_GPU and torch.cuda.get_device_capability() < (9, 0),
                                reason="FP8 kernels need sm_90 (Hopper) or newer")


def randn(*shape, dtype=torch.float32, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """Fresh normal values made in fp32 on the test device, then cast (the same values for every dtype
    of a seed)."""
    return (torch.randn(shape, device=DEVICE) * scale + shift).to(dtype)


def check(out, ref_fn, args, kwargs=None, atol=None) -> None:
    """The CPU tests' bound: error vs the float64 run of `ref_fn` <= 2x PyTorch's own error at the
    input precision (both computed on the test device) + atol."""
    assert_matches_reference(out, ref_fn, args, kwargs, atol=atol, interpreted=INTERPRETED)
