"""Continuous batching: a waiting queue, a running set, block accounting and preemption.

One `step()`:
1. retire cancelled requests (waiting or running), freeing their blocks at once;
2. admit waiting requests, oldest first, while the batch has room and the free blocks hold the
   request's tokens plus the one its first decode step writes; each admitted request is prefilled
   alone (batch 1, its exact length) and its first token emitted;
3. make sure every running sequence has a slot for the token it writes this step; when the pool is
   exhausted, preempt the newest running request (free its blocks, put it back at the head of the
   queue with its generated tokens: it is recomputed by a prefill of prompt + output when admitted);
4. one decode step for the whole running batch (the runner pads it to a bucket), one token each,
   emitted; finished requests (eos, max_new_tokens) retire immediately.

With `window` set (every layer of the model a sliding-window layer, e.g. Mistral), a block whose
tokens every future query is past the window of goes back to the pool as soon as that holds; its
table entry becomes the dummy block, which the paged attention never reads for such rows.

The scheduler runs on the engine thread only; other threads talk to it through `Request.cancel()`
(a flag read at the next step) and the engine's submission queue.
"""
from __future__ import annotations

import collections
import itertools
import logging
import time

from .paged_cache import DUMMY_BLOCK, BlockAllocator, blocks_for
from .sampling import SamplingParams, sample, token_logprobs

logger = logging.getLogger("ffl_backend")
_ids = itertools.count()


class Request:
    """One generation request and its state. `on_token(req, token_id)` and `on_finish(req)` are
    called on the engine thread."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, on_token=None, on_finish=None):
        self.id = next(_ids)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.generator = params.generator()
        self.output_ids: list[int] = []
        self.blocks: list[int] = []
        self.finish_reason: str | None = None  # "stop" (eos, stop id or string), "length", "cancelled", "error"
        self.error: str | None = None
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []  # per output token, when asked
        self.preemptions = 0
        self.arrival = time.monotonic()
        self._cancel_reason: str | None = None
        self.on_token = on_token
        self.on_finish = on_finish

    def cancel(self, reason: str = "cancelled") -> None:
        """Retire at the next step with this finish reason ("stop" when a stop string matched)."""
        if self._cancel_reason is None:
            self._cancel_reason = reason

    @property
    def cancelled(self) -> bool:
        return self._cancel_reason is not None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cached(self) -> int:
        """Tokens whose k/v are in the cache while running: all but the newest output token."""
        return len(self.prompt_ids) + len(self.output_ids) - 1


class Scheduler:
    def __init__(self, runner, max_batch_size: int, num_blocks: int, block_size: int, eos_ids=(),
                 window: int | None = None):
        self.runner, self.window = runner, window
        self.max_batch_size = max_batch_size
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.eos_ids = set(eos_ids)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.stats = collections.Counter()
        self.peak_blocks = 0

    # -- queues -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, req: Request) -> None:
        self.allocator.release([b for b in req.blocks if b != DUMMY_BLOCK])
        req.blocks = []

    def _drop_out_of_window(self, req: Request) -> None:
        """Free the blocks the next query (at position `cached`) and all later ones cannot see: block
        i holds positions up to (i + 1) * block_size - 1, visible while p - that < window."""
        if self.window is None or req.done:
            return
        gone = max(0, req.cached - self.window + 1) // self.block_size
        freed = [b for b in req.blocks[:gone] if b != DUMMY_BLOCK]
        if freed:
            self.allocator.release(freed)
            req.blocks[:gone] = [DUMMY_BLOCK] * gone
            self.stats["window_freed_blocks"] += len(freed)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        req.finish_reason, req.error = reason, error
        self.stats[reason] += 1
        if req.on_finish is not None:
            req.on_finish(req)

    def fail_all(self, error: str) -> None:
        for req in list(self.running) + list(self.waiting):
            self._finish(req, "error", error)
        self.waiting.clear()

    def _emit(self, req: Request, token: int) -> None:
        req.output_ids.append(token)
        self.stats["tokens"] += 1
        if req.on_token is not None:
            req.on_token(req, token)
        if (token in self.eos_ids and not req.params.ignore_eos) or token in req.params.stop_token_ids:
            self._finish(req, "stop")
        elif len(req.output_ids) >= req.params.max_new_tokens:
            self._finish(req, "length")

    def _track(self) -> None:
        used = self.allocator.num_blocks - 1 - self.allocator.free
        self.peak_blocks = max(self.peak_blocks, used)

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> None:
        for req in [r for r in itertools.chain(self.running, self.waiting) if r.cancelled]:
            if req in self.waiting:
                self.waiting.remove(req)
            self._finish(req, req._cancel_reason)
        self._admit()
        if self.running:
            self._reserve_decode_slots()
        if self.running:
            self._decode()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            n = len(req.tokens)
            if self.allocator.free < blocks_for(n + 1, self.block_size):
                break  # oldest first: no overtaking, so a long request cannot starve
            self.waiting.popleft()
            req.blocks = self.allocator.allocate(blocks_for(n, self.block_size))
            self._track()
            try:
                logits = self.runner.prefill(req.tokens, req.blocks)
            except Exception as exc:  # noqa: BLE001 - this request fails, the engine keeps serving
                logger.exception("prefill failed for request %d", req.id)
                self._finish(req, "error", f"{type(exc).__name__}: {exc}")
                continue
            self.stats["prefills"] += 1
            self.stats["prefill_tokens"] += n
            self.running.append(req)
            self._sample_and_emit(req, logits)

    def _reserve_decode_slots(self) -> None:
        """Each running sequence writes the k/v of its newest token at position `cached`."""
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if blocks_for(req.cached + 1, self.block_size) <= len(req.blocks):
                i += 1
                continue
            if self.allocator.free == 0:
                # the newest arrival: FIFO fairness kept, and it has the least work to recompute
                self._preempt(max(self.running, key=lambda r: r.arrival))
                i = 0  # the list changed; sequences already served are skipped by the check above
                continue
            req.blocks += self.allocator.allocate(1)
            self._track()
            i += 1

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(req)  # older than anything still waiting
        logger.debug("preempted request %d at %d tokens", req.id, len(req.tokens))

    def _decode(self) -> None:
        batch = list(self.running)
        try:
            logits = self.runner.decode([(r.output_ids[-1], r.cached, r.blocks) for r in batch])
        except Exception as exc:  # noqa: BLE001
            logger.exception("decode step failed")
            for req in batch:
                self._finish(req, "error", f"{type(exc).__name__}: {exc}")
            return
        self.stats["decode_steps"] += 1
        for row, req in enumerate(batch):
            if not req.done:
                self._sample_and_emit(req, logits[row])

    def _sample_and_emit(self, req: Request, logits) -> None:
        """A failure here (sampling, logprobs, a callback) fails this request only."""
        try:
            token = sample(logits, req.params, req.generator, req.prompt_ids, req.output_ids)
            if req.params.logprobs is not None:
                req.logprobs.append(token_logprobs(logits, token, req.params.logprobs))
            self._emit(req, token)
        except Exception as exc:  # noqa: BLE001
            logger.exception("sampling failed for request %d", req.id)
            if not req.done:
                self._finish(req, "error", f"{type(exc).__name__}: {exc}")
            return
        self._drop_out_of_window(req)
