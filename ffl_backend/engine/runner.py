"""Model execution for the engine: prefill one sequence, decode a batch, at fixed shapes.

Decode runs at a few batch buckets (1, 2, 4, ... up to max_batch_size): the running batch is padded
to the smallest bucket that holds it; padded rows feed token 0 at position 0, write into the dummy
block's slot 0, see one key, and are dropped. The block table always has max_blocks columns
(max_seq_len / block_size), so each bucket is one fixed set of input shapes and one compiled graph
(`torch.compile(dynamic=False)`): requests arriving, growing and finishing never recompile. All
buckets are compiled at warm-up.

Prefill runs eagerly, batch 1 at the sequence's exact length (no padding, exact), writing its
k/v into the sequence's blocks through the same paged cache.
"""
from __future__ import annotations

import time

import torch

from ..generation import cache_kwarg
from .paged_cache import DUMMY_BLOCK


def batch_buckets(max_batch_size: int) -> list[int]:
    buckets, b = [], 1
    while b < max_batch_size:
        buckets.append(b)
        b *= 2
    return buckets + [max_batch_size]


def unique_graphs() -> int:
    """Graphs Dynamo has compiled in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class ModelRunner:
    def __init__(self, model, cache, max_batch_size: int, max_blocks: int, compile_backend: str | None = "fastflow",
                 compile_options: dict | None = None):
        self.model, self.cache = model, cache
        self.cache_kw = cache_kwarg(model)  # `cache` (transformers 5.24) or `past_key_values` (earlier 5.x)
        self.device = next(model.parameters()).device
        self.block_size = cache.block_size
        self.max_blocks = max_blocks
        self.buckets = batch_buckets(max_batch_size)
        self.compile_backend = compile_backend
        self.timings = {"prefill_s": 0.0, "decode_s": 0.0}
        self._decode_fn = self._forward
        if compile_backend is not None:
            kwargs = {"options": compile_options} if compile_options else {}
            self._decode_fn = torch.compile(self._forward, backend=compile_backend, dynamic=False, **kwargs)
        self.graphs_after_warmup: int | None = None

    def _forward(self, input_ids, position_ids, slot_mapping, block_tables, seq_lens):
        out = self.model(input_ids=input_ids, position_ids=position_ids, **{self.cache_kw: self.cache},
                         use_cache=True, slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens)
        return out.logits[:, -1].float()

    def _slots(self, positions, blocks) -> list[int]:
        bs = self.block_size
        return [blocks[p // bs] * bs + p % bs for p in positions]

    @torch.no_grad()
    def prefill(self, tokens: list[int], blocks: list[int]) -> torch.Tensor:
        """Write the k/v of `tokens` (positions 0..n-1) into `blocks`; logits of the last (V,)."""
        t0 = time.perf_counter()
        n = len(tokens)
        dev = self.device
        ids = torch.tensor([tokens], dtype=torch.long, device=dev)
        pos = torch.arange(n, device=dev)[None]
        slots = torch.tensor(self._slots(range(n), blocks), dtype=torch.long, device=dev)
        self.cache.step_slots, self.cache.step_paged = slots, False
        out = self.model(input_ids=ids, position_ids=pos, **{self.cache_kw: self.cache}, use_cache=True,
                         slot_mapping=slots, logits_to_keep=1)
        logits = out.logits[0, -1].float().cpu()
        self.timings["prefill_s"] += time.perf_counter() - t0
        return logits

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @torch.no_grad()
    def decode(self, rows: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """rows: (newest token, its position, the sequence's blocks). Returns logits (len(rows), V)."""
        t0 = time.perf_counter()
        n, size = len(rows), self.bucket(len(rows))
        ids = [tok for tok, _, _ in rows] + [0] * (size - n)
        pos = [p for _, p, _ in rows] + [0] * (size - n)
        slots = [self._slots([p], blocks)[0] for _, p, blocks in rows] + [DUMMY_BLOCK * self.block_size] * (size - n)
        table = torch.full((size, self.max_blocks), DUMMY_BLOCK, dtype=torch.int32)
        for i, (_, _, blocks) in enumerate(rows):
            table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        lens = torch.tensor([p + 1 for p in pos[:n]] + [1] * (size - n), dtype=torch.int32)
        dev = self.device
        slots = torch.tensor(slots, device=dev)
        self.cache.step_slots, self.cache.step_paged = slots, True
        logits = self._decode_fn(torch.tensor(ids, device=dev)[:, None], torch.tensor(pos, device=dev)[:, None],
                                 slots, table.to(dev), lens.to(dev))
        logits = logits[:n].cpu()
        self.timings["decode_s"] += time.perf_counter() - t0
        return logits

    def warmup(self) -> float:
        """Compile (or run once) every bucket with all-padding batches; returns seconds spent."""
        t0 = time.perf_counter()
        dev = self.device
        for size in self.buckets:
            self.cache.step_slots, self.cache.step_paged = torch.zeros(size, dtype=torch.long, device=dev), True
            with torch.no_grad():
                self._decode_fn(torch.zeros((size, 1), dtype=torch.long, device=dev),
                                torch.zeros((size, 1), dtype=torch.long, device=dev),
                                torch.zeros(size, dtype=torch.long, device=dev),
                                torch.zeros((size, self.max_blocks), dtype=torch.int32, device=dev),
                                torch.ones(size, dtype=torch.int32, device=dev))
        self.graphs_after_warmup = unique_graphs()
        return time.perf_counter() - t0

    def recompiles_since_warmup(self) -> int:
        return 0 if self.graphs_after_warmup is None else unique_graphs() - self.graphs_after_warmup
