"""`ffl-serve`: an OpenAI-style completions endpoint over `OptimizedInferenceEngine` (stdlib only).

    ffl-serve --model PATH [--host 127.0.0.1] [--port 8000] [--max-batch-size 4] ...
    curl -s localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 16}'
    curl -sN localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 16, "stream": true}'

POST /v1/completions takes prompt (a string, or a list of token ids), max_tokens (16), temperature
(1.0; 0 = greedy), top_p (1.0), seed, stream. The reply is one JSON object, or with "stream" a
server-sent-event stream: `data: {...}` chunks (one per token, text delta), then `data: [DONE]`.
Bad requests get 400 with {"error": {"message", "type": "invalid_request_error"}}; the engine goes on
serving everything else. A client that disconnects mid-stream cancels its request. GET /health,
GET /v1/models. HTTP/1.1, one request per connection (Connection: close). Loopback by default.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time

from .sampling import RequestError, SamplingParams

logger = logging.getLogger("ffl_backend")
MAX_BODY = 8 << 20
_FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "seed", "stream", "model", "n", "user"}


def parse_completion_request(body: dict) -> tuple[object, SamplingParams, bool]:
    """(prompt, params, stream) from an OpenAI completions body; RequestError when invalid."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = set(body) - _FIELDS
    if unknown:
        raise RequestError(f"unsupported field(s): {', '.join(sorted(unknown))}")
    if body.get("n", 1) != 1:
        raise RequestError("only n=1 is supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # OpenAI's batch form with a single prompt
    if prompt is None or not isinstance(prompt, (str, list)):
        raise RequestError("prompt must be a string or a list of token ids")
    temperature = body.get("temperature", 1.0)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean")
    params = SamplingParams(max_new_tokens=body.get("max_tokens", 16), temperature=temperature,
                            top_p=body.get("top_p", 1.0), seed=body.get("seed"),
                            do_sample=isinstance(temperature, (int, float)) and temperature > 0)
    try:
        params.validate()
    except RequestError as exc:  # name the field as the client sent it
        raise RequestError(str(exc).replace("max_new_tokens", "max_tokens")) from None
    return prompt, params, stream


class Server:
    def __init__(self, engine, model_name: str = "ffl"):
        self.engine, self.model_name = engine, model_name

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._handle(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:  # noqa: BLE001 - one connection's bug must not stop the server
            logger.exception("ffl-serve: request failed")
            try:
                await self._json(writer, 500, {"error": {"message": "internal error", "type": "server_error"}})
            except Exception:  # noqa: BLE001
                pass
        finally:
            writer.close()

    async def _handle(self, reader, writer) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = (lines[0].split(" ", 2) + ["", ""])[:3]
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        length = int(headers.get("content-length", "0") or 0)
        if length > MAX_BODY:
            return await self._error(writer, 413, "request body too large")
        body = await reader.readexactly(length) if length else b""
        path = path.split("?", 1)[0]
        if path == "/health" and method == "GET":
            return await self._json(writer, 200, {"status": "ok", **self.engine.stats()})
        if path == "/v1/models" and method == "GET":
            return await self._json(writer, 200,
                                    {"object": "list", "data": [{"id": self.model_name, "object": "model"}]})
        if path != "/v1/completions":
            return await self._error(writer, 404, f"no route {path}")
        if method != "POST":
            return await self._error(writer, 405, "use POST")
        try:
            prompt, params, stream = parse_completion_request(json.loads(body or b"null"))
            handle = await self.engine.submit(prompt, params)
        except json.JSONDecodeError as exc:
            return await self._error(writer, 400, f"invalid JSON: {exc}")
        except RequestError as exc:
            return await self._error(writer, 400, str(exc))
        rid, created = f"cmpl-{handle.id}", int(time.time())

        def payload(text, finish, extra=None):
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, **(extra or {})}
            return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [choice]}

        if not stream:
            try:
                done = await handle.result()
            except asyncio.CancelledError:
                handle.cancel()
                raise
            if done.finish_reason == "error":
                return await self._error(writer, 500, done.error or "generation failed", "server_error")
            out = payload(done.text if done.text is not None else "", done.finish_reason,
                          {"token_ids": done.token_ids})
            out["usage"] = {"prompt_tokens": done.prompt_tokens, "completion_tokens": len(done.token_ids),
                            "total_tokens": done.prompt_tokens + len(done.token_ids)}
            return await self._json(writer, 200, out)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     b"Connection: close\r\n\r\n")
        try:
            async for chunk in handle:
                writer.write(_sse(payload(chunk.text, None, {"token_ids": [chunk.token_id]})))
                await writer.drain()
            done = await handle.result()
            writer.write(_sse(payload("", done.finish_reason)) + b"data: [DONE]\n\n")
            await writer.drain()
        except RuntimeError as exc:  # the request failed inside the engine
            writer.write(_sse({"error": {"message": str(exc), "type": "server_error"}}))
            await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            handle.cancel()  # the client went away: free its batch slot and blocks
            raise

    async def _json(self, writer, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                  413: "Payload Too Large", 500: "Internal Server Error"}.get(status, "")
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
                     f"\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()

    async def _error(self, writer, status: int, message: str, kind: str = "invalid_request_error") -> None:
        await self._json(writer, status, {"error": {"message": message, "type": kind}})


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def start(engine, host: str = "127.0.0.1", port: int = 8000, model_name: str = "ffl") -> asyncio.AbstractServer:
    """Start serving on the running loop; port 0 picks a free one (server.sockets[0].getsockname())."""
    return await asyncio.start_server(Server(engine, model_name).handle, host, port)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ffl-serve", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model folder or hub id (default: the local SmolLM2-135M)")
    parser.add_argument("--host", default="127.0.0.1", help="default loopback only; 0.0.0.0 exposes it")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the checkpoint's)")
    parser.add_argument("--quant", default=None, help="int8, int4, ... (ffl_backend.quantize)")
    parser.add_argument("--compile", default="fastflow", help="fastflow, inductor or none")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    import torch

    from .engine import OptimizedInferenceEngine

    model = args.model
    if model is None:
        from ..models import smollm2_path

        model = smollm2_path()
    engine = OptimizedInferenceEngine(
        model, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, block_size=args.block_size,
        num_blocks=args.num_blocks, quant=args.quant, dtype=getattr(torch, args.dtype) if args.dtype else None,
        compile=None if args.compile == "none" else args.compile)

    async def serve():
        server = await start(engine, args.host, args.port, model_name=str(args.model or "smollm2-135m"))
        logger.info("ffl-serve: listening on http://%s:%d/v1/completions", args.host, args.port)
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
