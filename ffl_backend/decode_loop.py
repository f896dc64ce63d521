"""The decode loop behind `model.generate()` after `ffl_backend.optimize()`: greedy and sampling.

transformers' loop spends per token what a compiled decode step does not need: building the 4-D
attention mask eagerly, re-slicing and concatenating inputs, masks and position ids, a fresh output
object, Dynamo's full guard check. This loop keeps fixed-shape input buffers (token, position ids,
a full-length 2-D mask; the mask is made inside the compiled step) and updates them in place, so
every decode step is one call of the same compiled graph; the logits processors and stopping
criteria transformers would build for the same request are applied between steps, so results follow
`generate()`'s semantics (tokens, eos/padding, sampling draws from the same RNG calls).

Guards: Dynamo checks its full guards on the first two decode steps of every generate() call (so a
changed model, dtype, batch size or device recompiles or raises as usual); the steps after them skip
Dynamo's per-call work where that is safe (replay.py; FFL_GUARDED=1 turns that off).

The prompt: one eager forward, or (`compile_prefill`) `prompt_step` compiled with the sequence
dimension dynamic (2 .. max_seq_len tokens), so one graph serves every prompt length. Padded prompts
and one-token prompts stay eager: the masked attention path reads its filled length as a number, and
a dynamic dimension of one token is not one Dynamo keeps dynamic.

Everything else -- beam search, assisted or contrastive decoding, returning scores or a dict, several
sequences per prompt, inputs_embeds, a cache passed in -- goes to transformers' own loop, with the
reason logged once per reason.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from . import progress, replay
from .generation import cache_kwarg
from .kernels import cpu_argmax as cpu_argmax_op

logger = logging.getLogger("ffl_backend")

# generate() arguments (besides the token ids) the loop takes; any other model input falls back.
_MODEL_INPUTS = ("attention_mask", "use_cache", "logits_to_keep")
_reported: set = set()


def _report_fallback(reason: str) -> None:
    if reason not in _reported:
        _reported.add(reason)
        logger.info("fastflow: generate() uses transformers' loop: %s", reason)


def _unsupported(model, gc, model_kwargs, extra) -> str | None:
    """Why this request needs transformers' own loop, or None."""
    from transformers.generation.configuration_utils import GenerationMode

    mode = gc.get_generation_mode(extra.get("assistant_model"))
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"generation mode {mode.value}"
    for name in ("assistant_model", "synced_gpus", "custom_generate", "negative_prompt_ids"):
        if extra.get(name):
            return f"{name} given"
    if gc.return_dict_in_generate or gc.output_scores or gc.output_logits:
        return "return_dict_in_generate / output_scores / output_logits"
    if (gc.num_return_sequences or 1) > 1:
        return "num_return_sequences > 1"
    if gc.guidance_scale not in (None, 1.0):
        return "classifier-free guidance"
    if gc.use_cache is False:
        return "use_cache=False"
    others = sorted(set(model_kwargs) - set(_MODEL_INPUTS))
    if others:
        return f"model inputs {others}"
    if model.config.is_encoder_decoder:
        return "encoder-decoder model"
    from . import hf_attention as hf

    if model.config._attn_implementation != hf.NAME and hf.has_sliding_layers(model.config):
        return "sliding-window layers without fastflow attention (their rolling cache recompiles per step)"
    return None


