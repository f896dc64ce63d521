"""Fused ops, one module each: a pure-torch reference (HF cast order), a CPU path, a Triton kernel for
CUDA and the `torch.ops.fastflow.<op>` registration (C++-backed ops: also their fake, cpu_lib.py).
`op_modules()` finds them -- every module of this package and of ffl_backend.attention, so a new op
module is listed by being there: loading, ahead-of-time compilation (aot.py) and the tests read it.
Importing this package registers nothing."""
import functools
import pkgutil
from importlib import import_module

OP_PACKAGES = ("ffl_backend.kernels", "ffl_backend.attention")


@functools.cache
def op_modules() -> tuple:
    """Every module of the op packages (importing one registers its ops; the others register none)."""
    names = []
    for package in OP_PACKAGES:
        path = import_module(package).__path__
        names += [f"{package}.{m.name}" for m in pkgutil.iter_modules(path) if not m.ispkg]
    return tuple(sorted(names))


def load_all() -> None:
    """Import (and so register) every op; cheap after the first call."""
    for name in op_modules():
        import_module(name)


def triton_modules() -> tuple:
    """The op modules with Triton kernels: those that define their launch configs (`aot_specs()`)."""
    def own_specs(name: str) -> bool:
        specs = getattr(import_module(name), "aot_specs", None)
        return specs is not None and specs.__module__ == name

    return tuple(name for name in op_modules() if own_specs(name))
