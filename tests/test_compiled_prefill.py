"""optimize(compile_prefill=True): the decode loop's prompt runs compiled, one graph with a dynamic length
(two where the graph branches on it: a sliding window's min(window, L)), greedy tokens equal eager's, and
no graph is compiled for a prompt length after the first ones (issue 47 item 4)."""
import random
from pathlib import Path

import pytest
import torch

import ffl_backend
from tests.helpers import NoFallbacks
from tests.tiny_models import sliding_model, tiny_model

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "prideprejudice.txt"
FAST = {"inductor": False}


def _greedy(model, ids, new: int, **kw):
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)


def _graphs() -> int:
    return len(ffl_backend.fusion_reports())


def _prompt_calls(model, monkeypatch) -> list:
    """The lengths of the prompts that went through the compiled prompt step."""
    loop, calls = model.generate.__wrapped__, []
    real = loop._compiled_prompt

    def counted(gc):
        step = real(gc)
        if step is None:
            return None
        return lambda m, ids, *rest: calls.append(ids.shape[1]) or step(m, ids, *rest)

    monkeypatch.setattr(loop, "_compiled_prompt", counted)
    return calls


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_tiny_compiled_prompts_equal_eager_on_a_bounded_set_of_graphs(kind, monkeypatch):
    """Lengths on both sides of gemma3's window of 6; then 10 more lengths compile nothing."""
    model = tiny_model(kind) if kind == "llama" else sliding_model(kind)
    prompts = {n: torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 17, 30)}
    expected = {n: _greedy(model, ids, 6) for n, ids in prompts.items()}
    ffl_backend.optimize(model, max_seq_len=48, compile_prefill=True, **FAST)
    calls = _prompt_calls(model, monkeypatch)
    before = _graphs()
    for n, ids in prompts.items():
        assert torch.equal(_greedy(model, ids, 6), expected[n]), n
    assert calls == list(prompts)  # every prompt through the compiled step
    first = _graphs() - before
    assert 2 <= first <= 3, first  # decode + one prompt graph (+ the other side of the window's branch)
    for n in random.Random(0).sample(range(2, 40), 10):
        _greedy(model, torch.randint(3, 128, (1, n)), 2)
    assert _graphs() - before == first, [r.summary() for r in ffl_backend.fusion_reports()[before + first:]]


def test_padded_and_one_token_prompts_stay_eager_and_equal(monkeypatch):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    single = torch.randint(3, 128, (1, 1))
    expected, expected_single = _greedy(model, ids, 5, attention_mask=mask), _greedy(model, single, 5)
    ffl_backend.optimize(model, max_batch_size=2, max_seq_len=32, compile_prefill=True, **FAST)
    calls = _prompt_calls(model, monkeypatch)
    assert torch.equal(_greedy(model, ids, 5, attention_mask=mask), expected)
    assert torch.equal(_greedy(model, single, 5), expected_single)
    assert calls == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_real_model_compiled_prompts_equal_eager_without_recompiles(name, monkeypatch):
    """fp32 greedy tokens at prompts of 17, 333 and 700 tokens (Gemma-3: on both sides of its 512 window)
    equal eager's; then 20 random prompt lengths compile nothing."""
    from ffl_backend.bench import prompt_ids

    torch._dynamo.reset()
    model, tokenizer = (ffl_backend.load_smollm2 if name == "smollm2" else ffl_backend.load_gemma3)(torch.float32)
    prompts = {n: prompt_ids(tokenizer, n, str(TEXT)) for n in (17, 333, 700)}
    expected = {n: _greedy(model, ids, 8) for n, ids in prompts.items()}
    ffl_backend.optimize(model, max_seq_len=1024, compile_prefill=True)
    calls = _prompt_calls(model, monkeypatch)
    with NoFallbacks(require_graph=False):
        for n, ids in prompts.items():
            assert torch.equal(_greedy(model, ids, 8), expected[n]), (name, n)
    assert calls == list(prompts)
    before = _graphs()
    for n in random.Random(1).sample(range(2, 1000), 20):
        _greedy(model, prompt_ids(tokenizer, n, str(TEXT)), 2)
    new = ffl_backend.fusion_reports()[before:]
    assert not new, [r.summary() for r in new]