def decode_step(model, input_ids, attention_mask, position_ids, cache, keep: dict, cpu_argmax: bool,
                cache_kw: str = "cache"):
    """One decode step: the newest position's logits and their argmax, both inside the compiled graph
    (on CPU fastflow_cpu::argmax, kernels/cpu_argmax.py).
    `cache_kw`: the name the model's forward takes the cache by (generation.cache_kwarg)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=True, **{cache_kw: cache}, **keep).logits[:, -1]
    return logits, cpu_argmax_op.greedy_token(logits, cpu_argmax)


def prompt_step(model, input_ids, position_ids, cache, keep: dict, cpu_argmax: bool, cache_kw: str = "cache"):
    """The prompt's forward without padding (no mask: hf_attention.prompt_into_empty_cache), compiled
    apart from `decode_step`: its own code object keeps its own Dynamo cache entries and recompile limit."""
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=True, **{cache_kw: cache},
                   **keep).logits[:, -1]
    return logits, cpu_argmax_op.greedy_token(logits, cpu_argmax)


class DecodeLoop:
    """One per optimized model: its static caches (one per batch size) and the compiled step."""

    def __init__(self, model, generate, max_seq_len: int, kv_dtype: torch.dtype | None = None,
                 compile_prefill: bool = False):
        self.model, self.hf_generate, self.max_seq_len, self.kv_dtype = model, generate, max_seq_len, kv_dtype
        self.compile_prefill = compile_prefill
        self._caches: dict = {}
        self._steps: dict = {}  # compile config -> compiled decode_step
        self._prompt_steps: dict = {}  # compile config -> compiled prompt_step
        self._called: set = set()  # the compiled steps called at least once (compiled by then)
        self._may_skip_guards = sum(1 for _ in model.buffers()) <= replay.MAX_BUFFERS_TO_SKIP_GUARDS
        self._keep = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}
        self._cache_kw = cache_kwarg(model)

    def __call__(self, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None,
                 prefix_allowed_tokens_fn=None, streamer=None, **kwargs):
        extra = {k: kwargs.pop(k) for k in ("assistant_model", "synced_gpus", "custom_generate", "negative_prompt_ids",
                                             "negative_prompt_attention_mask") if k in kwargs}
        ids = kwargs.pop("input_ids", inputs)
        if ids is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or "inputs_embeds" in kwargs:
            reason = "no 2-D input_ids (inputs_embeds or another modality)"
        else:
            # as generate() decides it, before the config absorbs the defaults
            defaults = {name: kwargs.get(name) is None and getattr(generation_config, name, None) is None
                        and getattr(self.model.generation_config, name) is None
                        for name in ("max_length", "min_length")}
            gc, model_kwargs = self.model._prepare_generation_config(generation_config, **kwargs)
            reason = _unsupported(self.model, gc, model_kwargs, extra)
        if reason is not None:
            _report_fallback(reason)
            return self.hf_generate(inputs, generation_config=generation_config, logits_processor=logits_processor,
                                    stopping_criteria=stopping_criteria,
                                    prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, streamer=streamer,
                                    **({"input_ids": ids} if inputs is None and ids is not None else {}),
                                    **extra, **kwargs)
        with torch.inference_mode():
            return self._generate(ids, gc, model_kwargs.get("attention_mask"), defaults, kwargs, logits_processor,
                                  stopping_criteria, prefix_allowed_tokens_fn, streamer)

    def _prepare(self, ids, gc, attention_mask, defaults, kwargs, logits_processor, stopping_criteria, prefix_fn):
        """Lengths, special tokens, logits processors and stopping criteria, as generate() makes them."""
        from transformers.generation import LogitsProcessorList, StoppingCriteriaList

        model = self.model
        model._prepare_special_tokens(gc, attention_mask is not None, device=ids.device, batch_size=ids.shape[0])
        model._prepare_generated_length(gc, defaults["max_length"], defaults["min_length"], "input_ids",
                                        ids.shape[1], ids)
        logits_processor = logits_processor if logits_processor is not None else LogitsProcessorList()
        stopping_criteria = stopping_criteria if stopping_criteria is not None else StoppingCriteriaList()
        processors = model._get_logits_processor(
            generation_config=gc, input_ids_seq_length=ids.shape[1], encoder_input_ids=ids,
            prefix_allowed_tokens_fn=prefix_fn, logits_processor=logits_processor, device=ids.device,
            model_kwargs={"attention_mask": attention_mask} if attention_mask is not None else {})
        criteria = model._get_stopping_criteria(generation_config=gc, stopping_criteria=stopping_criteria,
                                                tokenizer=kwargs.get("tokenizer"))
        return processors, criteria

    def _cache(self, batch: int, device):
        """The static cache for this batch size and the model's dtype and device, emptied (its tensors
        are allocated once): a model moved or cast between calls gets a cache of its own."""
        from transformers import StaticCache

        from . import hf_attention as hf
        from .kv_cache import quantize_layers

        key = (batch, self.model.dtype, str(device))
        cache = self._caches.get(key)
        if cache is None:
            cache = StaticCache(config=self.model.config, max_cache_len=self.max_seq_len)
            if self.model.config._attn_implementation == hf.NAME:
                from .window_cache import use_rolling_windows  # window slots per sliding layer

                use_rolling_windows(cache, self.max_seq_len)
            self._caches[key] = cache = quantize_layers(cache, self.kv_dtype)
            if self.compile_prefill:
                self._allocate(cache, batch, device)
        else:
            cache.reset()
        return cache

    def _allocate(self, cache, batch: int, device) -> None:
        """Let every layer allocate its tensors now, in an eager one-token forward, then empty the
        cache: a layer allocates at its first write, which inside a compiled prompt would make the
        allocation part of the graph (and the next prompt, over allocated layers, a recompile)."""
        ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.model(input_ids=ids, position_ids=ids, use_cache=True, **{self._cache_kw: cache}, **self._keep)
        cache.reset()

    def cache_bytes(self) -> int:
        """Bytes of the K/V tensors of every cache allocated so far (quantized rows as stored)."""
        layers = [layer for cache in self._caches.values() for layer in cache.layers if layer.is_initialized]
        return sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))

    def _generate(self, ids, gc, attention_mask, defaults, kwargs, logits_processor, stopping_criteria, prefix_fn,
                  streamer):
        model = self.model
        processors, criteria = self._prepare(ids, gc, attention_mask, defaults, kwargs, logits_processor,
                                             stopping_criteria, prefix_fn)
        batch, prompt = ids.shape
        total = min(gc.max_length, self.max_seq_len)
        sequences = ids.new_zeros((batch, total))
        sequences[:, :prompt] = ids
        if attention_mask is not None:
            positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        else:
            positions = torch.arange(prompt, device=ids.device).expand(batch, prompt)
        cache = self._cache(batch, ids.device)
        if streamer is not None:
            streamer.put(ids.cpu())
        cpu_argmax = cpu_argmax_op.applies(ids)
        logits, best = self._prompt(gc, ids, attention_mask, positions, cache, cpu_argmax)
        inputs = dict(input_ids=ids.new_zeros((batch, 1)), attention_mask=self._decode_mask(ids, attention_mask),
                      position_ids=ids.new_empty((batch, 1)).copy_(positions[:, -1:]),  # fixed strides
                      cache=cache, keep=self._keep, cpu_argmax=cpu_argmax, cache_kw=self._cache_kw)
        step = self._compiled_step(gc)
        steps = replay.DecodeSteps(model, step, inputs, self._may_skip_guards)
        compiling = step is not decode_step and step not in self._called
        unfinished = torch.ones(batch, dtype=torch.bool, device=ids.device)
        eos, pad = gc._eos_token_tensor, gc._pad_token_tensor
        # max length and eos are checked here; other stopping criteria (stop strings, max_time, the
        # caller's) run as transformers runs them
        own_stop = all(type(c).__name__ in ("MaxLengthCriteria", "EosTokenCriteria") for c in criteria)
        length = prompt
        while True:
            if gc.do_sample or processors:
                scores = logits.to(torch.float32)
                if processors:
                    scores = processors(sequences[:, :length], scores)
                nxt = (torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1) if gc.do_sample
                       else scores.argmax(-1))
            else:
                nxt, scores = best, logits  # the step's own argmax (decode_step)
            if eos is not None:
                nxt = torch.where(unfinished, nxt, pad)
            sequences[:, length] = nxt
            length += 1
            if streamer is not None:
                streamer.put(nxt.cpu())
            if not own_stop:
                unfinished &= ~criteria(sequences[:, :length], scores)
            elif eos is not None:
                unfinished &= ~torch.isin(nxt, eos)
            if length >= total or (eos is not None or not own_stop) and not bool(unfinished.any()):
                break
            inputs["input_ids"].copy_(nxt[:, None])
            inputs["position_ids"] += 1
            if inputs["attention_mask"].dim() == 4:
                inputs["attention_mask"][..., length - 1] = True  # the slot the fed token is written to
            if compiling:
                logits, best = self._first_call(steps, step)
                compiling = False
            else:
                logits, best = steps(length - prompt)
        if streamer is not None:
            streamer.end()
        return sequences[:, :length]

    def _prompt(self, gc, ids, attention_mask, positions, cache, cpu_argmax: bool):
        """The prompt's forward into the emptied `cache`: (last position's logits, their argmax)."""
        from . import hf_attention as hf

        padded = attention_mask is not None and not bool(attention_mask.all())
        # (a prompt filling the whole cache would skip hf_attention's slicing of the keys: eager too)
        step = self._compiled_prompt(gc) if 2 <= ids.shape[1] < self.max_seq_len and not padded else None
        if step is None:
            logits = self.model(input_ids=ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                                **{self._cache_kw: cache}, **self._keep).logits[:, -1]
            return logits, cpu_argmax_op.greedy_token(logits, cpu_argmax)
        # fresh tensor objects (the caller's are not marked), the length a dynamic dimension: one graph
        # for every prompt length; where the graph branches on it (a sliding window's min(window, L)),
        # Dynamo guards the branch and compiles one graph per side
        ids, positions = ids.detach(), positions.contiguous()
        for t in (ids, positions):
            torch._dynamo.maybe_mark_dynamic(t, 1)
        first = step not in self._called
        with hf.prompt_into_empty_cache(), self._compiling(first, "prompt", step):
            return step(self.model, ids, positions, cache, self._keep, cpu_argmax, self._cache_kw)

    def _compiled_prompt(self, gc):
        """`prompt_step` compiled as the decode step is (its compile_config), or None: eager prompts."""
        if not self.compile_prefill or gc.disable_compile or gc.compile_config is None:
            return None
        key = repr(gc.compile_config.to_dict())
        if key not in self._prompt_steps:
            self._prompt_steps[key] = torch.compile(prompt_step, **gc.compile_config.to_dict())
        return self._prompt_steps[key]

    def _compiled_step(self, gc):
        """`decode_step` compiled as generate() would compile the model (its compile_config), or eager."""
        if gc.disable_compile or gc.compile_config is None:
            return decode_step
        key = repr(gc.compile_config.to_dict())
        if key not in self._steps:
            self._steps[key] = torch.compile(decode_step, **gc.compile_config.to_dict())
        return self._steps[key]

    def _first_call(self, steps, step):
        """Decode step 1 through a step never called before (see `_compiling`)."""
        with self._compiling(True, "decode", step):
            return steps(1)

    @contextlib.contextmanager
    def _compiling(self, first: bool, what: str, step):
        """Around the first call of a compiled step: Dynamo and Inductor compile it now, tens of seconds
        on a CPU with nothing to count, so a status line on a terminal and the seconds logged."""
        if not first:
            yield
            return
        from torch._dynamo import convert_frame

        before = sum(convert_frame.FRAME_COMPILE_COUNTER.values())
        start = time.perf_counter()
        with progress.status(f"fastflow: compiling the {what} step (Dynamo + Inductor)"):
            yield
        self._called.add(step)
        if sum(convert_frame.FRAME_COMPILE_COUNTER.values()) > before:  # (not when Dynamo had it cached)
            logger.info("fastflow: first generate compiled %s in %.1f s", what, time.perf_counter() - start)

    def _decode_mask(self, ids, attention_mask):
        """The mask handed to every decode step, updated in place. With fastflow attention: the
        boolean (B, 1, 1, max_seq_len) mask transformers would build each step -- written slots that
        are not padding -- as a graph input, so the compiled step builds no mask (the op applies
        causality and sliding windows itself). Other attention implementations get the 2-D padding
        mask over the whole cache and build their masks inside the graph."""
        batch, prompt = ids.shape
        padding = ids.new_ones((batch, self.max_seq_len))
        if attention_mask is not None:
            padding[:, :prompt] = attention_mask
        if self.model.config._attn_implementation != "fastflow":
            return padding
        mask = padding.bool()[:, None, None, :].clone()
        mask[..., prompt:] = False
        return mask
