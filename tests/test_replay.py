"""The decode loop's guard-free replay (ffl_backend/replay.py): which steps may be called without
Dynamo, and FFL_GUARDED=1, which runs every step through Dynamo's full guards."""
import pytest
import torch

import ffl_backend
from ffl_backend import replay
from ffl_backend.replay import one_graph, recorded_calls
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("no_fallbacks")


def _optimized():
    return ffl_backend.optimize(tiny_model("llama"), max_seq_len=64, mode="default")


def _watch_direct_calls(monkeypatch) -> list:
    """The result of every replay.direct_call the decode loop makes (None: not callable directly)."""
    seen = []
    original = replay.direct_call
    monkeypatch.setattr(replay, "direct_call", lambda calls, out: seen.append(original(calls, out)) or seen[-1])
    return seen


def test_steady_steps_call_the_compiled_graph_directly(monkeypatch):
    """After the two guarded steps the loop calls the recorded graph itself (no Dynamo per step);
    the tokens are transformers' (the parametrized test above runs the same path)."""
    seen = _watch_direct_calls(monkeypatch)
    model = _optimized()
    ids = torch.randint(3, 128, (1, 6))
    first = model.generate(ids, max_new_tokens=10, do_sample=False)  # compiles: its steps stay on Dynamo
    assert not seen
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), first)
    assert len(seen) == 1 and seen[0] is not None


def test_only_frames_whose_replayed_effects_change_nothing_are_called_directly():
    """A frame that leaves a global attribute as it found it may be called directly; one that
    stores a new value may not (Dynamo replays that store after the graph)."""
    class State:
        flag, count = None, 0

    state = State()

    def restores(x):
        state.flag = "busy"
        y = x * 2
        state.flag = None
        return y

    def stores(x):
        state.count = 7
        return x * 2

    for fn, expected in ((restores, True), (stores, False)):
        compiled = torch.compile(fn, backend="fastflow", options={"inductor": False}, fullgraph=True)
        compiled(torch.ones(3))
        with recorded_calls() as calls:
            compiled(torch.ones(3))
        assert len(calls) == 1 and calls[0][0].replays_nothing is expected, fn.__name__


def test_a_step_with_a_graph_break_is_not_called_directly():
    def one(x):
        return x + 1

    def broken(x):
        y = x + 1
        torch._dynamo.graph_break()
        return y * 2

    for fn, expected in ((one, True), (broken, False)):
        compiled = torch.compile(fn, backend="fastflow", options={"inductor": False})
        compiled(torch.ones(2))
        assert one_graph(compiled) is expected, fn.__name__


@pytest.mark.parametrize("kwargs", [dict(do_sample=False),
                                    dict(do_sample=True, temperature=0.8, top_k=30)], ids=["greedy", "sampling"])
def test_ffl_guarded_runs_every_step_through_dynamo_with_the_same_tokens(monkeypatch, kwargs):
    """The switch for bisecting: with FFL_GUARDED=1 no step is replayed directly nor with skipped
    guards, and the tokens (greedy, and sampling from the same seed) equal the replayed loop's."""
    seen = _watch_direct_calls(monkeypatch)
    skipped = []
    monkeypatch.setattr(replay, "_Unguarded", lambda: skipped.append(1) or pytest.fail("guards skipped"))
    model = _optimized()
    ids = torch.randint(3, 128, (1, 6))
    model.generate(ids, max_new_tokens=3, do_sample=False)  # compiles
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FFL_GUARDED", flag)
        seen.clear()
        torch.manual_seed(1)
        runs[flag] = model.generate(ids, max_new_tokens=12, **kwargs)
        assert (len(seen) == 1 and seen[0] is not None) if flag == "0" else not seen, flag
    assert not skipped  # on CPU the replayed loop calls the graph itself rather than skip guards
    assert torch.equal(runs["0"], runs["1"])
