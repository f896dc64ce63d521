"""optimize()'s decode loop behind generate() (ffl_backend/decode_loop.py): the same tokens as
transformers' own loop for greedy, sampling, processors, eos and padding; what it does not cover falls
back with a logged reason; guards still catch a changed model."""
import logging

import pytest
import torch

import ffl_backend
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("no_fallbacks")  # no pattern family fell back, no anchor left

FAST = {"mode": "default"}  # the loop, not the C++ wrapper's compile time, is under test here


def _optimized(loop=True, **kw):
    model = tiny_model("llama")
    return ffl_backend.optimize(model, max_seq_len=64, decode_loop=loop, **FAST, **kw)


def _both(kwargs, ids, seed=0, **opt):
    """(the loop's output, transformers' loop's output) on the same optimized model and seed."""
    model = _optimized(**opt)
    torch.manual_seed(seed)
    ours = model.generate(ids, **kwargs)
    ffl_backend.optimize(model, max_seq_len=64, decode_loop=False, **FAST, **opt)
    torch.manual_seed(seed)
    theirs = model.generate(ids, **kwargs)
    return ours, theirs


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=12, do_sample=False),
    dict(max_new_tokens=12, do_sample=True, temperature=0.7, top_k=20, top_p=0.9),
    dict(max_new_tokens=12, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=2),
    dict(max_new_tokens=12, min_new_tokens=10, do_sample=False, eos_token_id=5),
], ids=["greedy", "sampling", "processors", "min-length-eos"])
def test_loop_follows_transformers(kwargs):
    ids = torch.randint(3, 128, (1, 7))
    ours, theirs = _both(kwargs, ids)
    assert torch.equal(ours, theirs)


def test_eos_stops_and_pads_finished_rows():
    """Row 0 meets eos early, row 1 later: the finished row is padded, the call ends when both are done."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 6))
    with torch.inference_mode():
        free = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    eos = int(free[0, 8])  # row 0's 3rd new token becomes eos
    ours, theirs = _both(dict(max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0), ids,
                         max_batch_size=2)
    assert torch.equal(ours, theirs)
    assert (ours[0, 9:] == 0).all() and ours[0, 8] == eos


def test_streamer_sees_the_prompt_then_every_token():
    class Recorder:
        def __init__(self):
            self.seen, self.ended = [], False

        def put(self, value):
            self.seen.append(value.tolist())

        def end(self):
            self.ended = True

    model = _optimized()
    ids = torch.randint(3, 128, (1, 5))
    rec = Recorder()
    out = model.generate(ids, max_new_tokens=6, do_sample=False, streamer=rec)
    assert rec.seen[0] == ids.tolist() and rec.ended
    assert [t[0] for t in rec.seen[1:]] == out[0, 5:].tolist()


@pytest.mark.parametrize("kwargs,reason", [
    (dict(num_beams=2), "beam_search"),
    (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
    (dict(return_dict_in_generate=True, output_scores=True), "return_dict_in_generate"),
])
def test_what_the_loop_does_not_cover_falls_back_with_a_reason(kwargs, reason, caplog):
    from ffl_backend import decode_loop

    decode_loop._reported.clear()
    model = _optimized(max_batch_size=2)
    ids = torch.randint(3, 128, (1, 5))
    with caplog.at_level(logging.INFO, logger="ffl_backend"):
        out = model.generate(ids, max_new_tokens=4, **kwargs)
    assert any("transformers' loop" in r.message and reason in r.message for r in caplog.records), caplog.text
    sequences = out.sequences if hasattr(out, "sequences") else out
    assert sequences.shape[-1] == 9


def test_custom_stopping_criteria_run_as_transformers_runs_them():
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 9, dtype=torch.bool)

    ids = torch.randint(3, 128, (1, 5))
    stop = StoppingCriteriaList([StopAfter()])
    ours, theirs = _both(dict(max_new_tokens=10, do_sample=False, stopping_criteria=stop), ids)
    assert torch.equal(ours, theirs) and ours.shape[1] == 9


def test_steps_after_the_guarded_ones_still_recompile_for_a_changed_model():
    """Guards are skipped only inside one generate() call; a changed dtype between calls is caught
    by the full guards of the next call's first steps."""
    model = _optimized()
    ids = torch.randint(3, 128, (1, 5))
    model.generate(ids, max_new_tokens=6, do_sample=False)
    graphs = len(ffl_backend.fusion_reports())
    model.generate(ids, max_new_tokens=6, do_sample=False)
    assert len(ffl_backend.fusion_reports()) == graphs  # same model: no new graph
    model.to(torch.bfloat16)  # no new optimize(): the loop makes a cache of the new dtype
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    new = ffl_backend.fusion_reports()[graphs:]
    assert new and new[-1].dtype == "bfloat16", [r.summary() for r in new]
    assert out.shape == (1, 11)


def test_a_new_batch_size_gets_its_own_graph():
    model = _optimized(max_batch_size=2)
    model.generate(torch.randint(3, 128, (1, 5)), max_new_tokens=4, do_sample=False)
    graphs = len(ffl_backend.fusion_reports())
    out = model.generate(torch.randint(3, 128, (2, 5)), max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 9)
    assert len(ffl_backend.fusion_reports()) > graphs  # recompiled for batch 2, not reused
