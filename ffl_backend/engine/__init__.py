"""The inference engine: continuous batching over a paged KV cache, with streaming (engine.py).
Its HTTP server, `ffl-serve`, is ffl_backend.serve. Nothing is imported until used."""
from .._lazy import lazy_getattr

__all__ = ["OptimizedInferenceEngine", "SamplingParams", "RequestError", "Completion", "Chunk"]

__getattr__ = lazy_getattr(__name__, {"OptimizedInferenceEngine": "engine", "Completion": "engine",
                                      "Chunk": "engine", "SamplingParams": "sampling", "RequestError": "sampling"})
