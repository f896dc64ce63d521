"""The autotune cache: a miss searches and writes, a hit reads without timing, a corrupt file is set
aside with a warning and searched again, FFL_AUTOTUNE=0 keeps the default; the rows from which
quantized linears widen their weight land in the cache; the CPU GEMVs' prefetch distances are
searched, set and read back."""
import json
import logging

import pytest
import torch

from ffl_backend.kernels import autotune
from ffl_backend.kernels import quant_linear as K


def _timer(costs: dict, calls: list):
    def measure(candidate):
        calls.append(candidate)
        return costs[candidate]
    return measure


def test_miss_searches_and_writes_then_hit_reads_without_timing(tuning, caplog):
    calls = []
    with caplog.at_level(logging.INFO, logger="ffl_backend"):
        assert autotune.choose("tile", (64, 32), [1, 2, 4], _timer({1: 3.0, 2: 1.0, 4: 2.0}, calls)) == 2
    assert calls == [1, 2, 4] and "tile[64, 32] -> 2" in caplog.text
    saved = json.loads(tuning.read_text())
    assert saved == {autotune.machine_key(): {"tile[64, 32]": 2}}
    autotune._memory.clear()  # a new process: read from the file
    assert autotune.choose("tile", (64, 32), [1, 2, 4], _timer({}, calls)) == 2 and calls == [1, 2, 4]
    assert autotune.choose("tile", (64, 16), [1, 2, 4], _timer({1: 1.0, 2: 5.0, 4: 5.0}, calls)) == 1


def test_corrupt_file_is_set_aside_and_searched_again(tuning, caplog):
    tuning.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="ffl_backend"):
        assert autotune.choose("tile", (8,), [1, 2], _timer({1: 2.0, 2: 1.0}, [])) == 2
    assert "unreadable" in caplog.text and tuning.with_suffix(".corrupt").exists()
    assert json.loads(tuning.read_text())[autotune.machine_key()] == {"tile[8]": 2}


def test_disabled_keeps_the_default_without_timing(tuning, monkeypatch):
    monkeypatch.setenv("FFL_AUTOTUNE", "0")
    calls = []
    assert autotune.choose("tile", (8,), [4, 2], _timer({4: 9.0, 2: 1.0}, calls)) == 4
    assert calls == [] and not tuning.exists()


def test_a_cached_choice_that_is_no_longer_a_candidate_is_searched_again(tuning):
    tuning.write_text(json.dumps({autotune.machine_key(): {"tile[8]": 7}}))
    assert autotune.choose("tile", (8,), [1, 2], _timer({1: 2.0, 2: 1.0}, [])) == 2


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_widen_threshold_is_searched_once_per_shape(tuning, kind):
    from ffl_backend.kernels import cpu_lib

    if kind == "int4" and not cpu_lib.load():
        pytest.skip(f"CPU kernels not built: {cpu_lib.load_error()}")
    rows = K.widen_min_rows(kind, 64, 128)
    assert rows in K.WIDEN_ROW_CHOICES
    saved = json.loads(tuning.read_text())[autotune.machine_key()]  # (with the prefetch search where
    assert saved[f"widen_min_rows:{kind}[64, 128]"] == rows             # the library loaded in this test)
    assert not [key for key in saved if key.startswith("widen") and key != f"widen_min_rows:{kind}[64, 128]"]
    if K.cpu_gemm.available():  # what runs below widening: the GEMM from its own threshold, searched first
        assert saved[f"prompt_gemm_min_rows:{kind}[64, 128]"] in K.cpu_gemm.MIN_ROWS_CHOICES
    x = torch.randn(max(8, min(rows, 256)), 128, dtype=torch.bfloat16)
    assert K._widens(x, kind, 64, 128) == (rows <= x.shape[0] and K.cpu_gemm.native_bf16_matmul())


def test_prefetch_distances_are_searched_once_set_and_then_read(tuning):
    """autotune.tune_prefetch: the search times every candidate round robin, caches the choice and sets
    it in the kernels (set_prefetch returns the distances in force); the next call reads the cache."""
    from ffl_backend.kernels import cpu_lib

    if not cpu_lib.load():
        pytest.skip(f"CPU kernel library unavailable: {cpu_lib.load_error()}")
    try:
        near, far = autotune.tune_prefetch(megabytes=2, rounds=2)
        assert f"{near}/{far}" in autotune.PREFETCH_CHOICES
        assert list(torch.ops.fastflow_cpu.set_prefetch(near, far)) == [near, far]
        saved = json.loads(tuning.read_text())[autotune.machine_key()]
        assert saved == {"cpu_gemv_prefetch[2]": f"{near}/{far}"}
        torch.ops.fastflow_cpu.set_prefetch(0, 0)
        assert autotune.tune_prefetch(megabytes=2) == (near, far)  # from the cache, and set again
        assert list(torch.ops.fastflow_cpu.set_prefetch(near, far)) == [near, far]
    finally:
        default = autotune.PREFETCH_CHOICES[0].split("/")
        torch.ops.fastflow_cpu.set_prefetch(int(default[0]), int(default[1]))


def test_prefetch_search_off_keeps_the_default(monkeypatch):
    from ffl_backend.kernels import cpu_lib

    if not cpu_lib.load():
        pytest.skip(f"CPU kernel library unavailable: {cpu_lib.load_error()}")
    monkeypatch.setenv("FFL_AUTOTUNE", "0")
    assert f"{'/'.join(map(str, autotune.tune_prefetch()))}" == autotune.PREFETCH_CHOICES[0]
