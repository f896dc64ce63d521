"""ffl-bench's llamacpp rows: llama.cpp, through llama-cpp-python, on a GGUF file written from the same
Hugging Face weights (gguf_export.py), timed in the same interleaved rounds as the torch rows.

Which file runs (GGUF_TYPES): unquantized bfloat16/float16 rows -> F16; int8 and int8-all -> Q8_0;
int4 and int4-all -> Q4_0 (Q8_0 embedding/output). float32 is skipped (llama.cpp would run F16, not a
float32 row), as are other schemes and batch > 1.

Set-up is split so that the worker process holds llama.cpp alone and its runtime RSS is llama_cpp's
import, not torch's: the parent (prepare) writes the GGUF file, tokenizes the prompt with the model's
HF tokenizer (session.prompt_ids, the ids the torch rows get), reads the file's per-token weight bytes
and fixes the thread count (--threads, else torch's default, as the torch rows get).

llama.cpp is driven through the bindings of its C API (model, context, llama_decode, as llama.cpp's
simple example does), not llama_cpp.Llama: Llama() cannot turn off ggml's extra buffer types, and on
CPUs with AMX (docs/performance.md#the-benchmark-harness) ggml's AMX matmul segfaults on Q8_0 and Q4_0 weights
(ggml-org/llama.cpp#20824; files written by llama.cpp's own quantizer crash the same way). There the
extra buffer types are off -- AMX and weight repacking together, ggml has no finer switch -- and the
JSON's environment says so (extra_buffer_types). Context settings are llama.cpp's defaults (F16 KV
cache, flash attention auto) with n_batch 512.
"""
from __future__ import annotations

import logging
import os
import time

from .session import Session, current_rss_mb, prompt_ids, summarize_runs

GGUF_TYPES = {"none": "F16", "int8": "Q8_0", "int8-all": "Q8_0", "int4": "Q4_0", "int4-all": "Q4_0"}
MISSING = ("llama-cpp-python is not installed (see README: pip install llama-cpp-python with "
           "CMAKE_ARGS=-DGGML_NATIVE=ON)")
N_BATCH = 512  # prompt tokens per llama_decode call


def gguf_type(cfg: dict) -> str | None:
    """The GGUF type a configuration's llama.cpp row runs, or None where there is none."""
    return GGUF_TYPES.get(cfg["quant"]) if cfg["dtype"] != "float32" else None


def import_error() -> str | None:
    """Why llama_cpp cannot be imported here, or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return MISSING
    except (OSError, RuntimeError) as exc:  # installed, but its shared library does not load
        return f"llama-cpp-python does not load: {exc}"
    return None


def skip_reason(cfg: dict) -> str | None:
    """Why a llamacpp configuration is not run, or None. A missing llama_cpp comes first, so every
    llamacpp row of a grid gives the same reason and the log says it once."""
    from .gguf_export import unsupported

    if (error := import_error()) is not None:
        return error
    if cfg["dtype"] == "float32":
        return "llama.cpp would run float32 as F16: not comparable with the float32 rows"
    if cfg["quant"] not in GGUF_TYPES:
        return f"no GGUF type for {cfg['quant']} (llamacpp runs {', '.join(GGUF_TYPES)})"
    if cfg.get("batch", 1) != 1:
        return "llamacpp rows time one sequence (batch 1)"
    if cfg.get("device", "cpu") != "cpu":
        return "llamacpp rows run on the CPU"
    return unsupported(cfg["model"])


def prepare(cfgs: list[dict], log=print) -> None:
    """Parent-side set-up of llamacpp configurations, in place (see the module docstring): keys gguf,
    gguf_type, prompt_ids, weight_bytes and threads."""
    import torch
    from transformers import AutoTokenizer

    from .gguf_export import cached_path, export, weight_bytes

    tokenizers = {}
    for cfg in cfgs:
        kind, model = gguf_type(cfg), cfg["model"]
        if not cached_path(model, kind).exists():
            log(f"  writing the {kind} GGUF file of {os.path.basename(model.rstrip('/'))} for llama.cpp "
                "(once; cached)")
        path = str(export(model, kind))
        if model not in tokenizers:
            tokenizers[model] = AutoTokenizer.from_pretrained(model)
        ids = prompt_ids(tokenizers[model], cfg["prompt_len"], cfg.get("text"))[0].tolist()
        cfg.update(gguf=path, gguf_type=kind, prompt_ids=ids, weight_bytes=weight_bytes(path),
                   threads=cfg.get("threads") or torch.get_num_threads())


def extra_buffer_types(system_info: str) -> bool:
    """Whether ggml's extra buffer types can be on: not where its AMX kernels would run (they crash)."""
    return "AMX_INT8 = 1" not in system_info


