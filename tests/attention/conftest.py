"""Each test compiles its own models; Module.__call__ is one code object for all of them, so start
every test with Dynamo's caches empty rather than run into its per-code recompile limit."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
