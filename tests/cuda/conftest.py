"""The GPU tests run from a source tree too (scripts/gpu_check.sh puts the repo on PYTHONPATH and
installs nothing), where no entry point makes `backend="fastflow"` known to torch.compile. Under the
GPU check's time budget (`FFL_TESTS_DEADLINE`, epoch seconds) the tests still to run past it are
skipped with that reason, so pytest ends on time and writes its report."""
import os
import time

import pytest


@pytest.fixture(scope="session", autouse=True)
def _fastflow_backend():
    from ffl_backend.backend import register_without_install

    register_without_install()
    yield


def pytest_runtest_setup(item):
    deadline = os.environ.get("FFL_TESTS_DEADLINE")
    if deadline and time.time() > float(deadline):
        pytest.skip("the GPU check's time budget for the tests is spent (scripts/gpu_check.sh)")
