"""The extension API (docs/extending.md): register_op makes `torch.ops.fastflow_user.*` ops,
register_pattern adds pattern families that the options name, the report counts and the pass manager
falls back from like the built-ins; examples/custom_pattern.py runs."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ffl_backend
from ffl_backend.config import BackendOptions
from ffl_backend.patterns import registry
from tests.helpers import DTYPES, acc_dtype, assert_matches_reference

ROOT = Path(__file__).resolve().parents[2]
OP = "ext_sq_relu"


def sq_relu_ref(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 in fp32 for bf16/fp16 (float64 stays float64: the tests' exact reference)."""
    return torch.relu(x.to(acc_dtype(x))).square().to(x.dtype)


cpu_calls = []


def sq_relu_cpu(x: torch.Tensor) -> torch.Tensor:
    cpu_calls.append(x.shape)
    return sq_relu_ref(x)


def sq_relu(x):  # the model's spelling, and the pattern
    return torch.relu(x) ** 2


def to_op(x):
    return getattr(torch.ops.fastflow_user, OP)(x)


@pytest.fixture(scope="module", autouse=True)
def op():
    return ffl_backend.register_op(OP, sq_relu_ref, cpu=sq_relu_cpu, replace=True)


@pytest.fixture(autouse=True)
def _unregister():
    """Each test registers its own families; none outlives it (placed ones go first)."""
    yield
    for name in reversed(registry.registered_families()):
        ffl_backend.unregister_pattern(name)


def _compile(fn, **options):
    ffl_backend.clear_reports()
    return torch.compile(fn, backend="fastflow", options={"inductor": False, **options})


def two_sites(x, y):
    return sq_relu(x) + sq_relu(y).sum(-1, keepdim=True)


def _inputs():
    return torch.randn(5, 123), torch.randn(5, 17)


@pytest.mark.parametrize("dtype", DTYPES)
def test_registered_op_matches_its_reference_on_its_cpu_path(op, dtype):
    x = torch.randn(5, 123, 7, dtype=dtype)
    cpu_calls.clear()
    assert_matches_reference(op(x), sq_relu_ref, (x,), interpreted=False)
    assert cpu_calls == [x.shape]
    torch.library.opcheck(op.default, (x,))


def test_op_without_cpu_path_runs_its_reference_and_a_given_fake_traces():
    def fake(x):
        return torch.empty_like(x)

    op = ffl_backend.register_op("ext_plain", sq_relu_ref, fake=fake, replace=True)
    x = torch.randn(3, 31, dtype=torch.float64)
    torch.testing.assert_close(op(x), sq_relu_ref(x), rtol=0, atol=0)
    assert op(torch.empty(2, 9, device="meta")).shape == (2, 9)


@pytest.mark.parametrize("inductor", [False, True])
def test_registered_pattern_is_applied_and_reported(inductor):
    ffl_backend.register_pattern("sq_relu", sq_relu, to_op, anchor="relu")
    x, y = _inputs()
    with torch.no_grad():
        out = _compile(two_sites, inductor=inductor)(x, y)
    torch.testing.assert_close(out, two_sites(x, y))
    rep = ffl_backend.last_report()
    assert rep.matches["sq_relu"] == 2 and rep.ops[f"fastflow_user::{OP}"] == 2 and not rep.fallbacks
    assert "sq_relu=2" in rep.summary() and rep.as_dict()["matches"]["sq_relu"] == 2


def test_registration_reaches_graphs_compiled_after_it():
    """Dynamo serves an already-compiled graph until it recompiles: register, then reset."""
    x, y = _inputs()
    compiled = _compile(two_sites)
    compiled(x, y)
    ffl_backend.register_pattern("sq_relu", sq_relu, to_op)
    compiled(x, y)
    assert len(ffl_backend.fusion_reports()) == 1  # the cached graph ran, unrewritten
    torch.compiler.reset()
    compiled(x, y)
    assert ffl_backend.last_report().matches["sq_relu"] == 2


def test_anchor_gates_the_family():
    ffl_backend.register_pattern("sq_relu", sq_relu, to_op, anchor="no_such_op")
    ffl_backend.register_pattern("sq_relu_fn", sq_relu, to_op, anchor=torch.relu)
    _compile(two_sites)(*_inputs())
    rep = ffl_backend.last_report()
    assert rep.matches["sq_relu"] == 0 and rep.matches["sq_relu_fn"] == 2


