"""ffl-serve through the official `openai` client: completions and chat, streaming and not, n=2,
stop strings, logprobs, penalties and the API key; tokens equal the engine's own greedy output."""
import pytest

from .conftest import WORDS, Served, engine_greedy, make_engine

openai = pytest.importorskip("openai")
TOKEN_IDS = {"return_token_ids": True}


def prompt_ids(served, text=WORDS):
    return served.engine.tokenizer(text)["input_ids"]


def chat_ids(served, content=WORDS):
    text = served.engine.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                       add_generation_prompt=True, tokenize=False)
    return served.engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_completion_json_and_stream_equal_the_engine(served):
    client = served.client()
    want = engine_greedy(served.engine, prompt_ids(served), 12)
    out = client.completions.create(model="tiny", prompt=WORDS, max_tokens=12, temperature=0, extra_body=TOKEN_IDS)
    choice = out.choices[0]
    assert choice.token_ids == want and choice.finish_reason in ("length", "stop")
    assert choice.text == served.engine.decode(want)
    assert out.usage.prompt_tokens == len(prompt_ids(served)) and out.usage.completion_tokens == len(want)
    chunks = list(client.completions.create(model="tiny", prompt=WORDS, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=TOKEN_IDS))
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == want
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == len(want) and not chunks[-1].choices


def test_chat_json_and_stream_equal_the_engine_on_the_template(served):
    client = served.client()
    want = engine_greedy(served.engine, chat_ids(served), 10)
    messages = [{"role": "user", "content": WORDS}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                         extra_body=TOKEN_IDS)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].token_ids == want and out.choices[0].message.content == served.engine.decode(want)
    assert out.usage.prompt_tokens == len(chat_ids(served))
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, extra_body=TOKEN_IDS))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    assert [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])] == want
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_n_choices_sampled_with_a_seed_are_reproducible(served):
    client = served.client()
    kw = dict(model="tiny", prompt=WORDS, max_tokens=8, temperature=1.0, n=2, seed=123, extra_body=TOKEN_IDS)
    first, second = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in second.choices]
    assert first.usage.completion_tokens == sum(len(c.token_ids) for c in first.choices)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": WORDS}],
                                          max_tokens=4, temperature=0, n=2, stream=True)
    assert {c.choices[0].index for c in chat if c.choices} == {0, 1}


def test_stop_strings_cut_the_text_before_the_match(served):
    client = served.client()
    full = client.completions.create(model="tiny", prompt=WORDS, max_tokens=20, temperature=0, extra_body=TOKEN_IDS)
    text = full.choices[0].text
    stop = text.split()[2]  # every id has a word: 20 tokens are >= 3 words unless eos came first
    cut = text[:text.index(stop)]
    out = client.completions.create(model="tiny", prompt=WORDS, max_tokens=20, temperature=0, stop=[stop, "zzz"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=WORDS, max_tokens=20, temperature=0, stop=stop,
                                         stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_are_the_models_own(served):
    import torch

    client = served.client()
    ids = prompt_ids(served)
    out = client.completions.create(model="tiny", prompt=WORDS, max_tokens=3, temperature=0, logprobs=2,
                                    extra_body=TOKEN_IDS)
    tokens = out.choices[0].token_ids
    with torch.no_grad():
        logits = served.engine.model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1].double()
    want = logits.log_softmax(-1)
    got = out.choices[0].logprobs.token_logprobs
    assert got == pytest.approx([want[i, t].item() for i, t in enumerate(tokens)], abs=1e-4)
    assert all(len(top) >= 1 for top in out.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": WORDS}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and len(content[0].top_logprobs) == 3
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy: the top one


def test_models_and_unknown_model_name(served):
    client = served.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=WORDS, max_tokens=2)


def test_api_key_right_and_wrong(tiny_folder):
    engine = make_engine(tiny_folder)
    served = Served(engine, api_key="sesame")
    try:
        with pytest.raises(openai.AuthenticationError):
            served.client(api_key="wrong").completions.create(model="tiny", prompt=WORDS, max_tokens=2)
        out = served.client(api_key="sesame").completions.create(model="tiny", prompt=WORDS, max_tokens=4,
                                                                 temperature=0, extra_body=TOKEN_IDS)
        assert out.choices[0].token_ids == engine_greedy(engine, prompt_ids(served), 4)
        import urllib.request

        assert urllib.request.urlopen(served.url + "/health", timeout=10).status == 200  # open without a key
    finally:
        served.stop()
        engine.close()


def test_chat_template_override_and_cors(tiny_folder):
    """--chat-template replaces the tokenizer's; CORS answers only the allowed origins."""
    import json
    import urllib.request

    engine = make_engine(tiny_folder)
    served = Served(engine, chat_template="{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}",
                    allowed_origins=("https://ui.example",))
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "man"}]}).encode()
        req = urllib.request.Request(served.url + "/tokenize", data=body, headers={"Content-Type": "application/json"})
        tokens = json.loads(urllib.request.urlopen(req, timeout=10).read())["tokens"]
        assert tokens == engine.tokenizer("user man", add_special_tokens=False)["input_ids"]

        def preflight(origin):
            req = urllib.request.Request(served.url + "/v1/chat/completions", method="OPTIONS", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST"})
            try:
                resp = urllib.request.urlopen(req, timeout=10)
            except urllib.error.HTTPError as exc:
                resp = exc
            return resp.headers.get("access-control-allow-origin")

        assert preflight("https://ui.example") == "https://ui.example"
        assert preflight("https://evil.example") is None
    finally:
        served.stop()
        engine.close()
