"""`optimize(model)`: make plain `model.generate()` / `pipeline(...)` fast, in place, per instance.

What it sets on *this* model (nothing global, nothing in transformers.models.* rebound):
1. quantization through `ffl_backend.quantize` when `quant` is given (not undone by `restore`);
2. the "fastflow" attention implementation (ffl_backend/hf_attention.py) and its mask function;
3. generation over a static KV cache of fixed shape (batch x max_seq_len), with decode compiled by
   the fastflow backend (`generation.configure_generate`). The cache length never depends on the
   prompt, and the attention ops take the filled length as a tensor, so one decode graph serves
   every step and every prompt length: no recompiles. Sliding-window layers keep only their window
   (window_cache.py);
4. a per-instance `generate` that rejects prompt + max_new_tokens > max_seq_len (or a batch above
   max_batch_size) with a clear error before any work, and runs greedy and sampling requests through
   fastflow's decode loop (decode_loop.py: no per-token host work beyond the compiled step).
5. on CPUs without bf16 matrix instructions, the bf16 / fp16 linears' prompts through fastflow's GEMM
   (prompt_linears.py).
`restore(model)` undoes 2-5.

Compile paths: after `optimize`, `model.generate` compiles decode steps itself. `model.compile(
backend="fastflow")` compiles the model in place (prefill included) and composes with `optimize`.
`torch.compile(model, backend="fastflow")` returns a wrapper whose `forward` is compiled but whose
`.generate` runs the wrapped model's own (uncompiled) forward: only `optimize` accelerates that path.
"""
from __future__ import annotations

import functools
import logging

import torch

from . import progress

logger = logging.getLogger("ffl_backend")

