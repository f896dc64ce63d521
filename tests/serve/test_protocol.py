"""Request parsing (nulls, unknown fields, refusals), the stop-string matcher and the incremental
detokenizer, without a server."""
import random

import pytest

from ffl_backend.engine.sampling import RequestError
from ffl_backend.serve.generation import StopMatcher
from ffl_backend.serve.openai_api import parse_request


def test_nulls_mean_defaults_and_chat_defaults_to_the_context():
    req = parse_request({"prompt": "a", "stop": None, "temperature": None, "n": None, "max_tokens": None}, chat=False)
    assert req.max_tokens == 16 and req.n == 1 and req.stop == () and req.params.temperature == 1.0
    chat = parse_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}]}, chat=True)
    assert chat.max_tokens is None and chat.messages == [{"role": "user", "content": "ab"}]
    assert parse_request({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7},
                         chat=True).max_tokens == 7


def test_prompt_forms_and_choices_cap():
    assert parse_request({"prompt": [1, 2]}, chat=False).prompts == [[1, 2]]
    assert parse_request({"prompt": ["a", [3]]}, chat=False).prompts == ["a", [3]]
    with pytest.raises(RequestError, match="choices"):
        parse_request({"prompt": ["a"] * 4, "n": 5}, chat=False)


@pytest.mark.parametrize("body", [{"prompt": "a", "echo": True}, {"prompt": "a", "logit_bias": {"1": 5}},
                                  {"prompt": "a", "best_of": 3}, {"prompt": "a", "stream": "yes"},
                                  {"prompt": "a", "seed": -1}, {"prompt": "a", "temperature": True},
                                  {"prompt": "a", "stop": "x" * 0 or ["a"] * 17}])
def test_refusals(body):
    with pytest.raises(RequestError):
        parse_request(body, chat=False)


def test_sampling_fields_reach_the_params():
    req = parse_request({"prompt": "a", "temperature": 0.5, "top_k": 4, "min_p": 0.1, "presence_penalty": 0.5,
                         "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logprobs": 3, "seed": 2**64 - 1,
                         "stop_token_ids": [7], "stop": "x"}, chat=False)
    p = req.params
    assert (p.temperature, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
            p.logprobs, p.seed, p.stop_token_ids, p.do_sample) == (0.5, 4, 0.1, 0.5, -0.5, 1.2, 3, 2**64 - 1,
                                                                     (7,), True)
    assert req.stop == ("x",)


def test_stop_matcher_finds_a_stop_split_across_deltas():
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice("abc ") for _ in range(40))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(2)]
        matcher, out, stopped, i = StopMatcher(stops), "", False, 0
        while i < len(text) and not stopped:
            step = rng.randint(1, 5)
            piece, stopped = matcher.feed(text[i:i + step])
            out, i = out + piece, i + step
        if not stopped:
            out += matcher.flush()
        ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]  # first to complete
        assert out == (text[:min(ends)[1]] if ends else text) and stopped == bool(ends)


def test_incremental_detokenizer_equals_decoding_everything():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from ffl_backend.engine.engine import _Detokenizer

    corpus = ["It is a truth universally acknowledged — naïve café, 東京 and emoji 🙂 too."] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    rng = random.Random(1)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(60)]
        detok = _Detokenizer(tok)
        text = "".join(detok.push(t) for t in ids)
        full = tok.decode(ids, skip_special_tokens=True)
        assert full.startswith(text) and full[len(text):].strip("\ufffd") == ""
