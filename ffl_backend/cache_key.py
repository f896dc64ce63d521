"""Make Inductor's on-disk caches aware of ffl_backend's own code.

Inductor and AOT autograd key their caches on the traced graph, torch's sources and Inductor's
config, not on the Python bodies of our ops: on CPU a `fastflow.*` op is traced into ATen ops, so
after ffl_backend changes (an upgrade, a fixed kernel path) a warm cache would still serve the
graph compiled from the old body. Inductor includes the `uuid()` of any custom graph pass in its
config in the key; `SourceVersion` is a pass that does nothing and whose uuid hashes this package's
sources, so any change to them is a cache miss.

The uuid also names the vector ISA ATen runs (`ATEN_CPU_CAPABILITY` can lower it): torch 2.13's key
leaves it out, and a graph generated for 8-wide AVX2 vectors, recompiled for AVX-512 where
`Vectorized<float>` holds 16, stores past the ends of its buffers.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

PACKAGE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def source_hash() -> bytes:
    """sha256 over every .py file of the installed package (read once per process)."""
    return get_hash_for_files(tuple(str(p) for p in sorted(PACKAGE.rglob("*.py"))))


class SourceVersion(CustomGraphPass):
    """A no-op post-grad pass that carries ffl_backend's source hash and ATen's CPU vector ISA into
    Inductor's cache key."""

    def __call__(self, graph) -> None:
        return None

    def uuid(self) -> bytes:
        return source_hash() + torch.backends.cpu.get_cpu_capability().encode()


def cache_config(user_patches: dict) -> dict:
    """Inductor config patches for one fastflow compile: the user's, plus the source-version pass
    unless the user supplies their own post-grad post pass (theirs then decides caching)."""
    return {"post_grad_custom_post_pass": SourceVersion(), **user_patches}
