"""Backend behaviour that does not need a model: fallback, options, recompile reporting."""
import logging
import os

import pytest
import torch

import ffl_backend
from ffl_backend.patterns import norms


def rms(x, w):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


def swiglu(g, u):
    return torch.nn.functional.silu(g) * u


def _compile(fn, **options):
    torch._dynamo.reset()
    ffl_backend.clear_reports()
    return torch.compile(fn, backend="fastflow", options={"inductor": False, **options})


@pytest.mark.parametrize("inductor", [False, True])
def test_broken_pattern_falls_back_to_the_original_graph(monkeypatch, caplog, inductor):
    def broken(gm, ctx):
        for node in gm.graph.nodes:  # damage the graph, then fail: the manager must undo both
            if node.op == "call_function":
                node.target = torch.neg
        raise RuntimeError("boom")

    monkeypatch.setattr(norms, "rms_norm_pass", broken)
    x, w = torch.randn(4, 32), torch.nn.Parameter(torch.randn(32))
    with caplog.at_level(logging.WARNING, logger="ffl_backend"), torch.no_grad():
        out = _compile(rms, inductor=inductor)(x, w)  # Inductor: the restored graph must compile
    torch.testing.assert_close(out, rms(x, w))
    rep = ffl_backend.last_report()
    assert "rms_norm" in rep.fallbacks and "boom" in rep.fallbacks["rms_norm"]
    assert rep.matches["rms_norm"] == 0 and rep.unfused["rsqrt"] == 1
    assert "failed" in caplog.text


def test_on_error_raise_surfaces_pattern_bugs(monkeypatch):
    def broken(gm, ctx):
        raise RuntimeError("boom")

    monkeypatch.setattr(norms, "rms_norm_pass", broken)
    with pytest.raises(Exception, match="boom"):
        _compile(rms, on_error="raise")(torch.randn(4, 32), torch.nn.Parameter(torch.randn(32)))


def test_disabled_family_leaves_its_math_alone():
    x, w = torch.randn(4, 32), torch.nn.Parameter(torch.randn(32))
    _compile(rms, patterns=["gated_act"])(x, w)
    rep = ffl_backend.last_report()
    assert rep.ops.get("rms_norm", 0) == 0 and rep.unfused["rsqrt"] == 1


def test_unrecognised_shape_is_declined_with_a_reason():
    def not_rms(x):  # rsqrt of a variance but no weight multiply: not an RMSNorm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    x = torch.randn(4, 32)
    torch.testing.assert_close(_compile(not_rms)(x), not_rms(x))
    rep = ffl_backend.last_report()
    assert rep.matches["rms_norm"] == 0 and rep.declined["rms_norm"] == 1
    assert any(family == "rms_norm" for family, _, _ in rep.reasons)


def test_gated_act_and_report_counts():
    g, u = torch.randn(3, 40), torch.randn(3, 40)
    torch.testing.assert_close(_compile(swiglu)(g, u), swiglu(g, u))
    assert ffl_backend.last_report().ops == {"silu_mul": 1}


def test_recompile_is_reported_with_the_failing_guard():
    compiled = _compile(rms)
    w = torch.nn.Parameter(torch.randn(16))
    compiled(torch.randn(3, 16), w)
    compiled(torch.randn(3, 16), w)
    assert not ffl_backend.recompiles()
    torch._dynamo.config.automatic_dynamic_shapes, old = False, torch._dynamo.config.automatic_dynamic_shapes
    try:
        compiled(torch.randn(5, 16), w)
    finally:
        torch._dynamo.config.automatic_dynamic_shapes = old
    (rec,) = ffl_backend.recompiles()
    assert "size mismatch" in rec.guard_failure


def test_op_counts_include_overload_packet_calls():
    def f(x, w):  # a module calling the packet, as quantized linears do
        return torch.ops.fastflow.rms_norm(x, w, 1e-6) + torch.ops.fastflow.rms_norm.default(x, w, 1e-6)

    _compile(f)(torch.randn(2, 8), torch.randn(8))
    assert ffl_backend.last_report().ops["rms_norm"] == 2


