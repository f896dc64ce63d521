"""`torch.ops.fastflow_cpu.argmax`: a decode step's greedy token, the index of the largest logit.

torch's argmax over a vocabulary-sized row is not vectorized on CPU; the C++ op (cpu_argmax.cpp says
how) is. Its reference is torch.argmax itself: the first index of the maximum, a NaN counting as
the maximum.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import cpu_lib


def argmax_ref(logits: Tensor) -> Tensor:
    return logits.argmax(-1)


@cpu_lib.fake("argmax")
def _fake_argmax(logits: Tensor) -> Tensor:
    return logits.new_empty(logits.shape[:-1], dtype=torch.long)


def applies(x: Tensor) -> bool:
    """Whether `greedy_token` may take the C++ op for logits on x's device (asked outside a trace: the
    answer is a plain bool the traced step is specialized on)."""
    return x.device.type == "cpu" and cpu_lib.load()


def greedy_token(logits: Tensor, kernel: bool) -> Tensor:
    """argmax over the last dim: the C++ op when `kernel` (see `applies`), else torch's."""
    return torch.ops.fastflow_cpu.argmax(logits) if kernel else argmax_ref(logits)
