"""Test setup. TRITON_INTERPRET must be set before anything imports triton (transformers does), so
it is set here, at collection, before any test module is imported. FFL_NATIVE_TRITON=1 leaves it
unset: the `cuda` tests on a GPU (scripts/gpu_check.sh) run the compiled kernels, not the interpreter."""
import os

if os.environ.get("FFL_NATIVE_TRITON") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Kernel choices stay the built-in defaults (no timed search, the same on every machine);
# tests/kernels/test_autotune.py turns the search on against a cache folder of its own.
os.environ.setdefault("FFL_AUTOTUNE", "0")

import tempfile  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Inductor's on-disk cache, one per vector ISA (ATEN_CPU_CAPABILITY lowers it): torch 2.13 does not key
# its FX graph cache on it, and C++ generated for 8-wide AVX2 vectors, recompiled for AVX-512, writes
# past its buffers (a suite run after an AVX2-only run on the same machine aborted that way).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor-ffl-tests-{os.getuid()}-{torch.backends.cpu.get_cpu_capability()}"))


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Fresh random inputs per test, reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles for itself: without this, a test that reads the fusion report of its
    compile can be served code Dynamo cached for an earlier test's identical model and see none."""
    torch._dynamo.reset()
    yield


@pytest.fixture(params=["fastflow", "torch"])
def int4_form(request, monkeypatch):
    """Which CPU form int4 modules get: fastflow's kernel layout (where that kernel is built) or
    torch's pack (what machines without it get)."""
    from ffl_backend.kernels import cpu_lib

    if request.param == "torch":
        monkeypatch.setattr(cpu_lib, "load", lambda: False)
    elif not cpu_lib.load():
        pytest.skip(f"CPU kernels not built: {cpu_lib.load_error()}")
    return request.param


@pytest.fixture
def no_fallbacks():
    """Checks every graph fastflow compiles during the test with tests.helpers.assert_no_fallbacks
    at teardown (no pattern family fell back, no anchor op left unfused; none compiled is fine).
    Modules of optimize()/compile tests apply it to every test with
    `pytestmark = pytest.mark.usefixtures("no_fallbacks")`; a test whose model keeps an anchor op on
    purpose asks for the fixture and sets `no_fallbacks.unfused_ok`."""
    from tests.helpers import NoFallbacks

    with NoFallbacks(require_graph=False) as nf:
        yield nf


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow: real models, full-model compiles, measurements")


def pytest_collection_modifyitems(config, items):
    """The default run is the fast set (the README's test command); `--slow` (CI: .ci/run) or an explicit `-m`
    adds the rest."""
    if config.getoption("--slow") or config.getoption("markexpr"):
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        items[:] = [item for item in items if "slow" not in item.keywords]
        config.hook.pytest_deselected(items=slow)


def pytest_report_header(config):
    if not (config.getoption("--slow") or config.getoption("markexpr")):
        return "fast set: tests marked slow are deselected (run them with --slow)"
