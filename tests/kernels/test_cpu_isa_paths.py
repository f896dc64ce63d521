"""The CPU kernels' other instruction-set paths. cpu_gemv.cpp and cpu_gemv_q16.cpp have AVX-512 paths
(with VNNI where the CPU has it: x86-64-v4 builds them without; cpu_gemv_bf16.cpp only with
AVX512-BF16, so only the native build), an AVX2 path and a portable one (cpu_attention.cpp: AVX2 and
portable); a
build for this machine (-march=native) runs only one of them, and one process can load only one
`fastflow_cpu` library. So each other path this CPU can run is built (FFL_CPU_MARCH)
and its reference-equality tests run in a process of their own."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ffl_backend.kernels import cpu_lib

pytestmark = pytest.mark.skipif(not cpu_lib.load(), reason=f"CPU GEMV kernel not built: {cpu_lib.load_error()}")

ROOT = Path(__file__).resolve().parents[2]
# -march level -> the CPU flags it needs (the ones the kernel's paths test for)
LEVELS = {"x86-64": (), "x86-64-v3": ("avx2", "fma"), "x86-64-v4": ("avx512f", "avx512bw", "avx512vl")}
KERNEL_TESTS = [str(Path(__file__).with_name(name)) for name in ("test_cpu_gemv.py", "test_cpu_int4_gemv.py",
                                                                           "test_cpu_gemv_q16.py",
                                                                           "test_cpu_decode_kernels.py",
                                                                           "test_cpu_gemm.py",
                                                                           "test_cpu_quantize.py")]
FAST_LEVELS = ("x86-64", "x86-64-v3")
SELECTION = "matches_reference or overflow or zero_group or zero_rows or threads or rows_shape"


def _cpu_has(flags) -> bool:
    words = set(cpu_lib.cpu_flags().split())
    return all(f in words for f in flags)


# The portable and AVX2 paths -- what most users' CPUs run -- in the fast set; the AVX-512 build without
# VNNI/BF16 with --slow (docs/testing.md). scripts/setup.sh builds each library once per machine.
@pytest.mark.parametrize("march", [m if m in FAST_LEVELS else pytest.param(m, marks=pytest.mark.slow)
                                   for m in sorted(LEVELS)])
def test_other_instruction_set_paths_match_the_reference(march):
    if not _cpu_has(LEVELS[march]):
        pytest.skip(f"this CPU cannot run -march={march}")
    env = {**os.environ, "FFL_CPU_MARCH": march}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS,
                             "-k", SELECTION], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]


def test_layer_benchmark_times_every_kernel(monkeypatch):
    """benchmarks/cpu_gemv_layers.py (the per-layer figures in the docs) runs: one layer, all seven kernels."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cpu_gemv_layers", ROOT / "benchmarks" / "cpu_gemv_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "LAYERS", 1)
    row = module.measure(group_size=64, rows=2)
    assert len(row["ms_per_pass"]) == 7 and row["rows"] == 2 and row["march"] == cpu_lib.target_arch()
    assert all(t["min_ms"] > 0 for t in row["ms_per_pass"].values())


def test_decode_overhead_benchmark_nulls_the_kernels_inside_the_compiled_step():
    """benchmarks/decode_overhead.py (the split of a decode step into kernels and the rest): in its
    null rounds the compiled step's kernels (GEMVs, attention) return zeros -- so every token after
    the prompt's is 0 -- and afterwards they compute again."""
    import importlib.util

    import ffl_backend
    from ffl_backend.quant import quantize
    from tests.helpers import NoFallbacks
    from tests.tiny_models import tiny_model

    spec = importlib.util.spec_from_file_location("decode_overhead", ROOT / "benchmarks" / "decode_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = tiny_model("llama", dtype=torch.bfloat16)
    quantize(model, "int8-all")
    ffl_backend.optimize(model, max_seq_len=32, mode="default")
    ids = torch.tensor([[5, 6, 7, 8]])
    with NoFallbacks():
        row = module.split_step(model, ids, rounds=2, new_tokens=6)
    assert row["null_tokens_all_zero"]
    assert all(len(v) == 2 and min(v) > 0 for v in row["ms_per_step_all"].values())
    with torch.inference_mode():
        assert model.generate(ids, max_new_tokens=6, do_sample=False)[0, 5:].any()  # computing again
