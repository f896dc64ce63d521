"""Clients that go away: 32 concurrent streams, 8 dropped mid-stream (4 with a reset, 4 with a
FIN) and 4 non-streaming clients that hang up: exactly those 12 engine requests are cancelled, the
others finish, and every KV block returns to the pool."""
import json
import socket
import struct
import threading
import time

from .conftest import WORDS, Served, make_engine, post_raw


def slow_down(engine, seconds):
    """Every decode step takes at least `seconds`: the test's clients act while requests still run."""
    decode = engine.runner.decode

    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return decode(*args, **kwargs)

    engine.runner.decode = slowed


def open_stream(port, body):
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(post_raw("/v1/completions", json.dumps(body).encode()))
    return sock


def read_events(sock, count=None):
    """Read SSE data events; stop after `count` token chunks (None: until [DONE])."""
    data, events = b"", []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return events
        data += chunk
        while b"\n\n" in data:
            event, data = data.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    events.append(line[6:].decode())
            if events and events[-1] == "[DONE]" or (count is not None and len(events) >= count):
                return events


def drop(sock, reset: bool):
    if reset:  # RST: SO_LINGER with a zero timeout
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_dropped_streams_and_hung_up_clients_are_cancelled_and_free_their_blocks(tiny_folder):
    engine = make_engine(tiny_folder, max_batch_size=8)
    slow_down(engine, 0.004)
    served = Served(engine)
    try:
        stats = engine.scheduler.stats
        cancelled_before, free_before = stats["cancelled"], engine.scheduler.allocator.free
        body = {"prompt": WORDS, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
        dropped = set(range(0, 32, 4))  # 8 of 32, the longest requests: still running when dropped
        socks = [open_stream(served.port, {**body, "max_tokens": 100} if i in dropped else body) for i in range(32)]
        hangups = [open_stream(served.port, {**body, "stream": False, "max_tokens": 100}) for _ in range(4)]
        deadline = time.monotonic() + 30
        while served.state.in_flight < 36:  # all submitted
            assert time.monotonic() < deadline, served.state.in_flight
            time.sleep(0.01)
        for sock in hangups:  # queued behind 32 streams of 60 tokens
            drop(sock, reset=False)
        done, drops = {}, {}

        def client(i):  # one thread each: a stream is dropped right after its second token, whenever it runs
            if i in dropped:
                drops[i] = len(read_events(socks[i], count=2))  # running: two tokens in
                drop(socks[i], reset=(i // 4) % 2 == 0)
            else:
                done[i] = read_events(socks[i])

        readers = [threading.Thread(target=client, args=(i,)) for i in range(32)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(60)
        deadline = time.monotonic() + 30
        while served.state.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert served.state.in_flight == 0
        assert drops == {i: 2 for i in dropped}
        assert stats["cancelled"] - cancelled_before == 12
        assert all(events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
                   for events in done.values()) and len(done) == 24
        assert engine.scheduler.allocator.free == free_before and not engine.scheduler.running
    finally:
        served.stop()
        engine.close()
