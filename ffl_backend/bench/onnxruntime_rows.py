"""ffl-bench's onnxruntime and onnxruntime-genai rows: the model exported by `ffl_backend.onnx.export_onnx`
(quantized by fastflow first for int8/int4 rows: MatMulNBits from fastflow's own codes), timed in the
same interleaved rounds as the other rows.

"onnxruntime" runs the folder through plain ONNX Runtime (onnx/runtime.py: one session.run per token,
the KV cache handed from each step's outputs to the next inputs); "onnxruntime-genai" through ONNX
Runtime GenAI's own generation loop on the same folder. "onnxruntime-genai-builder" is the peer's own
export: GenAI's model builder (`python -m onnxruntime_genai.models.builder`, offline on the same HF
folder: GroupQueryAttention and its other fused ops, its own round-to-nearest int8/int4 with its CPU
defaults: block 32, accuracy_level 4) in GenAI's loop. ONNX Runtime's CPU kernels have no bfloat16,
so these rows run float32 (activations float32, weights float32 / int8 / int4) and bfloat16 rows are
skipped. The parent (prepare) exports once per (model, quant) into the cache, tokenizes the prompt
with the model's tokenizer (the ids the torch rows get) and fixes the thread count.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .session import Session, current_rss_mb, prompt_ids, summarize_runs

BACKENDS = ("onnxruntime", "onnxruntime-genai", "onnxruntime-genai-builder")
BUILDER_PRECISION = {"none": "fp32", "int8": "int8", "int8-all": "int8", "int4": "int4", "int4-all": "int4"}
QUANTS = ("none", "int8", "int8-all", "int4", "int4-all")


def import_error(backend: str) -> str | None:
    module = "onnxruntime_genai" if backend.startswith("onnxruntime-genai") else "onnxruntime"
    try:
        __import__(module)
        __import__("onnxscript")
    except ImportError as exc:
        return f"{exc.name} is not installed (pip install ffl_backend[onnx])"
    return None


def skip_reason(cfg: dict) -> str | None:
    if (error := import_error(cfg["backend"])) is not None:
        return error
    if cfg["dtype"] != "float32":
        return "ONNX Runtime's CPU kernels have no bfloat16/float16 matmuls: its rows run float32"
    if cfg["quant"] not in QUANTS:
        return f"{cfg['quant']} has no ONNX Runtime weight format (rows run {', '.join(QUANTS)})"
    if cfg.get("batch", 1) != 1:
        return "onnxruntime rows time one sequence (batch 1)"
    if cfg.get("device", "cpu") != "cpu":
        return "onnxruntime rows run on the CPU"
    return None


def export_dir(model: str, quant: str, backend: str = "onnxruntime") -> Path:
    from ..onnx.export import FORMAT_VERSION
    from ..paths import cache_dir

    exporter = "genai-builder" if backend == "onnxruntime-genai-builder" else f"fastflow{FORMAT_VERSION}"
    return Path(cache_dir()) / "onnx" / f"{Path(model.rstrip('/')).name}-{quant}-{exporter}"


def _export(cfg: dict, folder: Path, log) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..onnx import export_onnx

    log(f"  exporting {Path(cfg['model']).name} ({cfg['quant']}) to ONNX for ONNX Runtime (once; cached)")
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32).eval()
    quant = None if cfg["quant"] == "none" else cfg["quant"]
    export_onnx(model, folder, quant=quant, tokenizer=AutoTokenizer.from_pretrained(cfg["model"]))


def _build_with_genai(cfg: dict, folder: Path, log) -> None:
    """GenAI's own model builder on the same HF folder, offline."""
    import subprocess
    import sys
    import tempfile

    log(f"  building {Path(cfg['model']).name} ({cfg['quant']}) with ONNX Runtime GenAI's builder (once; cached)")
    with tempfile.TemporaryDirectory(prefix="ffl-genai-builder-") as scratch:
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", cfg["model"], "-o", str(folder),
                        "-p", BUILDER_PRECISION[cfg["quant"]], "-e", "cpu", "-c", scratch,
                        "--extra_options", "hf_token=false"],
                       check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def prepare(cfgs: list[dict], log=print) -> None:
    """Parent-side: export each (model, quant) once (cached), prompt ids, weight bytes, threads."""
    import torch
    from transformers import AutoTokenizer

    tokenizers = {}
    for cfg in cfgs:
        folder = export_dir(cfg["model"], cfg["quant"], cfg["backend"])
        if not (folder / "genai_config.json").exists():
            (_build_with_genai if cfg["backend"] == "onnxruntime-genai-builder" else _export)(cfg, folder, log)
        if cfg["model"] not in tokenizers:
            tokenizers[cfg["model"]] = AutoTokenizer.from_pretrained(cfg["model"])
        ids = prompt_ids(tokenizers[cfg["model"]], cfg["prompt_len"], cfg.get("text"))[0].tolist()
        weights = sum(p.stat().st_size for p in folder.glob("model.onnx*"))
        cfg.update(onnx_dir=str(folder), prompt_ids=ids, weight_bytes=weights,
                   threads=cfg.get("threads") or torch.get_num_threads())


