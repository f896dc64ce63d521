"""The CPU kernels' other instruction-set paths. cpu_gemv.cpp has an AVX-512 (VNNI) path, an AVX2 path
and a portable one; a build for this machine (-march=native) runs only one of them, and one process
can load only one `fastflow_cpu` library. So each other path this CPU can run is built (FFL_CPU_MARCH)
and its reference-equality tests run in a process of their own."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ffl_backend.kernels import cpu_gemv

pytestmark = pytest.mark.skipif(not cpu_gemv.load(), reason=f"CPU GEMV kernel not built: {cpu_gemv.load_error()}")

ROOT = Path(__file__).resolve().parents[2]
# -march level -> the CPU flags it needs (the ones the kernel's paths test for)
LEVELS = {"x86-64": (), "x86-64-v3": ("avx2", "fma")}
KERNEL_TESTS = [str(Path(__file__).with_name(name)) for name in ("test_cpu_gemv.py", "test_cpu_int4_gemv.py")]
SELECTION = "matches_reference or overflow or zero_group or threads or rows_shape"


def _cpu_has(flags) -> bool:
    words = set(cpu_gemv._cpu_flags().split())
    return all(f in words for f in flags)


@pytest.mark.parametrize("march", sorted(LEVELS))
def test_other_instruction_set_paths_match_the_reference(march):
    if not _cpu_has(LEVELS[march]):
        pytest.skip(f"this CPU cannot run -march={march}")
    env = {**os.environ, "FFL_CPU_MARCH": march}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS,
                             "-k", SELECTION], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]


def test_layer_benchmark_times_every_kernel(monkeypatch):
    """benchmarks/cpu_gemv_layers.py (the per-layer figures in the README) runs: one layer, all six kernels."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cpu_gemv_layers", ROOT / "benchmarks" / "cpu_gemv_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "LAYERS", 1)
    row = module.measure(group_size=64)
    assert len(row["ms_per_pass"]) == 6 and row["march"] == cpu_gemv.target_arch()
    assert all(t["min_ms"] > 0 for t in row["ms_per_pass"].values())


def test_decode_overhead_benchmark_swaps_the_gemv_kernels_and_puts_them_back():
    """benchmarks/decode_overhead.py (the README's split of a decode step): its stubs take the compiled
    graph's GEMV calls in the null rounds, and the real kernels are in place afterwards."""
    import importlib.util

    from ffl_backend.generation import configure_generate
    from ffl_backend.quant import quantize
    from tests.tiny_models import tiny_model

    spec = importlib.util.spec_from_file_location("decode_overhead", ROOT / "benchmarks" / "decode_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    real = (torch.ops.fastflow_cpu.gemv, torch.ops.fastflow_cpu.int4_gemv)
    model = tiny_model("llama", dtype=torch.bfloat16)
    quantize(model, "int8")
    configure_generate(model, backend="fastflow", max_cache_len=16)
    sets = module._kernel_sets()
    row = module.split_step(model, torch.tensor([[1, 2, 3, 4]]), rounds=2, new_tokens=6, sets=sets)
    assert sets["null"][0].calls > 0  # the int8 layers' and the lm_head's GEMVs went to the stub
    assert (torch.ops.fastflow_cpu.gemv, torch.ops.fastflow_cpu.int4_gemv) == real
    assert all(len(v) == 2 and min(v) > 0 for v in row["ms_per_step_all"].values())
