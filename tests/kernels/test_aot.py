"""Every Triton kernel, in every launch config its launcher can pick, compiles to sm_80 and sm_90
cubins on this GPU-less machine (DESIGN.md section 4). Runs in a subprocess: the interpreter that
conftest turns on cannot lower kernels."""
import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from ffl_backend.kernels import triton_modules
from ffl_backend.kernels.aot import collect_specs


@pytest.mark.slow  # measured cost and the fast set's budget: docs/testing.md
def test_every_kernel_config_compiles_for_sm80_and_sm90(tmp_path):
    out = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # a cold cache: really compile
    proc = subprocess.run([sys.executable, "-m", "ffl_backend.kernels.aot", "--arch", "80", "90",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert all(r["ok"] for r in records)
    per_kernel_arch = Counter((r["name"].split("[")[0], r["arch"]) for r in records)
    kernels = {k for k, _ in per_kernel_arch}
    # one entry per fused op family; each config compiled for every architecture it targets
    # (sm_80 and sm_90; FP8 kernels declare min_arch=90), none missing or compiled for one only
    assert len(kernels) >= len(triton_modules())
    expected = Counter((s.name.split("[")[0], arch) for s in collect_specs() for arch in (80, 90)
                       if arch >= s.min_arch)
    assert per_kernel_arch == expected
    assert all(per_kernel_arch[(kernel, 90)] > 0 for kernel in kernels)
    assert all(r["cubin_bytes"] > 0 for r in records)
