"""One configuration set up in this process and timed: what the worker (worker.py) and llama.cpp's
session (llamacpp.py) share. Times come from a streamer that stamps every generate() step: the
prompt, then each new token.
"""
from __future__ import annotations

import os
import resource
import statistics
import time

DEFAULT_TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                "must be in want of a wife. ")


class TimingStreamer:
    """A generate() streamer that timestamps every step: the prompt, then each new token."""

    def __init__(self):
        self.stamps = []

    def put(self, value):
        if getattr(value, "is_cuda", False):  # GPU steps are asynchronous: stamp when the token exists
            import torch

            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


def prompt_ids(tokenizer, length: int, text_path: str | None = None):
    """`length` tokens of real text (the file at `text_path` if given, else a fixed sentence)."""
    import torch

    text = DEFAULT_TEXT
    if text_path and os.path.exists(text_path):
        with open(text_path, encoding="utf-8") as fh:
            text = fh.read(200_000)
    ids = tokenizer(text * (1 + 4 * length // max(1, len(text.split()))), return_tensors="pt").input_ids
    return ids[:, :length].contiguous() if ids.shape[1] >= length else torch.cat([ids] * 2, 1)[:, :length]


def batch_prompts(tokenizer, cfg: dict):
    """(ids, attention_mask or None) of cfg's batch: the prompt repeated, or with `left_pad` (batch > 1)
    row i keeps only its last prompt_len - i * prompt_len // (2 * batch) tokens, left-padded with the
    pad token and masked, as a batch of prompts of different lengths arrives."""
    import torch

    ids = prompt_ids(tokenizer, cfg["prompt_len"], cfg.get("text")).repeat(cfg.get("batch", 1), 1)
    if not cfg.get("left_pad") or ids.shape[0] == 1:
        return ids, None
    mask = torch.ones_like(ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for i in range(ids.shape[0]):
        cut = i * ids.shape[1] // (2 * ids.shape[0])
        ids[i, :cut], mask[i, :cut] = pad, 0
    return ids, mask


def time_generate(model, ids, new_tokens: int, attention_mask=None) -> dict:
    """One greedy generate() of exactly `new_tokens` per row, timed step by step.

    Exactly: the end-of-sequence token does not stop it (`eos_token_id=None`, what vLLM calls
    ignore_eos). `min_new_tokens` would do the same through two logits processors that rebuild a
    vocabulary-sized mask every step (measured costlier per token than the rest of HF's loop:
    docs/performance.md#the-benchmark-harness): a cost of the harness, which a plain generate() does not have.

    decode_tok_s counts tokens of every row (batch x steps / s); tokens are row 0's new tokens and
    rows_equal says whether every row produced them (the rows share one prompt; None with an
    `attention_mask`: left-padded rows hold different prompts)."""
    import torch

    streamer = TimingStreamer()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=attention_mask, max_new_tokens=new_tokens, eos_token_id=None,
                             do_sample=False, streamer=streamer)
    end = time.perf_counter()
    s = streamer.stamps  # s[0]: prompt echoed; s[1]: first new token; s[-1]: last token
    decode_s = s[-1] - s[1]
    new = out[:, ids.shape[1]:]
    return {"generate_s": end - start, "ttft_s": s[1] - start,
            "decode_tok_s": ids.shape[0] * (len(s) - 2) / decode_s if decode_s > 0 else float("nan"),
            "tokens": new[0].tolist(),
            "rows_equal": bool((new == new[:1]).all()) if attention_mask is None else None}


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: parameters and persistent buffers (quantized weights,
    scales), each storage counted once. The input embedding is a row lookup, not a full read, so its
    tensors are left out unless the output head shares them (tied) and reads all of it. CPU
    re-layouts of the same weights (packed int4, oneDNN bf16) are the same size and are not
    counted twice."""
    def pointers(module):
        return {t.data_ptr() for t in module.state_dict().values()} if module is not None else set()

    lookup_only = pointers(model.get_input_embeddings()) - pointers(model.get_output_embeddings())
    seen, total = set(), 0
    for t in model.state_dict().values():
        ptr = t.data_ptr()
        if ptr in seen or ptr in lookup_only:
            continue
        seen.add(ptr)
        total += t.numel() * t.element_size()
    return total



def held_tensor_bytes(model) -> int:
    """Bytes of every distinct tensor `model` holds in host memory -- parameters, buffers, and tensors
    quantized modules keep as plain attributes (CPU forms) -- as the union of their byte ranges (views
    of one storage, tied weights: once). What memory measurements put against peak RSS."""
    import torch

    ranges = []
    for module in model.modules():
        for t in [*module._parameters.values(), *module._buffers.values(),
                  *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]:
            if t is not None and t.device.type == "cpu" and t.numel() > 1 and t.stride() != (0,) * t.dim():
                ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    total, end = 0, 0
    for a, b in sorted(ranges):
        if b > end:
            total, end = total + b - max(a, end), b
    return total

def _frames_recompiled() -> int:
    """Compiles beyond the first of each code object, whatever the backend (Dynamo's own count)."""
    from torch._dynamo import convert_frame

    return sum(max(0, n - 1) for n in convert_frame.FRAME_COMPILE_COUNTER.values())


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _status_mb(key: str) -> float | None:
    """A kB figure of /proc/self/status (Linux) in MB, or None where it cannot be read."""
    try:
        with open("/proc/self/status") as fh:
            return round(next(int(line.split()[1]) / 1024 for line in fh if line.startswith(key)), 1)
    except (OSError, StopIteration):
        return None


def current_rss_mb() -> float | None:
    """This process's resident set now, or None where it cannot be read."""
    return _status_mb("VmRSS:")


def peak_rss_mb() -> float:
    """This process's peak resident set: VmHWM, which belongs to this program alone. ru_maxrss is only
    the fallback: Linux starts it at the spawning parent's RSS (the high-water mark of the forked copy
    carries over exec), so a worker smaller than the ffl-bench process, as llama.cpp's are, would
    report the parent's size."""
    return _status_mb("VmHWM:") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def import_runtime(cfg: dict) -> float | None:
    """Import what this configuration runs on before any model exists -- torch, transformers and
    the model's modeling code, and Inductor for compiled backends -- and return the RSS that leaves
    (the runtime's share of the peak, which no choice of weights changes)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = transformers.AutoConfig.from_pretrained(cfg["model"])
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imports the modeling module
    if cfg["backend"] != "eager":
        import torch._inductor.compile_fx  # noqa: F401  (Dynamo's compile imports it on first use anyway)
    return current_rss_mb()


def load_model(cfg: dict):
    """(model, tokenizer, load seconds, quantize seconds) for a config with keys model, dtype and
    optionally device and quant (a quantize() scheme or preset). With `quantized_dir` (the alternating
    schedule's rounds: interleave.time_alternating) the model quantized by an earlier process of the same
    configuration is loaded from there, or, the first time, saved there once quantized."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = cfg.get("quantized_dir") if cfg.get("quant", "none") != "none" else None
    t0 = time.perf_counter()
    if saved and os.path.isfile(os.path.join(saved, "ffl_quant.json")):
        from ..quant.serialization import load_quantized

        model = load_quantized(saved, cfg.get("device", "cpu"))
        return model, AutoTokenizer.from_pretrained(cfg["model"]), time.perf_counter() - t0, 0.0
    if cfg.get("tp", 1) > 1:  # under torchrun: transformers shards it over the ranks as it loads
        model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=getattr(torch, cfg["dtype"]), tp_plan="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=getattr(torch, cfg["dtype"]))
        model = model.to(cfg.get("device", "cpu"))
    model = model.eval()
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    load_s = time.perf_counter() - t0
    quantize_s = 0.0
    if cfg.get("quant", "none") != "none":
        from ..quant import quantize

        t0 = time.perf_counter()
        quantize(model, cfg["quant"])
        quantize_s = time.perf_counter() - t0
        if saved:
            _save_quantized(model, saved)
    return model, tok, load_s, quantize_s


def _save_quantized(model, folder: str) -> None:
    """Save for the next rounds, complete or not at all (written beside, then renamed); a failure only
    costs them a quantize of their own, so it is reported, not raised."""
    import shutil
    import sys

    from ..quant.serialization import save_quantized

    partial = folder + ".partial"
    try:
        save_quantized(model, partial)
        os.replace(partial, folder)
    except Exception as exc:  # noqa: BLE001  (any failure: the measurement itself stands)
        shutil.rmtree(partial, ignore_errors=True)
        print(f"ffl-bench worker: quantized model not saved for later rounds ({type(exc).__name__}: {exc})",
              file=sys.stderr)


class Session:
    """One configuration, loaded, compiled and warmed up in this process, ready for timed generates."""

    def __init__(self, cfg: dict):
        """Load (and quantize), configure, compile on the first generate, warm up."""
        import torch

        from ..generation import configure_generate

        if cfg.get("threads") or cfg.get("tp", 1) > 1:  # tensor-parallel ranks share the threads
            torch.set_num_threads(max(1, (cfg.get("threads") or torch.get_num_threads()) // cfg.get("tp", 1)))
        self.cfg = cfg
        self.runtime_rss_mb = import_runtime(cfg)
        self.model, tok, load_s, quantize_s = load_model(cfg)
        ids, mask = batch_prompts(tok, cfg)
        self.ids = ids.to(cfg.get("device", "cpu"))
        self.mask = mask.to(cfg.get("device", "cpu")) if mask is not None else None
        if cfg["backend"] == "fastflow":
            _optimize(self.model, cfg)
        else:
            # Cache exactly as long as the request: its shape is part of the compiled decode graph.
            configure_generate(self.model, backend=None if cfg["backend"] == "eager" else cfg["backend"],
                               options=cfg.get("options"), max_cache_len=cfg["prompt_len"] + cfg["new_tokens"])
        self.warm_up(load_s=load_s, quantize_s=quantize_s)
        self.graphs_before = _graphs()

    def warm_up(self, **setup) -> None:
        """The first generate (it compiles), then the rest of the warm-up; `setup`: load times."""
        self.first = self.generate()
        self.setup = {**setup, "first_generate_s": self.first["generate_s"]}
        if self.cfg.get("mode") != "warm":
            for _ in range(self.cfg.get("warmup", 1) - 1):  # the first generate above is warm-up number one
                self.generate()
        self.runs = []

    def generate(self) -> dict:
        return time_generate(self.model, self.ids, self.cfg["new_tokens"], self.mask)

    def timed(self) -> dict:
        """One timed generate, kept for the summary."""
        run = self.generate()
        self.runs.append(run)
        return run

    def summary(self) -> dict:
        out = {**self.setup, **self.measure()}
        if self.cfg.get("tp", 1) > 1:
            out.update(all_reduce_share(self.model, out["decode_tok_s"] / self.cfg.get("batch", 1), self.cfg["batch"]))
        out["runtime_rss_mb"] = self.runtime_rss_mb
        out["kv_cache_mb"] = kv_cache_mb(self.model)
        # What loading, quantizing, compiling and running this model added to the process's peak.
        out["model_peak_rss_mb"] = (out["peak_rss_mb"] - self.runtime_rss_mb
                                    if self.runtime_rss_mb is not None else None)
        return out

    def measure(self) -> dict:
        """The figures of the timed generates, with Dynamo's counts and the CUDA peak."""
        import torch

        cuda = self.cfg.get("device", "cpu").startswith("cuda")
        return summarize_runs(self.cfg, self.first, self.runs, weight_bytes(self.model),
                              recompiles=_frames_recompiled(),
                              graphs_compiled_while_timed=_graphs() - self.graphs_before,
                              cuda_peak_mb=torch.cuda.max_memory_allocated() / 2**20 if cuda else None)


def all_reduce_share(model, steps_per_s: float, batch: int, calls: int = 200) -> dict:
    """Tensor-parallel rows: the mean time of one all-reduce of a decode step's hidden states (batch, 1,
    hidden), the all-reduces per step (one per row-parallel linear: after attention and after the MLP),
    and their share of a decode step. Every rank calls it (it is a collective)."""
    import torch
    import torch.distributed as dist

    from ..quant.tensor_parallel import all_reduce_count

    x = torch.ones(batch, 1, model.config.hidden_size, dtype=model.dtype, device=model.device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(x)
    seconds = (time.perf_counter() - t0) / calls
    per_step = all_reduce_count(model) or 2 * model.config.num_hidden_layers
    return {"tp": dist.get_world_size(), "allreduce_us": 1e6 * seconds, "allreduce_per_step": per_step,
            "allreduce_share_pct": 100 * per_step * seconds * steps_per_s}


def kv_cache_mb(model) -> float | None:
    """MiB of the static caches fastflow's decode loop allocated (None for other rows)."""
    loop = getattr(getattr(model, "generate", None), "__wrapped__", None)
    return loop.cache_bytes() / 2**20 if hasattr(loop, "cache_bytes") else None


def _optimize(model, cfg: dict) -> None:
    """The fastflow rows run what users are told to call: `ffl_backend.optimize` with its defaults
    (static cache of min(2048, the model's positions), its decode loop, mode "reduce-overhead"), the
    cache made longer only where the request needs it; options as given (e.g. {"mode": "default"})."""
    from ..api import default_max_seq_len, optimize

    needed = cfg["prompt_len"] + cfg["new_tokens"]
    optimize(model, max_batch_size=cfg.get("batch", 1), max_seq_len=max(needed, default_max_seq_len(model.config)),
             **(cfg.get("options") or {}))


def _rows_equal(runs: list[dict]):
    """Whether every row of every run produced row 0's tokens; None where rows held different prompts."""
    flags = [r.get("rows_equal") for r in runs]
    return None if None in flags else all(flags)


def summarize_runs(cfg: dict, first: dict, runs: list[dict], nbytes: int, **counters) -> dict:
    """What every backend reports of its first and timed generates, given the bytes of weights one
    decode step reads; `counters` are the backend's own (recompiles, graphs, CUDA peak)."""
    rates = [r["decode_tok_s"] for r in runs]
    ttft = statistics.median(r["ttft_s"] for r in runs)
    median_generate = statistics.median(r["generate_s"] for r in runs)
    res = {
        # First generate minus a steady one: what compiling (or eager warm-up) added.
        "compile_cold_s": max(0.0, first["generate_s"] - median_generate),
        "generate_s": median_generate,
        "ttft_s": ttft, "prefill_tok_s": cfg.get("batch", 1) * cfg["prompt_len"] / ttft,
        "decode_tok_s": statistics.median(rates), "decode_tok_s_all": rates,
        "decode_tok_s_min": min(rates), "decode_tok_s_max": max(rates),
        "decode_spread_pct": 100 * (max(rates) - min(rates)) / statistics.median(rates),
        **counters,
        "peak_rss_mb": peak_rss_mb(),
        "tokens": first["tokens"], "rows_equal": _rows_equal([first, *runs]),
        "deterministic": all(r["tokens"] == first["tokens"] for r in runs),
        "weight_bytes": nbytes,
    }
    # Every decode step reads the weights once, whatever the batch: GB/s follows steps, not tokens.
    res["effective_gbs"] = nbytes * res["decode_tok_s"] / cfg.get("batch", 1) / 1e9
    return res
