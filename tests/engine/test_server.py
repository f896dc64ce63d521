"""ffl-serve end to end on an ephemeral loopback port, with a real HTTP client (http.client):
JSON and SSE streaming completions, bad requests answered 400 while others are served; and main(),
the `ffl-serve` command, in its own process on a real TCP port."""
import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from ffl_backend.engine import OptimizedInferenceEngine
from ffl_backend.engine.server import start
from tests.tiny_models import save_tiny_folder

from .conftest import random_prompts


@pytest.fixture(scope="module")
def served(llama):
    engine = OptimizedInferenceEngine(llama, max_batch_size=4, max_seq_len=96, compile=None)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box = {}

    def run():
        asyncio.set_event_loop(loop)
        box["server"] = loop.run_until_complete(start(engine, "127.0.0.1", 0))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(30)
    port = box["server"].sockets[0].getsockname()[1]
    yield engine, port
    loop.call_soon_threadsafe(box["server"].close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    engine.close()


def post(port, body, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=raw if raw is not None else json.dumps(body),
                  headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp, resp.read().decode()


def test_completion_json(served, references):
    engine, port = served
    prompt = random_prompts([9], seed=7)[0]
    resp, text = post(port, {"prompt": prompt, "max_tokens": 10, "temperature": 0})
    assert resp.status == 200 and resp.getheader("Content-Type") == "application/json"
    out = json.loads(text)
    assert out["object"] == "text_completion" and out["choices"][0]["token_ids"] == references(prompt, 10)
    assert out["usage"] == {"prompt_tokens": 9, "completion_tokens": len(references(prompt, 10)),
                            "total_tokens": 9 + len(references(prompt, 10))}


def test_completion_streaming_sse(served, references):
    engine, port = served
    prompt = random_prompts([13], seed=8)[0]
    resp, text = post(port, {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True})
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    events = [e[len("data: "):] for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]]
    assert tokens == references(prompt, 12) and len(chunks) == len(tokens) + 1
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("body, message", [
    ({"prompt": "", "max_tokens": 4}, "prompt"),
    ({"prompt": [], "max_tokens": 4}, "empty prompt"),
    ({"prompt": [5] * 90, "max_tokens": 10}, "max_seq_len"),
    ({"prompt": [5, 6], "temperature": -1}, "temperature"),
    ({"prompt": [5, 6], "top_p": 0}, "top_p"),
    ({"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [5, 6], "bogus": 1}, "bogus"),
    (None, "invalid JSON"),
])
def test_bad_requests_get_400(served, body, message):
    _, port = served
    resp, text = post(port, body, raw="{not json" if body is None else None)
    assert resp.status == 400, text
    err = json.loads(text)["error"]
    assert err["type"] == "invalid_request_error" and message in err["message"]


def test_concurrent_clients_with_bad_ones_mixed_in(served, references):
    engine, port = served
    prompts = random_prompts([5, 17, 8, 26, 3, 11], seed=9)
    results = {}

    def client(i):
        body = {"prompt": prompts[i], "max_tokens": 15, "temperature": 0, "stream": i % 2 == 0}
        results[i] = post(port, body)
        results[-i - 1] = post(port, {"prompt": prompts[i], "max_tokens": 15, "top_p": 7})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, prompt in enumerate(prompts):
        resp, text = results[i]
        assert resp.status == 200 and results[-i - 1][0].status == 400
        if i % 2:
            tokens = json.loads(text)["choices"][0]["token_ids"]
        else:
            events = [json.loads(e[6:]) for e in text.split("\n\n") if e and e != "data: [DONE]"]
            tokens = [t for e in events for t in e["choices"][0].get("token_ids", [])]
        assert tokens == references(prompt, 15)


def test_health_and_unknown_route(served):
    _, port = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/nope")
    assert conn.getresponse().status == 404


def _get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def test_main_serves_a_model_folder_on_a_real_port(tmp_path, references):
    """`ffl-serve` as users start it: main() in its own process loads a model folder (the session's
    tiny Llama and a word-level tokenizer), listens on a TCP port, answers a text completion with
    transformers' greedy tokens and its decoded text, and stops cleanly on Ctrl-C (SIGINT)."""
    from transformers import AutoTokenizer

    folder = save_tiny_folder(tmp_path / "tiny")
    with socket.socket() as probe:  # a port free now; main() binds it moments later
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # SIGINT back to its default in the child: a suite started in the background (`cmd &`) runs with
    # SIGINT ignored, the server would inherit that, and the Ctrl-C this test sends would do nothing
    proc = subprocess.Popen([sys.executable, "-m", "ffl_backend.engine.server", "--model", str(folder), "--port",
                             str(port), "--max-batch-size", "2", "--max-seq-len", "64", "--compile", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                status, health = _get(port, "/health")
                break
            except OSError:
                assert time.monotonic() < deadline, "ffl-serve did not start listening within 120 s"
                time.sleep(0.2)
        assert status == 200 and health["status"] == "ok"
        assert _get(port, "/v1/models")[1]["data"][0]["id"] == str(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        prompt = "It is a truth universally acknowledged, that a single man"
        ids = tokenizer(prompt)["input_ids"]
        resp, text = post(port, {"prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert resp.status == 200, text
        choice = json.loads(text)["choices"][0]
        assert choice["token_ids"] == references(ids, 8)
        assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            log = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:  # show what the server was doing, not only the timeout
            proc.kill()
            raise AssertionError("ffl-serve did not exit within 60 s of SIGINT:\n" + proc.communicate()[0][-3000:])
    assert proc.returncode == 0, log[-3000:]
    assert f"listening on http://127.0.0.1:{port}/v1/completions" in log
