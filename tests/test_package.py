"""Packaging promises: the entry point finds the backend, importing the package has no side effects."""
import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_import_has_no_side_effects():
    out = _run("""
        import sys, torch
        import torch._inductor.config as ic
        before = {k: v for k, v in ic.get_config_copy().items() if isinstance(v, (bool, int, float, str))}
        import ffl_backend
        after = {k: v for k, v in ic.get_config_copy().items() if isinstance(v, (bool, int, float, str))}
        print("transformers" in sys.modules, before == after, hasattr(torch.ops.fastflow, "rms_norm"))
    """)
    assert out.split() == ["False", "True", "False"]


def test_entry_point_backend_works_without_importing_ffl_backend():
    out = _run("""
        import sys, torch
        assert "fastflow" in torch._dynamo.list_backends()
        def f(x, w):
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return w * h.to(x.dtype)
        x, w = torch.randn(3, 64), torch.nn.Parameter(torch.randn(64))
        compiled = torch.compile(f, backend="fastflow", options={"inductor": False})
        torch.testing.assert_close(compiled(x, w), f(x, w))
        import ffl_backend
        print(ffl_backend.last_report().ops["rms_norm"])
    """)
    assert out.strip() == "1"


def test_bad_options_are_clear_errors():
    from ffl_backend.config import BackendOptions

    with pytest.raises(ValueError, match="unknown option"):
        BackendOptions.parse(options={"pattern": ["rms_norm"]})
    with pytest.raises(ValueError, match="unknown pattern families"):
        BackendOptions.parse(options={"patterns": ["rmsnorm"]})
    with pytest.raises(ValueError, match="unknown mode"):
        BackendOptions.parse(mode="max-autotune-everything")
    with pytest.raises(ValueError, match="disagree"):
        BackendOptions.parse(mode="max-autotune", options={"mode": "default"})


def test_every_torch_compile_mode_is_accepted():
    """torch.compile's modes, given as mode= or (with other options) as options["mode"], stand for
    Inductor's own settings of that mode; "reduce-overhead" on CPU adds the C++ wrapper."""
    from torch._inductor import list_mode_options

    from ffl_backend.config import CPU_REDUCE_OVERHEAD_CONFIG, MODES, BackendOptions

    assert set(MODES) == set(list_mode_options())
    for mode in (None, *MODES):
        with_options = BackendOptions.parse(options={"mode": mode, "on_error": "raise"})
        for opts in (BackendOptions.parse(mode=mode), with_options):
            patches = opts.inductor_patches("cuda")
            assert all(patches[k] == v for k, v in list_mode_options(mode or "default").items())
    cpu = BackendOptions.parse(mode="reduce-overhead").inductor_patches("cpu")
    assert all(cpu[k] == v for k, v in CPU_REDUCE_OVERHEAD_CONFIG.items()) and "triton.cudagraphs" not in cpu
    assert not BackendOptions.parse().inductor_patches("cpu").get("cpp_wrapper")
    user = BackendOptions.parse(mode="reduce-overhead", options={"inductor_config": {"cpp_wrapper": False}})
    assert user.inductor_patches("cpu")["cpp_wrapper"] is False  # the user's own patches win
