"""`OptimizedInferenceEngine`: continuous batching over a paged KV cache, sync and async.

    engine = OptimizedInferenceEngine(model_or_path, max_batch_size=8)
    results = engine.generate(["Hello", [1, 2, 3]], max_new_tokens=32)        # sync, in order
    stream = await engine.submit("Hello", SamplingParams(max_new_tokens=32))   # async
    async for chunk in stream: print(chunk.text, end="")                       # streamed tokens
    stream.cancel()

One background thread owns the model, the cache and the scheduler and steps while there is work
(model steps are blocking torch calls; a thread keeps an asyncio loop responsive). Submissions go
through a lock-protected list; tokens come back through per-request callbacks: for async requests
`loop.call_soon_threadsafe` puts them on the request's asyncio queue. Bad requests raise
`RequestError` from `submit` (in `generate`: that result carries the error) before touching the
engine; a failure inside a model step fails only the requests in that step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

import torch

from .sampling import RequestError, SamplingParams
from .scheduler import Request, Scheduler

logger = logging.getLogger("ffl_backend")


@dataclasses.dataclass
class Chunk:
    token_id: int
    text: str  # the text this token completes ("" while a multi-byte character is incomplete)
    logprob: float | None = None  # with SamplingParams.logprobs
    top_logprobs: list[tuple[int, float]] | None = None


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    error: str | None = None
    prompt_tokens: int = 0
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class _Detokenizer:
    """Incremental text at O(1) tokens per step: decode a short window that starts a few tokens
    back (so a word-initial space or a merge is seen in context), emit what it adds beyond the
    window's previous text, and hold back an incomplete multi-byte character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids = tokenizer, []
        self.prefix = self.read = 0  # ids[prefix:read] is the context already emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        if self.tokenizer is None:
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        text = decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


