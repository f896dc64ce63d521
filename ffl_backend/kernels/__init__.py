"""Fused ops, one module each: a pure-torch reference (HF cast order), a Triton kernel for CUDA, and
the `torch.ops.fastflow.<op>` registration. `load_all()` imports (and so registers) every op."""
from importlib import import_module

KERNEL_MODULES = ("rms_norm", "layer_norm", "gated_act", "rotary", "gelu_residual", "packed_linear")


def load_all() -> None:
    """Import (and so register) every kernel module; cheap after the first call."""
    for name in KERNEL_MODULES:
        import_module(f"{__name__}.{name}")

