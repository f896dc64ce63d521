"""The fastflow_cpu library's loader: every op the C++ sources define has a fake declared by its op
module, and loading the library builds and registers only -- the timed prefetch search waits for the
GEMVs' first use (cpu_gemv.ready)."""
import os
import re
import subprocess
import sys

import pytest

from ffl_backend import kernels, paths
from ffl_backend.kernels import cpu_lib

UTILITY_OPS = {"set_prefetch", "set_null_kernels"}  # switches, never traced: no fake


def _defined_ops() -> set:
    names = set()
    for source in cpu_lib.SOURCES:
        names |= set(re.findall(r'm\.def\(\s*"(\w+)\(', source.read_text()))
    return names - UTILITY_OPS


def test_every_cpp_op_has_a_fake_from_its_module():
    kernels.load_all()  # every op module, so every declared fake
    assert _defined_ops() and set(cpu_lib.faked_ops()) == _defined_ops()


def test_sources_are_every_cpp_file_beside_the_loader():
    folder = os.path.dirname(cpu_lib.__file__)
    assert {p.name for p in cpu_lib.SOURCES} == {n for n in os.listdir(folder) if n.endswith(".cpp")}


@pytest.mark.skipif(not cpu_lib.load(), reason=f"CPU kernels not built: {cpu_lib.load_error()}")
def test_loading_times_nothing_and_first_use_tunes(tmp_path):
    """A fresh process with an empty autotune cache (the built library linked in): load() leaves the
    default prefetch distances and writes no choice; cpu_gemv.ready() then searches and sets one."""
    (tmp_path / "cpu_kernels").symlink_to(paths.cache_dir() / "cpu_kernels")
    script = (
        "import json, torch\n"
        "from ffl_backend.kernels import autotune, cpu_gemv, cpu_lib\n"
        "assert cpu_lib.load()\n"
        "default = list(map(int, autotune.PREFETCH_CHOICES[0].split('/')))\n"
        "assert list(torch.ops.fastflow_cpu.set_prefetch(*default)) == default\n"
        "assert not autotune.cache_file().exists()\n"
        "autotune.tune_prefetch.__defaults__ = (2, 1)  # a small search: 2 MB, one round\n"
        "assert cpu_gemv.ready()\n"
        "print(json.loads(autotune.cache_file().read_text()))\n")
    env = {**os.environ, "FFL_CACHE_DIR": str(tmp_path), "FFL_AUTOTUNE": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cpu_gemv_prefetch[2]" in out.stdout
