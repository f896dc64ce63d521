"""Your own fused op and pattern family: fastflow learns "quick GELU", `x * sigmoid(1.702 x)` (CLIP's
activation, transformers' QuickGELUActivation), which none of its built-in families knows.

    .venv/bin/python examples/custom_pattern.py

1. `ffl_backend.register_op`: `torch.ops.fastflow_user.quick_gelu` from a pure-torch reference, a CPU
   path and a Triton kernel (used on CUDA only);
2. `ffl_backend.register_pattern`: Dynamo graphs computing `x * torch.sigmoid(1.702 * x)` call it;
3. compile a small MLP with backend="fastflow", check it against eager, print the fusion report;
4. compile again with the family disabled by option: the activation stays as written.
See docs/extending.md.
"""
import torch
from torch import nn

import ffl_backend

try:  # the Triton kernel is optional: without Triton the op runs its CPU path or reference
    import triton
    import triton.language as tl
except ImportError:
    triton = None

ALPHA = 1.702


def quick_gelu_ref(x: torch.Tensor) -> torch.Tensor:
    """The op's meaning: bf16/fp16 inputs are computed in fp32 and rounded once."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    return (h * torch.sigmoid(ALPHA * h)).to(x.dtype)


def quick_gelu_cpu(x: torch.Tensor) -> torch.Tensor:
    """The same math with one temporary instead of three (the sigmoid and product in place)."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.mul(h, ALPHA).sigmoid_().mul_(h).to(x.dtype)


if triton is not None:

    @triton.jit
    def _quick_gelu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # x * sigmoid(a x) = x / (1 + e^(-a x)): for x -> -inf the exponential overflows to inf and
        # the quotient is -0, not NaN
        y = x / (1.0 + tl.exp(-1.702 * x))
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def quick_gelu_triton(x: torch.Tensor) -> torch.Tensor:
    """One program per 1024 elements, fp32 math (float64 keeps the reference's precision)."""
    if x.dtype == torch.float64:
        return quick_gelu_ref(x)
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        _quick_gelu_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


def pattern(x):
    return x * torch.sigmoid(ALPHA * x)  # spelled as the model spells it


def replacement(x):
    return torch.ops.fastflow_user.quick_gelu(x)


def floating_input(match: ffl_backend.PatternMatch):
    """Rewrite only floating-point activations; a decline is counted in the fusion report."""
    x = match.value("x")
    return (x is not None and x.is_floating_point()) or "not a floating-point tensor"


def register() -> None:
    # replace=True: running this twice in one process (a notebook) redefines instead of failing
    ffl_backend.register_op("quick_gelu", quick_gelu_ref, cpu=quick_gelu_cpu,
                            triton=quick_gelu_triton if triton is not None else None, replace=True)
    ffl_backend.register_pattern("quick_gelu", pattern, replacement, anchor="sigmoid", check=floating_input,
                                 replace=True)


class Block(nn.Module):
    """A pre-norm MLP block with CLIP's activation."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.fc1(self.norm(x))
        return x + self.fc2(h * torch.sigmoid(ALPHA * h))


def compile_and_check(model, x, expected, options=None):
    """Compile `model` with fastflow, check it against eager and return the graph's fusion report."""
    # Dynamo keeps compiled graphs per code object: a registration or option change reaches a
    # function compiled before it only after a reset
    torch.compiler.reset()
    compiled = torch.compile(model, backend="fastflow", options=options or {})
    torch.testing.assert_close(compiled(x), expected)
    return ffl_backend.last_report()


def main() -> None:
    register()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(Block(48, 136), Block(48, 136)).to(device).eval()
    x = torch.randn(3, 7, 48, device=device)
    # no_grad: fastflow's ops have no backward, so graphs that need gradients keep their own ops
    with torch.no_grad():
        expected = model(x)
        fused = compile_and_check(model, x, expected)
        print("fused:   ", fused.summary())
        print("          ops", dict(fused.ops))
        assert fused.matches["quick_gelu"] == 2 and fused.ops["fastflow_user::quick_gelu"] == 2
        plain = compile_and_check(model, x, expected, {"disable_patterns": ["quick_gelu"]})
        print("disabled:", plain.summary())
        assert plain.matches["quick_gelu"] == 0 and not plain.ops.get("fastflow_user::quick_gelu")
    print("outputs equal eager; quick_gelu fused twice, and not at all when disabled")


if __name__ == "__main__":
    main()
