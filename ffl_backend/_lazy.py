"""Lazy package attributes: a name loads its module on first use, so importing a package stays
cheap and side-effect free (no transformers, triton or op registration at import)."""
from importlib import import_module
from importlib.util import find_spec


def lazy_getattr(package: str, names: dict):
    """A module-level `__getattr__` resolving `names[attr]` (a submodule path) on first access;
    other names load the submodule of that name, if there is one."""
    package_globals = import_module(package).__dict__

    def __getattr__(name):
        if name in names:
            value = getattr(import_module(f"{package}.{names[name]}"), name)
            package_globals[name] = value
            return value
        if not name.startswith("_") and find_spec(f"{package}.{name}") is not None:
            return import_module(f"{package}.{name}")  # a subpackage, e.g. ffl_backend.quant
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
