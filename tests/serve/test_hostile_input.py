"""Bad and hostile input: each case gets a 4xx JSON error in under a second (slow clients: the
connection closed by a timeout), and afterwards the server still answers a good request."""
import json
import socket
import threading
import time

import pytest

from .conftest import WORDS, Served, engine_greedy, make_engine, post_raw, raw_request, status_and_json

GOOD = json.dumps({"prompt": WORDS, "max_tokens": 3, "temperature": 0}).encode()


def still_serves(served):
    status, body = status_and_json(raw_request(served.port, post_raw("/v1/completions", GOOD), timeout=30))
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")


def timed(served, data: bytes):
    start = time.monotonic()
    reply = raw_request(served.port, data)
    assert time.monotonic() - start < 1.0, reply[:300]
    return reply


def body_of(obj) -> bytes:
    return json.dumps(obj).encode()


BAD_BODIES = {
    "negative max_tokens": body_of({"prompt": WORDS, "max_tokens": -1}),
    "seed 2**64": body_of({"prompt": WORDS, "seed": 2**64}),
    "string temperature": body_of({"prompt": WORDS, "temperature": "hot"}),
    "temperature NaN": b'{"prompt": "It is", "temperature": NaN}',
    "top_p 7": body_of({"prompt": WORDS, "top_p": 7}),
    "n 0": body_of({"prompt": WORDS, "n": 0}),
    "n 1000": body_of({"prompt": WORDS, "n": 1000}),
    "logprobs 1000": body_of({"prompt": WORDS, "logprobs": 1000}),
    "stop not strings": body_of({"prompt": WORDS, "stop": [1, 2]}),
    "prompt an object": body_of({"prompt": {"a": 1}}),
    "empty token list": body_of({"prompt": []}),
    "token id out of vocab": body_of({"prompt": [5, 10**12]}),
    "prompt past the context": body_of({"prompt": [5] * 200}),
    "echo": body_of({"prompt": WORDS, "echo": True}),
    "body a list": b"[1, 2, 3]",
    "invalid JSON": b"{not json",
    "invalid UTF-8": b'{"prompt": "\xff\xfe"}',
    "deep nesting": b"[" * 100000 + b"]" * 100000,
    "65 stop_token_ids": body_of({"prompt": WORDS, "stop_token_ids": list(range(3, 68))}),
    "stop_token_id out of vocab": body_of({"prompt": WORDS, "stop_token_ids": [5, 10**9]}),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_bad_bodies_get_400_json(served, case):
    status, body = status_and_json(timed(served, post_raw("/v1/completions", BAD_BODIES[case])))
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    still_serves(served)


BAD_CHAT = {
    "no messages": {"max_tokens": 2},
    "message without role": {"messages": [{"content": "hi"}]},
    "image part": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    "top_logprobs without logprobs": {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
    "tools": {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
}


@pytest.mark.parametrize("case", sorted(BAD_CHAT))
def test_bad_chat_bodies_get_400_json(served, case):
    status, body = status_and_json(timed(served, post_raw("/v1/chat/completions", body_of(BAD_CHAT[case]))))
    assert status == 400 and "error" in body, body
    still_serves(served)


def test_nulls_defaults_and_unknown_fields_are_accepted(served, caplog):
    body = {"prompt": WORDS, "max_tokens": 3, "temperature": 0, "stop": None, "frequency_penalty": 0,
            "presence_penalty": 0, "logit_bias": {}, "echo": False, "seed": None, "user": None, "n": None,
            "logprobs": None, "stream": None, "stream_options": None, "some_new_field": {"x": 1}}
    with caplog.at_level("WARNING", logger="ffl_backend.serve"):
        status, out = status_and_json(timed(served, post_raw("/v1/completions", body_of(body))))
    assert status == 200, out
    assert "some_new_field" in caplog.text


@pytest.mark.parametrize("head, status", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431),
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405),
])
def test_malformed_http_gets_json_errors(served, head, status):
    got, body = status_and_json(timed(served, head))
    assert got == status and "error" in body
    still_serves(served)


def test_chunked_body_expect_continue_and_bare_lf_are_served(served):
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n"
               + b"%x\r\n" % len(GOOD) + GOOD + b"\r\n0\r\n\r\n")
    assert status_and_json(timed(served, chunked))[0] == 200
    bare_lf = post_raw("/v1/completions", GOOD).replace(b"\r\n", b"\n")
    assert status_and_json(timed(served, bare_lf))[0] == 200
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
        head = post_raw("/v1/completions", GOOD, {"Expect": "100-continue"})
        sock.sendall(head[: head.index(b"\r\n\r\n") + 4])
        assert sock.recv(100).startswith(b"HTTP/1.1 100")
        sock.sendall(GOOD)
        reply = b""
        while b"finish_reason" not in reply:
            reply += sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200")


def test_an_oversized_body_gets_413_and_the_client_reads_it(served):
    big = body_of({"prompt": "a " * (1 << 20)})  # 2 MiB against a 1 MiB cap
    status, body = status_and_json(timed(served, post_raw("/v1/completions", big)))
    assert status == 413 and "error" in body
    still_serves(served)