@pytest.mark.parametrize("options", [{"patterns": ["rms_norm"]}, {"disable_patterns": ["sq_relu"]},
                                     {"disable_patterns": "sq_relu"}])
def test_registered_family_is_disabled_by_option(options):
    ffl_backend.register_pattern("sq_relu", sq_relu, to_op)
    x, y = _inputs()
    torch.testing.assert_close(_compile(two_sites, **options)(x, y), two_sites(x, y))
    rep = ffl_backend.last_report()
    assert rep.matches["sq_relu"] == 0 and not rep.ops


def test_builtin_family_is_disabled_by_name():
    def swiglu(g, u):
        return F.silu(g) * u

    _compile(swiglu, disable_patterns=["gated_act"])(torch.randn(3, 40), torch.randn(3, 40))
    assert not ffl_backend.last_report().ops
    assert "gated_act" not in BackendOptions.parse(options={"disable_patterns": ["gated_act"]}).patterns


def test_default_patterns_follow_registration():
    assert "sq_relu" not in BackendOptions.parse().patterns
    ffl_backend.register_pattern("sq_relu", sq_relu, to_op)
    assert BackendOptions.parse().patterns[-1] == "sq_relu"
    ffl_backend.unregister_pattern("sq_relu")
    assert "sq_relu" not in BackendOptions.parse().patterns


def test_placement_lets_a_family_claim_sites_before_a_builtin():
    def swiglu(g, u):
        return F.silu(g) * u

    def mine(g, u):
        return torch.ops.fastflow.silu_mul(g, u)

    ffl_backend.register_pattern("first", swiglu, mine, before="gated_act")
    ffl_backend.register_pattern("after_first", sq_relu, to_op, after="first")
    ffl_backend.register_pattern("second", sq_relu, to_op, after="first")
    order = ffl_backend.pattern_families()
    assert order[order.index("gated_act") - 3:order.index("gated_act") + 1] == (
        "first", "after_first", "second", "gated_act")
    _compile(swiglu)(torch.randn(3, 40), torch.randn(3, 40))
    rep = ffl_backend.last_report()
    assert rep.matches["first"] == 1 and rep.matches["gated_act"] == 0


def test_check_declines_are_counted_and_see_values():
    seen = []

    def wide_only(match):
        x = match.value("x")
        seen.append((x.shape, match.tensor("x") is not None, len(match.nodes)))
        return x.shape[-1] >= 64 or f"only {x.shape[-1]} wide"

    ffl_backend.register_pattern("sq_relu", sq_relu, to_op, check=wide_only)
    ffl_backend.register_pattern("never", sq_relu, to_op, check=lambda match: False)
    x, y = _inputs()
    torch.testing.assert_close(_compile(two_sites)(x, y), two_sites(x, y))
    rep = ffl_backend.last_report()
    assert rep.matches["sq_relu"] == 1 and rep.declined["sq_relu"] == 1
    assert ("sq_relu", "only 17 wide") in {(f, why) for f, _, why in rep.reasons}
    assert rep.declined["never"] == 1 and any(f == "never" and "declined" in why for f, _, why in rep.reasons)
    assert sorted(seen) == [((5, 17), True, 2), ((5, 123), True, 2)]  # graph inputs: real tensors too


def test_values_of_rewritten_nodes_reach_later_families():
    """A rewrite records Dynamo's example value on its new nodes, so a later family's check can read it."""
    values = []
    ffl_backend.register_pattern("sq_relu", sq_relu, to_op)
    ffl_backend.register_pattern("doubled", lambda y: y * 2, lambda y: y + y,
                                 check=lambda m: values.append((m.inputs["y"].target, m.value("y"))) or True)
    _compile(lambda x: sq_relu(x) * 2)(torch.randn(4, 9))
    assert ffl_backend.last_report().matches["doubled"] == 1
    (target, value), = values
    assert target is getattr(torch.ops.fastflow_user, OP) and value.shape == (4, 9)


def _raise_in_trace(x):
    raise RuntimeError("boom")


