"""The inference engine: continuous batching over a paged KV cache, with streaming (engine.py),
and `ffl-serve`, its OpenAI-style HTTP server (server.py). Nothing is imported until used."""
from .._lazy import lazy_getattr

__all__ = ["OptimizedInferenceEngine", "SamplingParams", "RequestError", "Completion", "Chunk"]

__getattr__ = lazy_getattr(__name__, {"OptimizedInferenceEngine": "engine", "Completion": "engine",
                                      "Chunk": "engine", "SamplingParams": "sampling", "RequestError": "sampling"})