DEFAULT_MAX_SEQ_LEN = 2048
# The torch.compile mode decode steps compile with: on CPU "reduce-overhead" is the C++ wrapper
# (config.CPU_REDUCE_OVERHEAD_CONFIG), on CUDA CUDA graphs over the static cache (docs/modes.md).
DEFAULT_MODE = "reduce-overhead"
_STATE = "_fastflow_state"


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _layer_lengths(config, seq_len: int, cap_sliding: bool) -> list[int]:
    """Cache length of every layer: sliding-window layers hold at most `sliding_window` tokens."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or (["sliding_attention" if window else "full_attention"] * layers)
    return [min(seq_len, window) if cap_sliding and window and t == "sliding_attention" else seq_len
            for t in types[:layers]]


def kv_cache_bytes(config, batch_size: int, seq_len: int, dtype=torch.float32, cap_sliding: bool = True) -> int:
    """Bytes of K and V for every layer: 2 * batch * kv_heads * row * length, summed over layers,
    row = head_dim * itemsize (or, for a quantized cache, dtype "int8"/"fp8", head_dim rounded up to 4
    bytes + a 4-byte scale: attention/kv_quant.py), length = seq_len (or the window for sliding layers
    when `cap_sliding`). GQA-aware (num_key_value_heads); honours an explicit `head_dim` (Gemma, Qwen3)."""
    from .attention.kv_quant import row_bytes

    cfg = _text_config(config)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_token = 2 * batch_size * kv_heads * row_bytes(head_dim, dtype)
    return sum(per_token * n for n in _layer_lengths(cfg, seq_len, cap_sliding))


def default_max_seq_len(config) -> int:
    """optimize()'s static cache length when none is given: the model's positions, at most 2048."""
    positions = getattr(_text_config(config), "max_position_embeddings", None) or DEFAULT_MAX_SEQ_LEN
    return min(positions, DEFAULT_MAX_SEQ_LEN)


def _requested(model, args, kwargs) -> tuple[int, int]:
    """(rows in the cache, total tokens) a generate call asks for, resolved as generate resolves them."""
    ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if ids is None:
        ids = kwargs["inputs_embeds"][..., 0]
    gc = kwargs.get("generation_config") or model.generation_config
    new = kwargs.get("max_new_tokens", gc.max_new_tokens)
    total = ids.shape[-1] + new if new is not None else kwargs.get("max_length", gc.max_length)
    copies = max(kwargs.get("num_beams", gc.num_beams) or 1,
                 kwargs.get("num_return_sequences", gc.num_return_sequences) or 1)
    return ids.shape[0] * copies, total


def _checked_generate(model, generate, max_batch_size: int, max_seq_len: int):
    @functools.wraps(generate)
    def checked(*args, **kwargs):
        rows, total = _requested(model, args, kwargs)
        if total > max_seq_len:
            raise ValueError(f"prompt + max_new_tokens = {total} tokens exceeds max_seq_len={max_seq_len} "
                             "of this optimized model; shorten the request or call "
                             "ffl_backend.optimize(model, max_seq_len=...) with a larger limit")
        if rows > max_batch_size:
            raise ValueError(f"batch of {rows} sequences (x beams / return sequences) exceeds "
                             f"max_batch_size={max_batch_size}; call optimize(..., max_batch_size={rows})")
        return generate(*args, **kwargs)

    return checked


def optimize(model, *, quant=None, calibration_data=None, max_batch_size: int = 1, max_seq_len: int | None = None,
             attention: str | None = "fastflow", mode: str | None = DEFAULT_MODE, decode_loop: bool = True,
             kv_cache_dtype=None, compile_prefill: bool = False, **backend_options):
    """Patch `model` in place for fast generation and return it (see the module docstring).

    quant: what `ffl_backend.quantize` takes ("int8", a config, ...), or None.
    calibration_data: what `ffl_backend.quantize` takes with it: an iterable of input_ids tensors
        ((1, L) or (B, L)) from text like the model's real inputs. Needed by the presets that calibrate
        ("w8a8-smooth", "w8a8-static", algorithm="gptq"); int4 uses it to weigh its rounding error.
    max_batch_size, max_seq_len: the static cache's shape; max_seq_len defaults to
        min(config.max_position_embeddings, 2048). Requests beyond either raise before any work.
    attention: "fastflow" (default), another transformers implementation name, or None to keep.
    mode: the torch.compile mode decode steps compile with (docs/modes.md): "reduce-overhead" (default;
        CUDA graphs on CUDA, the C++ wrapper on CPU), "default" for the shorter compile, or any other.
    decode_loop: True (default): greedy and sampling requests run fastflow's decode loop
        (ffl_backend/decode_loop.py), the rest transformers' loop; False: transformers' loop always.
    kv_cache_dtype: None (default: the model's dtype), "int8" or "fp8" (e4m3): the static cache stores
        K and V quantized with one fp32 scale per token and KV head (attention/kv_quant.py), about half
        a bf16 cache; the attention ops dequantize as they read. Needs attention="fastflow".
    compile_prefill: True: the decode loop's prompts (no padding, 2+ tokens) run compiled too, one graph
        with a dynamic length for every prompt; False (default): eager prompts (docs/performance.md#compiled-prompts).
    backend_options: options of the fastflow backend (ffl_backend.config.BackendOptions).

    Progress: bars on stderr while quantizing and tuning when it is a terminal (FFL_PROGRESS=0 never,
    =1 always), then one INFO line of seconds per phase (quantize, setup, kernels, autotune;
    ffl_backend/progress.py). Decode compiles later, at the first generate(), which logs its time.
    """
    from . import hf_attention as hf
    from . import prompt_linears
    from .attention.kv_quant import storage_dtype
    from .config import BackendOptions
    from .decode_loop import DecodeLoop
    from .generation import configure_generate
    from .quant.quantizer import quantize
    from .quant.tensor_parallel import localize
    from .quant.weight_layout import share_fused_storage

    BackendOptions.parse(mode, backend_options)  # a typo fails here, not at the first decode step
    kv_dtype = storage_dtype(kv_cache_dtype)
    if kv_dtype is not None and attention != hf.NAME:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs attention={hf.NAME!r} (the ops that read "
                         f"the quantized rows); got attention={attention!r}")
    localize(model)  # a transformers tensor-parallel model: plain local shards, local head counts
    cfg = _text_config(model.config)
    if max_seq_len is None:
        max_seq_len = default_max_seq_len(model.config)
    if max_batch_size < 1 or max_seq_len < 2:
        raise ValueError("max_batch_size must be >= 1 and max_seq_len >= 2")
    if calibration_data is not None and quant is None:
        raise ValueError("calibration_data is for quantization: pass quant=... with it (e.g. quant=\"w8a8-smooth\")")
    if getattr(model, _STATE, None) is not None:
        restore(model)
    with progress.timed("optimize") as phase:  # one line of seconds per phase (progress.py)
        if quant is not None:
            with phase("quantize"):
                model = quantize(model, quant, calibration_data=calibration_data)
        with phase("setup"):
            gc = model.generation_config
            state = {"generation": {k: getattr(gc, k, None) for k in
                                    ("cache_implementation", "max_cache_len", "compile_config", "disable_compile")}}
            state["attention"] = hf.install(model, attention, kv_dtype)
            state["prompt_linears"] = prompt_linears.install(model)  # CPUs without bf16 matmul: fastflow's GEMM
            # q/k/v and gate/up as slices of one tensor: horizontal fusion then reuses it instead of copying
            share_fused_storage(model)
            configure_generate(model, backend="fastflow", options=backend_options, max_cache_len=max_seq_len,
                               mode=mode)
        if next(model.parameters()).device.type == "cpu":
            from .kernels import cpu_gemv  # built and tuned now: nothing is timed while compiling

            with phase("kernels"):
                cpu_gemv.ready()
            with phase("autotune"):
                prompt_linears.pretune(model)  # the rows from which prompts take fastflow's GEMM, per shape
        else:
            from .quant.modules import pretune_linears  # the Triton tiles of decode's shape, likewise

            with phase("autotune"):
                pretune_linears(model, max_batch_size)
        generate = (DecodeLoop(model, model.generate, max_seq_len, kv_dtype, compile_prefill) if decode_loop
                    else model.generate)
        model.generate = _checked_generate(model, generate, max_batch_size, max_seq_len)
        setattr(model, _STATE, state)
    # the decode loop's caches hold only the window for sliding layers (window_cache.py)
    rolling = decode_loop and model.config._attn_implementation == hf.NAME
    cache_dtype = kv_dtype or model.dtype
    nbytes = kv_cache_bytes(cfg, max_batch_size, max_seq_len, cache_dtype, cap_sliding=rolling)
    logger.info("fastflow: static KV cache %d x %d tokens = %.1f MiB (%s); attention=%s",
                max_batch_size, max_seq_len, nbytes / 2**20, str(cache_dtype).replace("torch.", ""),
                model.config._attn_implementation)
    return model


def restore(model):
    """Undo `optimize` (attention implementation, generation settings, generate check, and Dynamo's
    process-wide guard settings once no optimized model is left); quantized weights stay quantized."""
    state = getattr(model, _STATE, None)
    if state is None:
        return model
    from . import hf_attention as hf
    from . import prompt_linears
    from .generation import release_fast_guards

    model.__dict__.pop("generate", None)
    hf.uninstall(model, state["attention"])
    prompt_linears.uninstall(model, state.get("prompt_linears", []))
    for key, value in state["generation"].items():
        setattr(model.generation_config, key, value)
    for attr in ("_compiled_call", "_last_compile_config"):
        model.__dict__.pop(attr, None)
    release_fast_guards(model)
    setattr(model, _STATE, None)
    return model
