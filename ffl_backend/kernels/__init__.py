"""Fused ops, one module each: a pure-torch reference (HF cast order), a CPU path, a Triton kernel for
CUDA and the `torch.ops.fastflow.<op>` registration. OP_MODULES is the one list of them: loading,
ahead-of-time compilation (aot.py) and the tests read it. Importing this package registers nothing."""
from importlib import import_module

# Every module that registers `torch.ops.fastflow.*` ops (the attention ops live in ffl_backend.attention).
OP_MODULES = (
    "ffl_backend.kernels.rms_norm", "ffl_backend.kernels.layer_norm", "ffl_backend.kernels.gated_act",
    "ffl_backend.kernels.rotary", "ffl_backend.kernels.gelu_residual", "ffl_backend.kernels.packed_linear",
    "ffl_backend.kernels.quant_linear", "ffl_backend.attention.prefill", "ffl_backend.attention.decode",
    "ffl_backend.attention.paged",
)


def load_all() -> None:
    """Import (and so register) every op; cheap after the first call."""
    for name in OP_MODULES:
        import_module(name)


def triton_modules() -> tuple:
    """The op modules with Triton kernels: those that list their launch configs (`aot_specs()`)."""
    return tuple(name for name in OP_MODULES if hasattr(import_module(name), "aot_specs"))
