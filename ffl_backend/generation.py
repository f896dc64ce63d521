"""Make plain `model.generate()` run compiled over a static KV cache.

transformers compiles only the decode step, and only when the cache is static (compileable); on CPU
it also needs `_compile_all_devices`. `compile_config` is not saved by `save_pretrained`, so this is
a per-instance setting to apply after every load.
"""
from __future__ import annotations

import logging
import weakref

logger = logging.getLogger("ffl_backend")

# Dynamo checks hundreds of tensor guards per decode step of a 30-layer model. With recursive dict
# tags it skips any nn.Module subtree whose __dict__s are unchanged since the last call. torch caps
# the objects it tracks at 256 by default, fewer than a 30-layer model has, which silently disables
# that fast path; this raises the cap.
FAST_GUARD_CONFIG = {"use_recursive_dict_tags_for_guards": True,
                     "max_saved_pointers_for_recursive_dict_tags_check": 8192}


# Dynamo's own values of FAST_GUARD_CONFIG, saved when the first model turns the settings on and put
# back when the last one still alive is restored; the models configured meanwhile.
_saved_dynamo_config: dict = {}
_fast_guard_models: weakref.WeakSet = weakref.WeakSet()


def enable_fast_guards(model) -> None:
    """Let Dynamo skip guards of unchanged nn.Module subtrees: a process-wide Dynamo setting, held
    for `model` until `release_fast_guards(model)`.

    Caveat, the same as for fastflow's compile-time weight copies: a compiled model whose tensors
    are swapped in ways that leave module dicts untouched (`param.data = other`) must be recompiled
    (`torch._dynamo.reset()`); module attribute changes are still caught."""
    import torch._dynamo

    if not _fast_guard_models:
        _saved_dynamo_config.update({key: getattr(torch._dynamo.config, key) for key in FAST_GUARD_CONFIG})
    _fast_guard_models.add(model)
    for key, value in FAST_GUARD_CONFIG.items():
        setattr(torch._dynamo.config, key, value)


def release_fast_guards(model) -> None:
    """`model` no longer needs the fast guard settings; the last model to let go restores Dynamo's."""
    import torch._dynamo

    _fast_guard_models.discard(model)
    if not _fast_guard_models and _saved_dynamo_config:
        for key, value in _saved_dynamo_config.items():
            setattr(torch._dynamo.config, key, value)
        _saved_dynamo_config.clear()


def compile_config(backend="fastflow", options=None, fullgraph=False, dynamic=False, mode=None):
    """A transformers CompileConfig for `backend` and torch.compile `mode`, usable on CPU as well as CUDA."""
    from transformers import CompileConfig

    options = dict(options or {})
    if backend == "fastflow" and options and mode is not None:
        options["mode"], mode = mode, None  # torch.compile refuses mode= together with options=
    kwargs = dict(backend=backend, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
    if options:
        kwargs["options"] = options
    cc = CompileConfig(**kwargs)
    cc._compile_all_devices = True  # transformers otherwise compiles only on CUDA
    return cc


def configure_generate(model, backend="fastflow", options=None, max_cache_len=None, mode=None):
    """Set `model.generation_config` so `generate()` uses a static cache compiled with `backend` in
    torch.compile `mode` (None: the default mode), and enable Dynamo's fast guard path
    (`enable_fast_guards`, until `release_fast_guards(model)`) for whichever backend.

    `backend=None` keeps the static cache and turns compilation off (eager decode)."""
    gc = model.generation_config
    gc.cache_implementation = "static"
    if max_cache_len is not None:
        # The cache is sized max(this, prompt + max_new_tokens - 1) at every call: a fixed ceiling keeps
        # its shape, and so the compiled decode graph, the same across prompt lengths. (A static cache
        # ignores `cache_config`; `max_cache_len` is the 5.x field generate reads.)
        gc.max_cache_len = int(max_cache_len)
    if backend is None:
        gc.disable_compile = True
        return model
    gc.disable_compile = False
    gc.compile_config = compile_config(backend, options, mode=mode)
    enable_fast_guards(model)
    logger.info("generate() will decode over a static cache compiled with backend=%r", backend)
    return model


def cache_kwarg(model) -> str:
    """The keyword under which `model`'s forward takes its KV cache: `cache` in transformers 5.24,
    `past_key_values` in earlier 5.x (5.17, the GPU machine's), where a `cache=` would be swallowed
    by **kwargs and the model would decode over a fresh dynamic cache. 5.24 still accepts the old name
    but through a deprecation wrapper and a warning on every call, so each model gets its own."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
