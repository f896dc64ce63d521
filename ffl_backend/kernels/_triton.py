"""What every kernel module shares: lazy Triton access, launch sizing, and ahead-of-time specs.

Triton is imported only when a kernel module is imported (never by `import ffl_backend`), and the
module still imports without Triton so the CPU paths keep working on a machine that lacks it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

try:  # Triton is a declared dependency, but CPU-only users must never be broken by it.
    import triton
    import triton.language as tl
    from torch.library import wrap_triton

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    wrap_triton = None
    HAS_TRITON = False

# The largest row a one-program-per-row kernel holds in registers; wider rows loop over blocks.
MAX_ROW_BLOCK = 8192
# Hidden sizes and head dims the AOT suite compiles for: SmolLM2 (576), the tiny test configs (64),
# and a large model (8192), so every block size and warp count the launchers can pick is covered.
AOT_ROW_SIZES = (64, 576, 2048, 8192, 16384)
AOT_DTYPES = ("fp32", "fp16", "bf16")


def interpreting() -> bool:
    """True when Triton kernels run on CPU tensors through the interpreter (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_triton_device(t) -> bool:
    """Every op's one dispatch test: its Triton kernel serves `t`'s device (CUDA, where Triton is
    installed); any other device takes the op's CPU path."""
    return HAS_TRITON and t.device.type == "cuda"


def row_block(n: int) -> int:
    """Block width for a row of `n` elements: the next power of two, capped at MAX_ROW_BLOCK."""
    return min(MAX_ROW_BLOCK, 1 << max(0, (n - 1).bit_length()))


def row_warps(block: int) -> int:
    """Warps per row program: enough lanes to give each ~8 elements without spilling."""
    return max(1, min(16, block // 256))


def rows_2d(t):
    """A 2-D (rows, cols) view with unit column stride, copying only if the layout needs it. Row
    views such as the halves of a fused gate_up output (`gu[..., :I]`, row stride 2I) stay views."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def launch(kernel, grid, *args, **kwargs):
    """Launch through `wrap_triton` so Inductor sees the kernel when the op is traced."""
    return wrap_triton(kernel)[grid](*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class AotSpec:
    """One launch configuration of a kernel, to be compiled ahead of time for a GPU architecture.

    `signature` maps every argument name to a Triton type ("*bf16", "i32", "fp32", "constexpr");
    `constexprs` gives the values of the constexpr ones; `num_warps` is what the launcher passes.
    """

    name: str
    kernel: Callable[..., Any]
    signature: dict
    constexprs: dict
    num_warps: int = 4
    min_arch: int = 80


def ptr(dtype: str) -> str:
    return "*" + dtype


def row_kernel_specs(name, kernel, ptr_args, scalar_args: dict, flags: dict, dtypes=AOT_DTYPES):
    """AOT specs of a one-row-per-program kernel: every dtype x row block x combination of the
    boolean constexpr `flags` (name -> values). The signature lists pointers, then scalars, then
    constexprs, which is the argument order these kernels declare."""
    import itertools

    blocks = sorted({row_block(n) for n in AOT_ROW_SIZES})
    specs = []
    for dt, block, values in itertools.product(dtypes, blocks, itertools.product(*flags.values())):
        consts = {**dict(zip(flags, values)), "BLOCK": block}
        sig = {**{a: ptr(dt) for a in ptr_args}, **scalar_args, **{k: "constexpr" for k in consts}}
        label = ",".join(f"{k}={v}" for k, v in consts.items())
        specs.append(AotSpec(f"{name}[{dt},{label}]", kernel, sig, consts, num_warps=row_warps(block)))
    return specs
