"""Fixtures of the kernel tests."""
import pytest

from ffl_backend.kernels import autotune


@pytest.fixture
def tuning(tmp_path, monkeypatch):
    """An empty autotune cache of this test's own, searching on: the path of its JSON file."""
    monkeypatch.setenv("FFL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FFL_AUTOTUNE", "1")
    monkeypatch.setattr(autotune, "_memory", {})
    return tmp_path / "autotune.json"
