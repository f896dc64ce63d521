"""`ffl-serve`: the OpenAI-compatible server (uvicorn) over `OptimizedInferenceEngine`.

    ffl-serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

The port is open at once: /health answers 503 {"status": "loading"} until the engine is ready (a
model that fails to load ends the process with status 1). SIGTERM / SIGINT: stop accepting, give
streams --shutdown-timeout seconds to finish, then end them with an error event and [DONE].
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

logger = logging.getLogger("ffl_backend.serve")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ffl-serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF model folder or hub id (default: the local SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) clients use (default: the model folder's name, never its path)")
    p.add_argument("--host", default="127.0.0.1", help="default: loopback only; 0.0.0.0 exposes the server")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("FFL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $FFL_API_KEY; /health stays open)")
    p.add_argument("--allowed-origins", nargs="*", default=[], help="CORS origins (default: CORS off)")
    p.add_argument("--chat-template", type=Path, help="a Jinja chat template file (default: the tokenizer's)")
    p.add_argument("--max-queued", type=int, default=64,
                   help="requests waiting beyond the running batch; more get 429 with Retry-After")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (0: none)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, help="seconds streams get after SIGTERM")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20)
    p.add_argument("--max-header-bytes", type=int, default=16 << 10)
    p.add_argument("--header-timeout", type=float, default=10.0, help="seconds to send the request headers")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds without body bytes")
    p.add_argument("--max-connections", type=int, default=512, help="more get 503")
    p.add_argument("--log-prompts", action="store_true", help="log prompts and messages (off: privacy)")
    engine = p.add_argument_group("engine")
    engine.add_argument("--max-batch-size", type=int, default=8)
    engine.add_argument("--max-seq-len", type=int, default=2048)
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--num-blocks", type=int, default=None)
    engine.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the checkpoint's)")
    engine.add_argument("--quant", default=None, help="int8, int4, ... (ffl_backend.quantize)")
    engine.add_argument("--kv-cache-dtype", default=None, choices=[None, "int8", "fp8"])
    engine.add_argument("--compile", default="fastflow", help="fastflow, inductor or none")
    return p


def _serve_config(args, model: str):
    from .state import ServeConfig

    default = Path(model).name if Path(model).is_dir() else model  # a folder's name, a hub id as given
    names = tuple(args.served_model_name or [default or "ffl"])
    return ServeConfig(
        served_model_names=names, api_key=args.api_key or None, allowed_origins=tuple(args.allowed_origins),
        max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout, max_queued=args.max_queued,
        request_timeout_s=args.request_timeout or None, shutdown_timeout_s=args.shutdown_timeout,
        log_prompts=args.log_prompts, chat_template=args.chat_template.read_text() if args.chat_template else None)


def _load_engine(args, model: str):
    import torch

    from ..engine import OptimizedInferenceEngine

    return OptimizedInferenceEngine(
        model, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, block_size=args.block_size,
        num_blocks=args.num_blocks, quant=args.quant, dtype=getattr(torch, args.dtype) if args.dtype else None,
        compile=None if args.compile == "none" else args.compile, kv_cache_dtype=args.kv_cache_dtype)


def uvicorn_config(app, state, host: str, port: int, max_header_bytes: int = 16 << 10,
                   header_timeout: float = 10.0, max_connections: int | None = 512):
    """uvicorn settings for `app`: the guarded h11 protocol, connection cap, graceful shutdown."""
    import uvicorn

    from .transport import guarded_protocol

    protocol = guarded_protocol(header_timeout, max_header_bytes)
    return uvicorn.Config(app, host=host, port=port, http=protocol, lifespan="off",
                          h11_max_incomplete_event_size=max_header_bytes, limit_concurrency=max_connections,
                          timeout_graceful_shutdown=int(state.config.shutdown_timeout_s) + 2, access_log=False,
                          log_config=None, timeout_keep_alive=5)


def make_server(config, state):
    """A uvicorn.Server whose SIGTERM/SIGINT also starts the streams' grace period."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if self.started and not self.should_exit:
                logger.info("ffl-serve: stopping; streams get %.0f s to finish", state.config.shutdown_timeout_s)
            loop = getattr(self, "_ffl_loop", None)
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(state.begin_shutdown)
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            import asyncio

            self._ffl_loop = asyncio.get_running_loop()
            state.stop_event()  # created on the serving loop
            await super().startup(sockets)

    return Server(config)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .app import build_app
    from .state import ServerState

    model = args.model
    if model is None:
        from ..models import smollm2_path

        model = str(smollm2_path())
    state = ServerState(_serve_config(args, model))
    server = make_server(uvicorn_config(build_app(state), state, args.host, args.port, args.max_header_bytes,
                                        args.header_timeout, args.max_connections), state)

    def load():
        try:
            state.engine = _load_engine(args, model)
            logger.info("ffl-serve: %s ready as %s on http://%s:%d/v1", model,
                        ", ".join(state.config.served_model_names), args.host, args.port)
        except BaseException as exc:  # noqa: BLE001 - reported by /health and the exit status
            logger.exception("ffl-serve: the model failed to load")
            state.load_error = f"{type(exc).__name__}: {exc}"
            server.should_exit = True

    threading.Thread(target=load, name="ffl-load", daemon=True).start()
    # uvicorn re-raises the signal that stopped it once it is done; after a graceful stop that
    # signal is handled here, so the exit status says how the server ended, not that it was asked to
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        if state.engine is not None:
            state.engine.close()
    return 1 if state.load_error else 0


if __name__ == "__main__":
    raise SystemExit(main())
