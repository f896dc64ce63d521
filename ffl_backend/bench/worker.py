"""One benchmark configuration, measured in the process that runs this module.

    python -m ffl_backend.bench.worker '<configuration JSON>'     (prints one JSON line)
    python -m ffl_backend.bench.worker --serve '<configuration JSON>'   (times on request: serve())

The grid (grid.py) starts a fresh interpreter per configuration, so compiled code, allocator state,
Dynamo counters and the peak-RSS high-water mark all belong to this configuration alone; the
measuring itself is session.py's.
"""
from __future__ import annotations

import json
import sys

from .llamacpp import LlamaCppSession
from .onnxruntime_rows import BACKENDS as ORT_BACKENDS
from .onnxruntime_rows import OrtSession
from .session import Session


def open_session(cfg: dict) -> Session:
    """The session for `cfg`'s backend: llama.cpp and ONNX Runtime rows have their own."""
    if cfg["backend"] == "llamacpp":
        return LlamaCppSession(cfg)
    if cfg["backend"] in ORT_BACKENDS:
        return OrtSession(cfg)
    return Session(cfg)


def run_one(cfg: dict) -> dict:
    """Load (and quantize), configure, compile on the first generate, then time `repeats` generates.

    mode "warm" stops after the first generate: it is the second process of a configuration, run to
    time compilation when Inductor's on-disk caches (FX graph, AOT and C++/Triton code) are warm."""
    session = open_session(cfg)
    if cfg.get("mode") == "warm":
        return session.setup
    for _ in range(cfg["repeats"]):
        session.timed()
    return session.summary()


def serve(cfg: dict, requests=None, replies=None) -> None:
    """Interleaved timing (bench/interleave.py): set up, say `{"ready": true}`, then answer each
    request line -- "time": one timed generate, its decode tok/s; "finish": the summary, and return.
    One JSON line per reply."""
    requests, replies = requests or sys.stdin, replies or sys.stdout
    lead = rank() == 0  # under torchrun only rank 0 reads requests and replies; the others follow it

    def reply(obj):
        if lead:
            replies.write(json.dumps(obj) + "\n")
            replies.flush()

    session = open_session(cfg)
    reply({"ready": True})
    for line in follow(requests if lead else None):
        if line.strip() == "time":
            reply({"decode_tok_s": session.timed()["decode_tok_s"]})
        elif line.strip() == "finish":
            reply(session.summary())
            return
        else:
            reply({"error": f"unknown request {line.strip()!r}"})


def rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


def follow(requests):
    """The request lines: read by rank 0 and broadcast to the other tensor-parallel ranks, so every
    rank runs the same generates; just the lines in one process. Ends after "finish" or at EOF."""
    import torch.distributed as dist

    if not dist.is_initialized():
        yield from requests
        return
    lines = iter(requests) if requests is not None else None
    while True:
        box = [next(lines, None) if lines is not None else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        yield box[0]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[0] == "--serve":
        serve(json.loads(argv[1]))
    else:
        result = run_one(json.loads(argv[0]))
        if rank() == 0:
            print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