def environment() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {name: installed(name) for name in ("onnxruntime", "onnxruntime-genai", "onnx", "onnxscript")}


class OrtSession(Session):
    """session.Session's protocol over an exported folder (plain ONNX Runtime or GenAI)."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.runtime_rss_mb = current_rss_mb()
        t0 = time.perf_counter()
        runner = _GenAIRunner if cfg["backend"].startswith("onnxruntime-genai") else _OrtRunner
        self.model = runner(cfg["onnx_dir"], cfg["threads"])  # no torch model: no fastflow cache to report
        self.warm_up(load_s=time.perf_counter() - t0, quantize_s=0.0)  # quantized when exported

    def generate(self) -> dict:
        return self.model.time_generate(self.cfg["prompt_ids"], self.cfg["new_tokens"])

    def measure(self) -> dict:
        return {**summarize_runs(self.cfg, self.first, self.runs, self.cfg["weight_bytes"], recompiles=0,
                                 graphs_compiled_while_timed=0, cuda_peak_mb=None), "compile_cold_s": 0.0}


def _timed(first_stamp: float, start: float, stamps: list[float], tokens: list[int]) -> dict:
    decode_s = stamps[-1] - stamps[0]
    return {"generate_s": stamps[-1] - start, "ttft_s": first_stamp - start,
            "decode_tok_s": (len(stamps) - 1) / decode_s if decode_s > 0 else float("nan"),
            "tokens": tokens, "rows_equal": True}


class _OrtRunner:
    def __init__(self, folder: str, threads: int):
        from ..onnx.runtime import OnnxCausalLM

        self.model = OnnxCausalLM(folder, threads=threads)

    def time_generate(self, ids: list[int], new_tokens: int) -> dict:
        """Exactly `new_tokens` greedy tokens (EOS does not stop it), stamped as session.time_generate."""
        import numpy as np

        start = time.perf_counter()
        logits, past = self.model.step(np.asarray([ids], np.int64))
        tokens, stamps = [int(logits[0, -1].argmax())], [time.perf_counter()]
        while len(tokens) < new_tokens:
            logits, past = self.model.step(np.asarray([[tokens[-1]]], np.int64), past)
            tokens.append(int(logits[0, -1].argmax()))
            stamps.append(time.perf_counter())
        return _timed(stamps[0], start, stamps, tokens)


class _GenAIRunner:
    def __init__(self, folder: str, threads: int):
        import onnxruntime_genai as og

        config = og.Config(folder)
        config.clear_providers()
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.og, self.model = og, og.Model(config)

    def time_generate(self, ids: list[int], new_tokens: int) -> dict:
        import numpy as np

        og = self.og
        start = time.perf_counter()
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(ids) + new_tokens, min_length=len(ids) + new_tokens)
        generator = og.Generator(self.model, params)
        generator.append_tokens(np.asarray([ids], np.int32))
        tokens, stamps = [], []
        while len(tokens) < new_tokens and not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            stamps.append(time.perf_counter())
        return _timed(stamps[0], start, stamps, tokens)