def test_inductor_cache_key_follows_ffl_backend_sources(monkeypatch):
    """A changed ffl_backend source must miss Inductor's on-disk FX graph cache: on CPU our ops are
    traced into the graph, so a stale hit would run an old op body."""
    from torch._dynamo.utils import counters

    from ffl_backend import cache_key

    lin = torch.nn.Linear(24, 8).eval()
    x = torch.randn(1, 24)

    def compile_once():
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            torch.compile(lin, backend="fastflow")(x)
        return dict(counters["inductor"])

    compile_once()
    assert compile_once().get("fxgraph_cache_hit") == 1  # same sources: served from the cache
    new_version = os.urandom(16)  # never seen before, by this run or any earlier one
    monkeypatch.setattr(cache_key, "source_hash", lambda: new_version)
    assert compile_once().get("fxgraph_cache_miss") == 1
    # ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU: code generated for the other vector width must miss
    other_isa = "AVX2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "DEFAULT"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other_isa)
    assert compile_once().get("fxgraph_cache_miss") == 1


def test_inductor_defaults_drop_size_asserts_allow_fma_and_user_patches_win(monkeypatch):
    """fastflow turns off the wrapper's per-call input size asserts (Dynamo's guards already check
    the same static sizes) and lets the C++ compiler contract multiply-adds into FMAs; a user's
    inductor_config still overrides each default."""
    import torch._inductor.compile_fx as cfx

    seen = []
    real = cfx.compile_fx

    def spy(gm, example_inputs, config_patches=None, **kwargs):
        seen.append(dict(config_patches or {}))
        return real(gm, example_inputs, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    lin = torch.nn.Linear(16, 8).eval()
    x = torch.randn(1, 16)
    user = {"size_asserts": True, "cpp.enable_floating_point_contract_flag": "off"}
    for options, expected in (({}, (False, "fast")), ({"inductor_config": user}, (True, "off"))):
        torch._dynamo.reset()
        seen.clear()
        with torch.no_grad():
            out = torch.compile(lin, backend="fastflow", options=options)(x)
        torch.testing.assert_close(out, lin(x))
        outer = seen[0]  # the outer call (compile_fx recurses without patches)
        assert (outer["size_asserts"], outer["cpp.enable_floating_point_contract_flag"]) == expected


def test_configure_generate_enables_fast_guards_and_they_still_catch_changes():
    import torch._dynamo.config as dynamo_config

    from ffl_backend.generation import FAST_GUARD_CONFIG, configure_generate
    from tests.tiny_models import tiny_model

    # config.patch restores the settings afterwards (monkeypatch would delete config entries)
    with dynamo_config.patch({key: dynamo_config.get_config_copy()[key] for key in FAST_GUARD_CONFIG}):
        model = tiny_model("llama")
        configure_generate(model, backend="inductor")
        for key, value in FAST_GUARD_CONFIG.items():
            assert getattr(dynamo_config, key) == value
        # module attribute changes still reach the compiled model: swapping a submodule recompiles
        torch._dynamo.reset()
        ids = torch.randint(3, 128, (1, 5))
        compiled = torch.compile(model, backend="fastflow", options={"inductor": False})
        with torch.no_grad():
            compiled(ids)
            model.model.layers[0].mlp.act_fn = torch.nn.Identity()
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits)


def test_a_graph_that_needs_gradients_compiles_without_fused_ops():
    """fastflow's ops have no backward: with grad enabled and trainable weights the families stand
    aside, and the compiled model trains like the eager one. Inductor's backward sums in its own
    order, so gradients are held to the op tests' bound: error vs a float64 run of the same model
    <= 2x eager fp32's own error + fp32's atol (a fixed default tolerance failed on an AVX2 CPU)."""
    import copy

    from tests.helpers import ATOL
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    exact_model = copy.deepcopy(model).double()
    ids = torch.randint(3, 128, (1, 6))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fastflow")
    out = compiled(ids).logits
    rep = ffl_backend.last_report()
    assert sum(rep.matches.values()) == 0 and ("all", "graph") == rep.reasons[-1][:2]
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager_out = model(ids).logits
    eager_out.sum().backward()
    exact_out = exact_model(ids).logits
    exact_out.sum().backward()
    pairs = [(out, eager_out, exact_out)] + list(zip(grads, (p.grad for p in model.parameters()),
                                                     (p.grad for p in exact_model.parameters())))
    for got, eager, exact in pairs:
        eager_err = (eager.double() - exact).abs().max().item()
        err = (got.double() - exact).abs().max().item()
        assert err <= 2 * eager_err + ATOL[torch.float32], (err, eager_err)

