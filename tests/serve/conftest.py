"""ffl-serve test fixtures: the real app on uvicorn (the guarded h11 protocol, as `ffl-serve` runs
it) in a thread, over the tiny random Llama with a word-level tokenizer and a one-line chat
template; raw-socket helpers for what well-behaved clients never send."""
import json
import socket
import threading
import time

import pytest

from tests.tiny_models import save_tiny_folder

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
WORDS = "It is a truth universally acknowledged that a single man in possession of a good fortune"


class Served:
    """A running server: `.port`, `.engine`, `.state`; `stop()` as SIGTERM would."""

    def __init__(self, engine, **config):
        from ffl_backend.serve.app import build_app
        from ffl_backend.serve.cli import make_server, uvicorn_config
        from ffl_backend.serve.state import ServeConfig, ServerState

        header_timeout = config.pop("header_timeout", 1.0)
        max_connections = config.pop("max_connections", 512)
        self.engine = engine
        self.state = ServerState(ServeConfig(**{"served_model_names": ("tiny",), "body_timeout_s": 1.0,
                                                "max_body_bytes": 1 << 20, **config}), engine)
        cfg = uvicorn_config(build_app(self.state), self.state, "127.0.0.1", 0, max_header_bytes=8 << 10,
                             header_timeout=header_timeout, max_connections=max_connections)
        self.server = make_server(cfg, self.state)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, api_key="unused", **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def stop(self):
        if self.thread.is_alive():
            self.server.handle_exit(15, None)
            self.thread.join(30)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """The tiny Llama with a word-level tokenizer that has a word for every id of its vocabulary
    (so generated text is never empty and stop strings have something to match)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_models import VOCAB

    folder = save_tiny_folder(tmp_path_factory.mktemp("serve") / "tiny")
    words = ["<pad>", "<s>", "</s>", "<unk>"] + sorted(set(WORDS.replace(",", "").split()))
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    return folder


def make_engine(folder, **kw):
    from ffl_backend.engine import OptimizedInferenceEngine

    engine = OptimizedInferenceEngine(str(folder), **{"max_batch_size": 4, "max_seq_len": 128, "compile": None,
                                                      **kw})
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    return engine


@pytest.fixture(scope="module")
def served(tiny_folder):
    engine = make_engine(tiny_folder)
    served = Served(engine)
    yield served
    served.stop()
    engine.close()


def raw_request(port, data: bytes, timeout=5.0, read=True) -> bytes:
    """Send bytes as they are; the whole reply until the server closes (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        if not read:
            return b""
        out = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except (socket.timeout, ConnectionResetError):
                break
            if not chunk:
                break
            out += chunk
            if _complete(out):
                break
        return out


def _complete(reply: bytes) -> bool:
    head, sep, body = reply.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def status_and_json(reply: bytes):
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body else None


def post_raw(path: str, body: bytes, headers: dict | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def engine_greedy(engine, ids, n, **kw):
    """The engine's own greedy tokens for a prompt (the server must give the same)."""
    return engine.generate([ids], max_new_tokens=n, **kw)[0].token_ids
