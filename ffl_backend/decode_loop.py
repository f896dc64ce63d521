"""The decode loop behind `model.generate()` after `ffl_backend.optimize()`: greedy and sampling.

transformers' loop spends per token what a compiled decode step does not need: building the 4-D
attention mask eagerly, re-slicing and concatenating inputs, masks and position ids, a fresh output
object, Dynamo's full guard check. This loop keeps fixed-shape input buffers (token, position ids,
a full-length 2-D mask; the mask is made inside the compiled step) and updates them in place, so
every decode step is one call of the same compiled graph; the logits processors and stopping
criteria transformers would build for the same request are applied between steps, so results follow
`generate()`'s semantics (tokens, eos/padding, sampling draws from the same RNG calls).

Guards: Dynamo checks its full guards on the first two decode steps of every generate() call (so a
changed model, dtype, batch size or device recompiles or raises as usual). If neither step compiled,
the rest of that call runs with `skip_guard_eval_unsafe` (only the guards that tell cache entries
apart): between steps the loop changes tensor values only, never shapes, dtypes or modules.

Everything else -- beam search, assisted or contrastive decoding, returning scores or a dict, several
sequences per prompt, inputs_embeds, a cache passed in -- goes to transformers' own loop, with the
reason logged once per reason.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("ffl_backend")

# generate() arguments (besides the token ids) the loop takes; any other model input falls back.
_MODEL_INPUTS = ("attention_mask", "use_cache", "logits_to_keep")
_GUARDED_STEPS = 2  # decode steps per generate() call run with Dynamo's full guards
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
    from .attention import hf

    if model.config._attn_implementation != hf.NAME and hf.has_sliding_layers(model.config):
        return "sliding-window layers without fastflow attention (their rolling cache recompiles per step)"
    return None


class DecodeLoop:
    """One per optimized model: its static caches (one per batch size) and the compiled step."""

    def __init__(self, model, generate, max_seq_len: int):
        self.model, self.hf_generate, self.max_seq_len = model, generate, max_seq_len
        self._caches: dict = {}
        self._skip_guards = False  # set after guarded steps that compiled nothing (see _step)
        self._keep = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}

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
                        and getattr(self.model.generation_config, name) is None for name in ("max_length", "min_length")}
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
        """The static cache for this batch size, emptied (its tensors are allocated once)."""
        from transformers import StaticCache

        from .attention import hf

        cache = self._caches.get(batch)
        if cache is None:
            cache = StaticCache(config=self.model.config, max_cache_len=self.max_seq_len)
            if self.model.config._attn_implementation == hf.NAME:
                hf.unroll_sliding_layers(cache, self.max_seq_len)  # the op applies the window
            self._caches[batch] = cache
        else:
            cache.reset()
        return cache

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
        mask = self._decode_mask(ids, attention_mask)
        cache = self._cache(batch, ids.device)
        if streamer is not None:
            streamer.put(ids.cpu())
        logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=positions, cache=cache,
                       use_cache=True, **self._keep).logits
        step = model.get_compiled_call(gc.compile_config) if not gc.disable_compile else model.__call__
        token = ids.new_zeros((batch, 1))
        position = ids.new_empty((batch, 1)).copy_(positions[:, -1:])  # fixed strides: no guard on the prompt
        unfinished = torch.ones(batch, dtype=torch.bool, device=ids.device)
        pad = gc._pad_token_tensor
        length = prompt
        while True:
            scores = processors(sequences[:, :length], logits[:, -1].to(torch.float32))
            if gc.do_sample:
                nxt = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                nxt = scores.argmax(-1)
            if pad is not None:
                nxt = torch.where(unfinished, nxt, pad)
            sequences[:, length] = nxt
            length += 1
            if streamer is not None:
                streamer.put(nxt.cpu())
            unfinished &= ~criteria(sequences[:, :length], scores)
            if length >= total or not bool(unfinished.any()):
                break
            token.copy_(nxt[:, None])
            position += 1
            if mask.dim() == 4:
                mask[..., length - 1] = True  # the slot the fed token is written to
            logits = self._step(step, length - prompt, token, mask, position, cache)
        if streamer is not None:
            streamer.end()
        return sequences[:, :length]

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

    def _step(self, step, index: int, token, mask, position, cache):
        """One compiled decode step; after the guarded ones, Dynamo checks only what tells entries apart."""
        from torch._dynamo import convert_frame

        kwargs = dict(input_ids=token, attention_mask=mask, position_ids=position, cache=cache, use_cache=True,
                      **self._keep)
        if index <= _GUARDED_STEPS:
            before = sum(convert_frame.FRAME_COMPILE_COUNTER.values())
            logits = step(**kwargs).logits
            compiled = sum(convert_frame.FRAME_COMPILE_COUNTER.values()) != before
            self._skip_guards = (index == 1 or self._skip_guards) and not compiled
            return logits
        if self._skip_guards:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return step(**kwargs).logits
        return step(**kwargs).logits
