"""Operations: /health while loading and with a dead engine, /metrics, /tokenize, request timeouts,
graceful shutdown of streams, and `ffl-serve` itself in its own process on a real port."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from .conftest import WORDS, Served, make_engine, post_raw, raw_request, status_and_json
from .test_disconnects import open_stream, read_events, slow_down


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_health_while_loading_then_ready_then_dead(tiny_folder):
    served = Served(None)
    try:
        status, body = get(served.url + "/health")
        assert status == 503 and json.loads(body)["status"] == "loading"
        reply = raw_request(served.port, post_raw("/v1/completions", json.dumps({"prompt": WORDS}).encode()))
        assert status_and_json(reply)[0] == 503
        engine = make_engine(tiny_folder)
        served.state.engine = engine
        assert get(served.url + "/health")[0] == 200
        engine.close()
        status, body = get(served.url + "/health")
        assert status == 503 and json.loads(body)["status"] == "dead"
    finally:
        served.stop()


def test_metrics_count_what_was_served(served):
    served.client().completions.create(model="tiny", prompt=WORDS, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    status, text = get(served.url + "/metrics")
    text = text.decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert status == 200
    assert values["ffl_time_to_first_token_seconds_count"] >= 1 and values["ffl_inter_token_latency_seconds_count"] >= 4
    assert values["ffl_generation_tokens_total"] >= 5 and values["ffl_requests_running"] == 0
    assert values["ffl_kv_blocks_used"] == 0 and values["ffl_kv_blocks_free"] > 0
    assert 'ffl_http_requests_total{route="/v1/completions",status="200"}' in values


def test_tokenize_and_detokenize_round_trip(served):
    def post(path, body):
        return status_and_json(raw_request(served.port, post_raw(path, json.dumps(body).encode())))

    status, out = post("/tokenize", {"prompt": WORDS})
    assert status == 200 and out["tokens"] == served.engine.tokenizer(WORDS)["input_ids"]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == served.engine.max_seq_len
    status, back = post("/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and back["prompt"] == served.engine.decode(out["tokens"])
    assert post("/detokenize", {"tokens": [10**9]})[0] == 400
    status, chat = post("/tokenize", {"messages": [{"role": "user", "content": WORDS}]})
    assert status == 200 and chat["count"] > 0


def test_request_timeout_cancels_json_and_stream_requests(tiny_folder):
    engine = make_engine(tiny_folder)
    slow_down(engine, 0.02)
    served = Served(engine, request_timeout_s=0.5)
    try:
        before = engine.scheduler.stats["cancelled"]
        body = {"prompt": WORDS, "max_tokens": 100, "temperature": 0, "ignore_eos": True}
        start = time.monotonic()
        status, out = status_and_json(raw_request(served.port, post_raw("/v1/completions", json.dumps(body).encode())))
        assert status == 408 and out["error"]["type"] == "timeout" and time.monotonic() - start < 2
        events = read_events(open_stream(served.port, {**body, "stream": True}))
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "timeout"
        deadline = time.monotonic() + 10
        while engine.scheduler.stats["cancelled"] - before < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.scheduler.stats["cancelled"] - before == 2
    finally:
        served.stop()
        engine.close()


def test_shutdown_lets_short_streams_finish_and_ends_long_ones_with_done(tiny_folder):
    engine = make_engine(tiny_folder)
    slow_down(engine, 0.02)
    served = Served(engine, shutdown_timeout_s=1.5)
    try:
        short = open_stream(served.port, {"prompt": WORDS, "max_tokens": 10, "stream": True, "ignore_eos": True})
        long = open_stream(served.port, {"prompt": WORDS, "max_tokens": 110, "stream": True, "ignore_eos": True})
        assert read_events(long, count=1)
        start = time.monotonic()
        stopper = threading.Thread(target=served.stop)
        stopper.start()
        short_events, long_events = read_events(short), read_events(long)
        assert short_events[-1] == "[DONE]" and json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
        assert long_events[-1] == "[DONE]" and "shutting down" in json.loads(long_events[-2])["error"]["message"]
        assert time.monotonic() - start < 3.5
        stopper.join(30)
        assert not served.thread.is_alive()
    finally:
        served.stop()
        engine.close()


def test_ffl_serve_runs_in_its_own_process_and_stops_on_sigterm(tiny_folder):
    """`ffl-serve` as users start it: /health (503 while loading, then 200), /v1/models names the
    folder and not its path, a completion equals the engine's greedy tokens, the access log has a
    line per request and no prompt text, and SIGTERM ends it with status 0."""
    with socket.socket() as probe:  # a port free now; the server binds it moments later
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.Popen([sys.executable, "-m", "ffl_backend.serve.cli", "--model", str(tiny_folder), "--port",
                             str(port), "--max-batch-size", "2", "--max-seq-len", "64", "--compile", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                status, body = get(url + "/health")
            except OSError:
                status = None
            if status == 200:
                break
            assert status in (None, 503) and time.monotonic() < deadline, (status, body)
            time.sleep(0.1)
        assert json.loads(get(url + "/v1/models")[1])["data"][0]["id"] == tiny_folder.name
        reply = raw_request(port, post_raw("/v1/completions", json.dumps(
            {"prompt": WORDS, "max_tokens": 6, "temperature": 0, "return_token_ids": True}).encode()), timeout=60)
        status, out = status_and_json(reply)
        engine = make_engine(tiny_folder, max_batch_size=2, max_seq_len=64)
        try:
            want = engine.generate([engine.tokenizer(WORDS)["input_ids"]], max_new_tokens=6)[0].token_ids
        finally:
            engine.close()
        assert status == 200 and out["choices"][0]["token_ids"] == want
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            log = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("ffl-serve did not exit within 60 s of SIGTERM:\n" + proc.communicate()[0][-3000:])
    assert proc.returncode == 0, log[-3000:]
    assert "POST /v1/completions 200" in log and "possession" not in log