def _op_without_fake():
    """An op whose fake implementation raises: the rewrite has happened when the pass fails."""
    def broken_fake(x):
        raise RuntimeError("boom (fake)")

    ffl_backend.register_op("ext_no_fake", sq_relu_ref, fake=broken_fake, replace=True)
    return lambda x: torch.ops.fastflow_user.ext_no_fake(x)


@pytest.mark.parametrize("inductor", [False, True])
@pytest.mark.parametrize("make_replacement", [lambda: _raise_in_trace, _op_without_fake], ids=["trace", "fake"])
def test_failing_replacement_falls_back(make_replacement, inductor):
    ffl_backend.register_pattern("sq_relu", sq_relu, make_replacement())
    x, y = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(_compile(two_sites, inductor=inductor)(x, y), two_sites(x, y))
    rep = ffl_backend.last_report()
    assert "boom" in rep.fallbacks["sq_relu"] and rep.matches["sq_relu"] == 0 and not rep.ops


def test_on_error_raise_reraises():
    ffl_backend.register_pattern("sq_relu", sq_relu, _raise_in_trace)
    with pytest.raises(Exception, match="boom"):
        _compile(two_sites, on_error="raise")(*_inputs())


def test_bad_registrations_are_clear_errors():
    ffl_backend.register_pattern("sq_relu", sq_relu, to_op)
    cases = [  # (name, arguments replacing the good ones, error)
        ("sq_relu", {}, "already registered"),
        ("rotary", {}, "built-in"),
        ("not a name", {}, "identifier"),
        ("x1", {"after": "nope"}, "not 'nope'"),
        ("x2", {"before": "rotary", "after": "rms_norm"}, "not both"),
        ("x3", {"replacement": lambda x, y: x}, "same inputs"),
        ("x4", {"check": "yes"}, "must be callable"),
        ("x5", {"anchor": 3}, "anchor must be"),
    ]
    for name, changes, message in cases:
        args = {"pattern": sq_relu, "replacement": to_op, **changes}
        with pytest.raises((ValueError, TypeError), match=message):
            ffl_backend.register_pattern(name, args.pop("pattern"), args.pop("replacement"), **args)
    ffl_backend.register_pattern("sq_relu", sq_relu, to_op, replace=True)  # redefining is allowed
    with pytest.raises(ValueError, match="does not trace"):
        ffl_backend.register_pattern("x6", lambda x: x if x.sum() > 0 else -x, to_op)
    with pytest.raises(ValueError, match="already registered"):
        ffl_backend.register_op(OP, sq_relu_ref)


def test_unknown_names_are_clear_errors():
    ffl_backend.register_pattern("sq_relu", sq_relu, to_op)
    ffl_backend.register_pattern("later", sq_relu, to_op, after="sq_relu")
    for key in ("patterns", "disable_patterns"):
        with pytest.raises(ValueError, match=f"{key}: unknown pattern families \\['sq_rlu'\\]"):
            BackendOptions.parse(options={key: ["sq_relu", "sq_rlu"]})
    with pytest.raises(ValueError, match="no registered pattern family"):
        ffl_backend.unregister_pattern("sq_rlu")
    with pytest.raises(ValueError, match="disable_patterns"):
        ffl_backend.unregister_pattern("rotary")
    with pytest.raises(ValueError, match="unregister them first"):
        ffl_backend.unregister_pattern("sq_relu")


@pytest.mark.slow
def test_example_runs():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_pattern.py")], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "quick_gelu=2" in proc.stdout and "outputs equal eager" in proc.stdout


@pytest.mark.parametrize("dtype", DTYPES)
def test_example_kernels_match_the_reference(dtype):
    """The example's CPU path on the machine, its Triton kernel under the interpreter (conftest)."""
    spec = importlib.util.spec_from_file_location("custom_pattern", ROOT / "examples" / "custom_pattern.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    x = torch.randn(5, 123, dtype=dtype)
    x[0, :3] = torch.tensor([-1e4, 1e4, 0.0])  # far tails: -0 and x, never NaN
    assert_matches_reference(example.quick_gelu_cpu(x), example.quick_gelu_ref, (x,), interpreted=False)
    if example.triton is None:
        pytest.skip("triton is not installed")
    assert_matches_reference(example.quick_gelu_triton(x), example.quick_gelu_ref, (x,))