class RequestStream:
    """Async iterator of `Chunk`s for one request; `await stream.result()` gives the `Completion`."""

    def __init__(self, engine, req: Request, loop: asyncio.AbstractEventLoop):
        self._engine, self._req, self._loop = engine, req, loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._detok = _Detokenizer(engine.tokenizer)
        self._done = loop.create_future()
        req.on_token = lambda r, tok: self._post(tok)
        req.on_finish = lambda r: self._post(None)

    def _post(self, item) -> None:
        """Engine thread -> the request's loop. A closed loop (its client is gone) is not an error."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            self._req.cancel()

    @property
    def id(self) -> int:
        return self._req.id

    def cancel(self, reason: str = "cancelled") -> None:
        """Retire the request at the next step, freeing its blocks; `reason` "stop" when the caller
        found a stop string."""
        self._req.cancel(reason)
        self._engine._wake()

    @property
    def prompt_tokens(self) -> int:
        return len(self._req.prompt_ids)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        tok = await self._queue.get()
        if tok is None:
            self._queue.put_nowait(None)  # stay exhausted
            if not self._done.done():
                self._done.set_result(self._completion())
            if self._req.error is not None and self._req.finish_reason == "error":
                raise RuntimeError(self._req.error)
            raise StopAsyncIteration
        chunk = Chunk(tok, self._detok.push(tok))
        i = len(self._detok.ids) - 1
        if self._req.params.logprobs is not None and i < len(self._req.logprobs):
            chunk.logprob, chunk.top_logprobs = self._req.logprobs[i]
        return chunk

    def _completion(self) -> Completion:
        r = self._req
        text = self._engine.decode(r.output_ids) if self._engine.tokenizer is not None else None
        logprobs = list(r.logprobs) if r.params.logprobs is not None else None
        return Completion(list(r.output_ids), text, r.finish_reason, r.error, len(r.prompt_ids), logprobs)

    async def result(self) -> Completion:
        try:
            async for _ in self:
                pass
        except RuntimeError:
            pass
        if not self._done.done():
            self._done.set_result(self._completion())
        return self._done.result()


def _refuse_tensor_parallel(model) -> None:
    from ..quant.tensor_parallel import is_tensor_parallel, world_size

    if is_tensor_parallel(model) or world_size(model) > 1:
        raise NotImplementedError(
            "OptimizedInferenceEngine serves from one process; a tensor-parallel model needs every rank's "
            "scheduler to admit, preempt and sample in lock-step (requests broadcast from rank 0, the same "
            "batches and block tables on every rank), which the engine does not do yet. Under torchrun use "
            "ffl_backend.optimize(model) and generate() (examples/tensor_parallel_generate.py).")


class OptimizedInferenceEngine:
    def __init__(self, model_or_path, *, max_batch_size: int = 4, max_seq_len: int = 2048, quant=None,
                 device=None, block_size: int = 16, tokenizer=None, num_blocks: int | None = None,
                 cache_bytes: int | None = None, dtype=None, compile: str | None = "fastflow",
                 compile_options: dict | None = None, warmup: bool = True, kv_cache_dtype=None):
        from ..attention.kv_quant import storage_dtype
        from . import hf_paged
        from .paged_cache import blocks_for, make_paged_cache
        from .runner import ModelRunner

        if max_batch_size < 1 or max_seq_len < 2 or block_size < 1:
            raise ValueError("max_batch_size >= 1, max_seq_len >= 2 and block_size >= 1 are required")
        model, tokenizer = _load(model_or_path, tokenizer, dtype)
        _refuse_tensor_parallel(model)
        if quant is not None:
            from ..quant.quantizer import quantize

            model = quantize(model, quant)
        if device is not None:
            model.to(device)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_batch_size, self.max_seq_len, self.block_size = max_batch_size, max_seq_len, block_size
        self.max_blocks = blocks_for(max_seq_len, block_size)
        dtype = next(model.parameters()).dtype if dtype is None or isinstance(dtype, str) else dtype
        kv_dtype = storage_dtype(kv_cache_dtype)  # int8 / fp8 rows: more blocks in the same cache_bytes
        if num_blocks is None and cache_bytes is not None:
            probe = make_paged_cache(model.config, 2, block_size, dtype, "meta", kv_dtype)
            num_blocks = max(2, cache_bytes * 2 // probe.nbytes)
        self.num_blocks = num_blocks or max_batch_size * self.max_blocks + 1  # + the dummy block
        self._prev_attn = hf_paged.install(model)
        self.cache = make_paged_cache(model.config, self.num_blocks, block_size, dtype,
                                      next(model.parameters()).device, kv_dtype)
        self.runner = ModelRunner(model, self.cache, max_batch_size, self.max_blocks, compile, compile_options)
        self.scheduler = Scheduler(self.runner, max_batch_size, self.num_blocks, block_size, _eos_ids(model, tokenizer),
                                   window=_window_of_every_layer(model.config))
        self._lock = threading.Condition()
        self._incoming: list[Request] = []
        self._stop = False
        self.warmup_s = self.runner.warmup() if warmup else None
        self._thread = threading.Thread(target=self._loop, name="ffl-engine", daemon=True)
        self._thread.start()

    # -- engine thread ------------------------------------------------------------------------
    def _wake(self):
        with self._lock:
            self._lock.notify()

    def _loop(self):
        torch.set_grad_enabled(False)
        sched = self.scheduler
        while True:
            with self._lock:
                while not self._stop and not self._incoming and not sched.has_work:
                    self._lock.wait()
                if self._stop:
                    break
                for req in self._incoming:
                    sched.add(req)
                self._incoming.clear()
            try:
                sched.step()
            except Exception as exc:  # noqa: BLE001 - never let the thread die silently
                logger.exception("engine step failed")
                sched.fail_all(f"{type(exc).__name__}: {exc}")
        sched.fail_all("engine closed")
        for req in self._incoming:
            sched._finish(req, "error", "engine closed")

    def close(self) -> None:
        from . import hf_paged

        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join()
        hf_paged.uninstall(self.model, self._prev_attn)

    @property
    def alive(self) -> bool:
        """False once the engine thread has ended (closed, or died)."""
        return self._thread.is_alive() and not self._stop

    def load(self) -> dict:
        """Running and waiting requests and KV blocks in use, read without a lock (for metrics)."""
        s = self.scheduler
        free = s.allocator.free
        return {"running": len(s.running), "waiting": len(s.waiting) + len(self._incoming),
                "blocks_used": self.num_blocks - 1 - free, "blocks_free": free}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- requests -----------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("a text prompt needs a tokenizer; pass token ids or tokenizer=")
            return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.reshape(-1).tolist()
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in prompt):
            raise RequestError("prompt must be a string or a list of token ids")
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise RequestError(f"token ids must be in [0, {vocab})")
        return list(prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _make_request(self, prompt, params: SamplingParams | None, **kw) -> Request:
        if params is None:
            params = SamplingParams(**kw)
        elif kw:
            params = dataclasses.replace(params, **kw)
        params.validate()
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be in [0, {vocab})")
        params = dataclasses.replace(params, stop_token_ids=frozenset(params.stop_token_ids))
        ids = self.encode(prompt)
        if not ids:
            raise RequestError("empty prompt")
        total = len(ids) + params.max_new_tokens
        if total > self.max_seq_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                               f"exceeds max_seq_len={self.max_seq_len}")
        from .paged_cache import blocks_for

        if blocks_for(total, self.block_size) > self.num_blocks - 1:
            raise RequestError(f"{total} tokens need more KV blocks than the cache has ({self.num_blocks - 1})")
        return Request(ids, params)

    def _enqueue(self, req: Request) -> None:
        with self._lock:
            if self._stop:
                raise RuntimeError("engine is closed")
            self._incoming.append(req)
            self._lock.notify()

    async def submit(self, prompt, params: SamplingParams | None = None, **kw) -> RequestStream:
        """Validate and queue one request; raises RequestError for a bad one (nothing queued)."""
        req = self._make_request(prompt, params, **kw)
        stream = RequestStream(self, req, asyncio.get_running_loop())
        self._enqueue(req)
        return stream

    def generate(self, prompts_or_input_ids, max_new_tokens=16, temperature=1.0, top_p=1.0, do_sample=False,
                 seed=None, ignore_eos=False) -> list[Completion]:
        """Run every request through the continuous batcher; results in order. Each sampling
        argument is one value for all, or a list with one value per request. A bad request's
        result has `error` set and no tokens; the others run normally."""
        prompts = prompts_or_input_ids
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        elif isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]

        def per(value, i):
            return value[i] if isinstance(value, (list, tuple)) else value

        results: list[Completion | None] = [None] * len(prompts)
        pending, done = [], threading.Event()
        remaining = [0]
        lock = threading.Lock()

        def finished(req):
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

        for i, prompt in enumerate(prompts):
            try:
                params = SamplingParams(per(max_new_tokens, i), per(temperature, i), per(top_p, i),
                                        per(do_sample, i), per(seed, i), per(ignore_eos, i))
                req = self._make_request(prompt, params)
            except RequestError as exc:
                results[i] = Completion([], None, "error", str(exc))
                continue
            req.on_finish = finished
            pending.append((i, req))
        remaining[0] = len(pending)
        if not pending:
            return results
        for _, req in pending:
            self._enqueue(req)
        done.wait()
        for i, req in pending:
            text = self.decode(req.output_ids) if isinstance(prompts[i], str) and self.tokenizer else None
            results[i] = Completion(list(req.output_ids), text, req.finish_reason, req.error, len(req.prompt_ids))
        return results

    def stats(self) -> dict:
        s = self.scheduler
        return {**s.stats, "peak_blocks": s.peak_blocks, "num_blocks": self.num_blocks,
                "cache_bytes": self.cache.nbytes, "recompiles_after_warmup": self.runner.recompiles_since_warmup(),
                **self.runner.timings}


def _load(model_or_path, tokenizer, dtype):
    if not isinstance(model_or_path, (str, bytes)) and not hasattr(model_or_path, "__fspath__"):
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        return model_or_path, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(model_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")
    return model, tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)


def _eos_ids(model, tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def _window_of_every_layer(config) -> int | None:
    """The sliding window when every layer has one (blocks past it can be freed), else None: a
    full-attention layer (Gemma 2/3 mix both kinds) needs every block of the sequence."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    cfg = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(cfg)
    window = getattr(cfg, "sliding_window", None)
    return int(window) if window and layer_types and set(layer_types) == {"sliding_attention"} else None