def environment() -> dict:
    """llama.cpp's versions and build, for the grid's environment block: system_info lists the instruction
    sets ggml was built for (an AVX2-only build says AVX512 = 0), path where that build was imported from
    (benchmarks/README.md: one build per folder, picked with PYTHONPATH)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode().strip()
    return {"llama_cpp_python": llama_cpp.__version__, "libllama": llama_cpp.llama_version().decode(),
            "system_info": info, "path": os.path.dirname(os.path.abspath(llama_cpp.__file__)),
            "extra_buffer_types": extra_buffer_types(info)}


def load(path: str, threads: int, n_ctx: int):
    """(model, context, vocabulary size) of the GGUF file at `path`, quiet as Llama(verbose=False)."""
    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = extra_buffer_types(llama_cpp.llama_print_system_info().decode())
    model = llama_cpp.llama_model_load_from_file(os.fsencode(path), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch = n_ctx, N_BATCH
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens for {path}")
    return model, ctx, llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))


def _next_token(ctx, ids: list[int], n_vocab: int) -> int:
    """Evaluate `ids` after what the KV cache holds, in batches of N_BATCH; the greedy next token."""
    import llama_cpp
    import numpy as np

    for i in range(0, len(ids), N_BATCH):
        chunk = ids[i:i + N_BATCH]
        tokens = (llama_cpp.llama_token * len(chunk))(*chunk)  # named: the batch only points at it
        # A batch of one sequence; llama.cpp places it after the cache and keeps the last logits only.
        rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, len(chunk)))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
    return int(logits.argmax())


def time_generate(ctx, ids: list[int], new_tokens: int, n_vocab: int) -> dict:
    """One greedy generate of exactly `new_tokens` (EOS does not stop it), timed as
    session.time_generate times generate(): the first new token stamps TTFT, the decode rate is over
    the tokens after it. The KV cache is cleared first, so every generate starts from nothing."""
    import llama_cpp

    start = time.perf_counter()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    tokens, stamps = [_next_token(ctx, ids, n_vocab)], [time.perf_counter()]
    while len(tokens) < new_tokens:
        tokens.append(_next_token(ctx, tokens[-1:], n_vocab))
        stamps.append(time.perf_counter())
    decode_s = stamps[-1] - stamps[0]
    return {"generate_s": stamps[-1] - start, "ttft_s": stamps[0] - start,
            "decode_tok_s": (len(stamps) - 1) / decode_s if decode_s > 0 else float("nan"),
            "tokens": tokens, "rows_equal": True}


class LlamaCppSession(Session):
    """session.Session's protocol (warm-up, timed generates, summary) over a llama.cpp context, for a
    configuration prepare() has filled in."""

    def __init__(self, cfg: dict):
        import llama_cpp  # noqa: F401  (the runtime alone: the RSS it leaves is the runtime's share)

        self.cfg = cfg
        self.runtime_rss_mb = current_rss_mb()
        t0 = time.perf_counter()
        self.model, self.ctx, self.n_vocab = load(cfg["gguf"], cfg["threads"], cfg["prompt_len"] + cfg["new_tokens"])
        self.warm_up(load_s=time.perf_counter() - t0, quantize_s=0.0)  # quantized when the file was written

    def generate(self) -> dict:
        return time_generate(self.ctx, self.cfg["prompt_ids"], self.cfg["new_tokens"], self.n_vocab)

    def measure(self) -> dict:
        """The figures of the timed generates; nothing compiles, so compile time and counts are 0."""
        return {**summarize_runs(self.cfg, self.first, self.runs, self.cfg["weight_bytes"], recompiles=0,
                                 graphs_compiled_while_timed=0, cuda_peak_mb=None), "compile_cold_s": 0.0}