def test_slow_headers_slow_body_and_idle_connections_are_closed(served):
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
        start = time.monotonic()
        reply = sock.recv(4096)
        assert time.monotonic() - start < 2.5 and (reply == b"" or reply.startswith(b"HTTP/1.1 408"))
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
        sock.sendall(post_raw("/v1/completions", GOOD)[:-10])  # the body stops short
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
        assert status_and_json(data)[0] == 408
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:  # sends nothing at all
        assert sock.recv(10) == b""
    still_serves(served)


def test_a_huge_prompt_is_tokenized_off_the_event_loop(tiny_folder):
    engine = make_engine(tiny_folder)
    served = Served(engine, max_body_bytes=8 << 20)
    try:
        body = body_of({"prompt": "man " * (1900 << 10), "max_tokens": 2})  # 7.4 MiB, ~2M tokens
        reply = {}
        thread = threading.Thread(target=lambda: reply.update(r=raw_request(served.port, post_raw(
            "/v1/completions", body), timeout=120)))
        thread.start()
        time.sleep(0.3)
        start = time.monotonic()
        health = raw_request(served.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_and_json(health)[0] == 200 and time.monotonic() - start < 1.0
        thread.join(120)
        status, out = status_and_json(reply["r"])
        assert status == 400 and "context" in out["error"]["message"]
    finally:
        served.stop()
        engine.close()


def test_tiny_temperature_fails_nobody(served):
    """temperature 1e-300 while 4 greedy requests stream: it is answered (clamped to 1e-2), and the
    4 streams finish with the tokens each gets alone."""
    ids = [served.engine.tokenizer(f"{w} truth of a man")["input_ids"] for w in ("It", "a", "good", "single")]
    alone = [engine_greedy(served.engine, p, 24) for p in ids]
    client = served.client()
    results = {}

    def stream(i):
        chunks = client.completions.create(model="tiny", prompt=ids[i], max_tokens=24, temperature=0, stream=True,
                                           extra_body={"return_token_ids": True})
        results[i] = [t for c in chunks for t in (c.choices[0].token_ids or [])]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    tiny = client.completions.create(model="tiny", prompt=WORDS, max_tokens=8, temperature=1e-300)
    for t in threads:
        t.join(60)
    assert tiny.choices[0].finish_reason in ("length", "stop")
    assert [results[i] for i in range(4)] == alone


def test_queue_cap_answers_429_with_retry_after(tiny_folder):
    engine = make_engine(tiny_folder, max_batch_size=1)
    served = Served(engine, max_queued=0)
    try:
        slow = threading.Thread(target=lambda: raw_request(served.port, post_raw("/v1/completions", body_of(
            {"prompt": WORDS, "max_tokens": 100, "ignore_eos": True, "temperature": 0})), timeout=60))
        slow.start()
        deadline = time.monotonic() + 10
        while served.state.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        reply = timed(served, post_raw("/v1/completions", GOOD))
        assert status_and_json(reply)[0] == 429 and b"retry-after: 1" in reply.lower()
        slow.join(60)
        still_serves(served)
    finally:
        served.stop()
        engine.close()


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_body_not_sent_as_json_gets_415(served, content_type):
    """What a web page can POST cross-origin without a CORS preflight is never served."""
    lines = ["POST /v1/completions HTTP/1.1", "Host: x", f"Content-Length: {len(GOOD)}"]
    lines += [f"Content-Type: {content_type}"] if content_type else []
    status, body = status_and_json(timed(served, ("\r\n".join(lines) + "\r\n\r\n").encode() + GOOD))
    assert status == 415 and "application/json" in body["error"]["message"]
    still_serves(served)


def test_json_media_types_with_parameters_are_served(served):
    for content_type in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"):
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(GOOD)}\r\n"
        head += f"Content-Type: {content_type}\r\n\r\n"
        status, _ = status_and_json(raw_request(served.port, head.encode() + GOOD, timeout=30))
        assert status == 200, content_type


def test_idle_connections_are_closed_first_at_the_connection_cap(tiny_folder):
    """20 idle connections against a cap of 8: each new one closes the longest idle, so a good request
    is served at once (uvicorn alone answers 503 until the header deadline frees slots); a connection
    in the middle of its request is never closed."""
    engine = make_engine(tiny_folder)
    served = Served(engine, max_connections=8, header_timeout=30.0)
    socks = []
    try:
        busy = socket.create_connection(("127.0.0.1", served.port), timeout=10)
        socks.append(busy)
        busy.sendall(post_raw("/v1/completions", GOOD)[:20])  # a request begun, not finished
        for _ in range(20):
            socks.append(socket.create_connection(("127.0.0.1", served.port), timeout=10))
            time.sleep(0.01)
        status, body = status_and_json(timed(served, post_raw("/v1/completions", GOOD)))
        assert status == 200, body
        closed = 0
        for sock in socks[1:]:
            sock.settimeout(0.2)
            try:
                closed += sock.recv(10) == b""
            except socket.timeout:
                pass
        assert closed >= 20 - 8 + 1, closed
        busy.sendall(post_raw("/v1/completions", GOOD)[20:])  # the begun request is still served
        data = b""
        while b'"choices"' not in data and (chunk := busy.recv(65536)):
            data += chunk
        assert data.startswith(b"HTTP/1.1 200")
    finally:
        for sock in socks:
            sock.close()
        served.stop()
        engine.close()
