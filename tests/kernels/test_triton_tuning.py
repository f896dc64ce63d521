"""The quantized-linear Triton kernels' tile search (kernels/triton_tuning.py): every candidate config
computes the reference under the interpreter (so whichever a GPU picks is correct), the search times
each candidate once per shape and GPU and caches the fastest, a cached choice survives the JSON file
(tuples come back as lists), and nothing is searched on CPU tensors or with autotuning off."""
import pytest
import torch

from ffl_backend.kernels import autotune
from ffl_backend.kernels import quant_linear as K
from ffl_backend.kernels import triton_quant as Q
from ffl_backend.kernels import triton_tuning as T
from ffl_backend.quant.modules import pretune_linears
from tests.helpers import assert_matches_reference


def _forced(monkeypatch, config):
    monkeypatch.setattr(T, "launch_config", lambda *args, **kwargs: config)


@pytest.mark.parametrize("m", [3, 33])
def test_every_int8_candidate_matches_the_reference(monkeypatch, m):
    q = torch.randint(-127, 128, (80, 272), dtype=torch.int8)
    args = (torch.randn(m, 272, dtype=torch.float16), q, torch.rand(80, dtype=torch.float16) / 50, None)
    for config in T.candidates(m):
        _forced(monkeypatch, config)
        assert_matches_reference(Q.int8_linear_triton(*args), K.int8_linear_ref, args)


@pytest.mark.parametrize("m,group_size", [(2, 32), (33, 128)])
def test_every_int4_candidate_matches_the_reference(monkeypatch, m, group_size):
    n, k = 48, 256
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scale = torch.rand(n, k // group_size, dtype=torch.bfloat16) / 50
    zero = torch.full((n, k // group_size), 8.0, dtype=torch.bfloat16)
    args = (torch.randn(m, k, dtype=torch.bfloat16), q, scale, zero, group_size, torch.randn(n, dtype=torch.bfloat16))
    configs = T.candidates(m, group_size)
    assert all(bk <= group_size for _, _, bk, _ in configs)
    for config in configs:
        _forced(monkeypatch, config)
        assert_matches_reference(Q.int4_linear_triton(*args), K.int4_linear_ref, args)


def test_search_times_each_candidate_once_per_shape_and_caches_the_fastest(tuning, monkeypatch):
    monkeypatch.setattr(T, "_can_time", lambda x: True)
    monkeypatch.setattr(T, "device_key", lambda index: "Fake GPU | triton 0")
    timed = []
    fastest = T.GEMV_CANDIDATES[2]

    def measure(run, config):
        timed.append(config)
        return 1.0 if config == fastest else 2.0

    x = torch.randn(3, 256)
    assert T.launch_config("w8a16", x, 96, None, run=None, measure=measure) == fastest
    assert timed == list(T.GEMV_CANDIDATES)
    assert T.launch_config("w8a16", torch.randn(4, 256), 96, None, run=None, measure=measure) == fastest
    assert len(timed) == len(T.GEMV_CANDIDATES)  # rows 3 and 4: one bucket, searched once
    monkeypatch.setattr(autotune, "_memory", {})  # a new process: the choice comes back from the file
    assert autotune.cached("triton_w8a16", T._shape(x, 96, None), T.GEMV_CANDIDATES, "Fake GPU | triton 0") == fastest
    assert '"Fake GPU | triton 0"' in tuning.read_text()


def test_cpu_tensors_and_autotune_off_take_the_default(tuning, monkeypatch):
    never = []
    x = torch.randn(40, 256)
    assert T.launch_config("w8a16", x, 96, None, run=None, measure=lambda *a: never.append(a)) == Q.GEMM_CONFIG
    monkeypatch.setenv("FFL_AUTOTUNE", "0")
    monkeypatch.setattr(T, "_can_time", lambda x: True)
    assert T.launch_config("w8a16", x, 96, None, run=None, measure=lambda *a: never.append(a)) == Q.GEMM_CONFIG
    assert never == [] and not tuning.exists()


def test_pretune_runs_nothing_on_a_cpu_model():
    import ffl_backend
    from tests.tiny_models import tiny_model

    model = ffl_backend.quantize(tiny_model("llama").to(torch.bfloat16), "int8")
    assert pretune_linears(model, 4) == 0
