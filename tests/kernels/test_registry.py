"""The op registry (kernels.op_modules()) is the one list of fastflow's ops: loading it registers every
`fastflow::` op the package has, and its Triton modules are the ones the AOT compile covers."""
import importlib
import pathlib
import subprocess
import sys

from ffl_backend.kernels import op_modules, triton_modules

CHILD = """
import importlib, pathlib, torch
def ops():
    return {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fastflow::")}
from ffl_backend import kernels
kernels.load_all()
registered = ops()
for path in sorted(pathlib.Path(kernels.__file__).parents[1].rglob("*.py")):
    parts = path.relative_to(pathlib.Path(kernels.__file__).parents[2]).with_suffix("").parts
    if parts[-1] not in ("__main__",) and "demo" not in parts:
        importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
print(sorted(registered)); print(sorted(ops() - registered))
"""


def test_loading_the_registry_registers_every_op_of_the_package():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                         cwd=pathlib.Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    registered, outside = out.stdout.strip().splitlines()[-2:]
    assert "fastflow::rms_norm" in registered and "fastflow::paged_decode" in registered
    assert outside == "[]"  # no module registers a fastflow op the registry does not load


def test_every_triton_module_is_an_op_module_with_launch_configs():
    assert set(triton_modules()) <= set(op_modules())
    for name in triton_modules():
        assert importlib.import_module(name).aot_specs()
