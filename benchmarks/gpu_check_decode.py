"""The GPU check's `decode` stage (benchmarks/gpu_check.py): decode speed of random-weight models
built on the GPU in memory (no checkpoint travels to the device machine): SmolLM2-135M's architecture
and a Llama-3-8B-sized one, bf16, greedy, batch 1 and 8. Rows: eager (static cache), Inductor
("default", "reduce-overhead"), fastflow through `optimize()` ("default", "reduce-overhead", int8 and
int4). Figures as ffl-bench takes them (ffl_backend.bench.session): decode tok/s from per-token
stamps, weight GB/s = bytes one step reads x steps/s, here against the H200's 4.8 TB/s too.

Rows run most informative first and stop when the stage's budget runs short; the rest are listed
with the reason. Random weights make the text meaningless: tokens are compared with the eager row of
the same model and batch only as a sanity figure (bf16 may flip near-ties)."""
from __future__ import annotations

import dataclasses
import gc
import statistics
import time

H200_GBS = 4800.0
RO = "reduce-overhead"
PROMPT_LEN = 16
# Published sizes (SmolLM2-135M's config.json; Llama-3-8B's); the rest is transformers' LlamaConfig.
MODELS = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                       max_position_embeddings=8192, rms_norm_eps=1e-5),
    # two layers: a smoke test of this script itself (`--models tiny-llama`, also on `--device cpu`)
    "tiny-llama": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, max_position_embeddings=256),
}
NEW_TOKENS = {"smollm2-135m": 64, "llama-3-8b": 32, "tiny-llama": 8}
REPEATS = {"smollm2-135m": 3, "llama-3-8b": 2, "tiny-llama": 2}
SMALL = ("smollm2-135m", "tiny-llama")
# What this stage imports, checked by the dry run (modules move: a stale name fails there, not on the GPU)
NEEDS = {"ffl_backend.api": ["optimize"], "ffl_backend.generation": ["configure_generate"],
         "ffl_backend.bench.session": ["time_generate", "weight_bytes"], "ffl_backend.bench.bandwidth": ["read_gbs"],
         "ffl_backend": ["clear_reports"], "transformers": ["AutoModelForCausalLM", "LlamaConfig"]}


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    batch: int
    backend: str  # eager | inductor | fastflow
    mode: str | None = None
    quant: str | None = None

    @property
    def label(self) -> str:
        parts = [self.model, f"b{self.batch}", self.backend, self.mode, self.quant]
        return " ".join(p for p in parts if p)


def plan(models) -> list[Row]:
    """The rows, most informative first: batch 1 of both models (eager, fastflow and Inductor in
    reduce-overhead, fastflow int8/int4), then batch 8 of the small model, then the "default" modes.
    The 8B model runs batch 1 only: its compiles are what the 8 minutes cannot afford twice."""
    rows = []
    for model in MODELS:
        rows += [Row(model, 1, "eager"), Row(model, 1, "fastflow", RO), Row(model, 1, "inductor", RO)]
    for model in MODELS:
        rows += [Row(model, 1, "fastflow", RO, "int8"), Row(model, 1, "fastflow", RO, "int4")]
    for model in SMALL:
        rows += [Row(model, 8, "eager"), Row(model, 8, "fastflow", RO), Row(model, 8, "inductor", RO),
                 Row(model, 8, "fastflow", RO, "int8"), Row(model, 8, "fastflow", RO, "int4")]
    for model in SMALL:
        for batch in (1, 8):
            rows += [Row(model, batch, "inductor", "default"), Row(model, batch, "fastflow", "default")]
    return [r for r in rows if r.model in models]


def build_model(name: str, device: str):
    """A bf16 Llama of `name`'s sizes with random weights, made directly on `device`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**MODELS[name], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):  # allocated and initialised there: an 8B model never visits the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.to(device).eval()  # a no-op, unless this transformers built it elsewhere


def configure(model, row: Row, cache_len: int):
    """What each row runs: the bench worker's set-ups (ffl_backend/bench/session.py)."""
    from ffl_backend.api import optimize
    from ffl_backend.generation import configure_generate

    if row.backend == "fastflow":
        return optimize(model, quant=row.quant, max_batch_size=row.batch, max_seq_len=cache_len, mode=row.mode)
    backend = None if row.backend == "eager" else row.backend
    return configure_generate(model, backend=backend, max_cache_len=cache_len, mode=row.mode)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _release() -> None:
    """Free a row's model, compiled graphs and CUDA graph pools before the next row."""
    import torch

    import ffl_backend

    torch._dynamo.reset()
    ffl_backend.clear_reports()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_row(row: Row, device: str, eager_tokens: dict, ceilings: dict) -> dict:
    import torch

    from ffl_backend.bench.bandwidth import read_gbs
    from ffl_backend.bench.session import time_generate, weight_bytes

    new = NEW_TOKENS[row.model]
    t0 = time.perf_counter()
    model = configure(build_model(row.model, device), row, PROMPT_LEN + new)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, MODELS[row.model]["vocab_size"], (1, PROMPT_LEN), generator=gen)
    ids = ids.repeat(row.batch, 1).to(device)
    first = time_generate(model, ids, new)  # compiles (and captures CUDA graphs)
    graphs = _graphs()
    runs = [time_generate(model, ids, new) for _ in range(REPEATS[row.model])]
    nbytes = weight_bytes(model)
    if row.model not in ceilings:
        ceilings[row.model] = read_gbs(nbytes, device, seconds=0.3)
    rate = statistics.median(r["decode_tok_s"] for r in runs)
    gbs = nbytes * rate / row.batch / 1e9  # every step reads the weights once, whatever the batch
    key = (row.model, row.batch)
    if row.backend == "eager":
        eager_tokens[key] = first["tokens"]
    ref = eager_tokens.get(key)
    agree = None if ref is None else next((i for i, (a, b) in enumerate(zip(first["tokens"], ref)) if a != b), len(ref))
    generate_s = statistics.median(r["generate_s"] for r in runs)
    return {"decode_tok_s": round(rate, 1), "decode_tok_s_all": [round(r["decode_tok_s"], 1) for r in runs],
            "weight_bytes": nbytes, "weight_gb_s": round(gbs, 1), "pct_of_h200": round(100 * gbs / H200_GBS, 1),
            "pct_of_measured_read": round(100 * gbs / ceilings[row.model], 1),
            "compile_s": round(max(0.0, first["generate_s"] - generate_s), 1),
            "ttft_ms": round(1e3 * statistics.median(r["ttft_s"] for r in runs), 1),
            "tokens_agree_with_eager": agree, "new_tokens": new, "rows_equal": all(r["rows_equal"] for r in runs),
            "graphs_compiled_while_timed": _graphs() - graphs, "row_s": round(time.perf_counter() - t0, 1),
            "cuda_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None}


def _expected_cost(row: Row, costs: dict) -> float:
    """Seconds a row will probably take: the slowest row so far of its model and kind (compiled or
    eager); a model's first compiled row is expected to cost as much as any compiled row so far."""
    compiled = row.backend != "eager"
    same = costs.get((row.model, compiled))
    return same if same is not None else max((c for (_, comp), c in costs.items() if comp == compiled), default=0.0)


def stage_decode(ctx) -> dict:
    import torch

    if ctx.device == "cuda" and not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU"}
    models = ctx.models or ["smollm2-135m", "llama-3-8b"]
    res = {"prompt_len": PROMPT_LEN, "new_tokens": {m: NEW_TOKENS[m] for m in models}, "h200_gbs": H200_GBS,
           "rows": [], "skipped": [], "failed": [], "not_planned": "llama-3-8b at batch 8 (time)"}
    eager_tokens, ceilings, costs = {}, {}, {}
    for row in plan(models):
        expected = _expected_cost(row, costs)
        if ctx.left() < 1.2 * expected + 5:
            res["skipped"].append({"row": row.label, "reason": f"stage budget: {ctx.left():.0f} s left, "
                                                               f"a row like it took {expected:.0f} s"})
            ctx.log(f"  {row.label:45s} skipped (budget)")
            continue
        t0 = time.perf_counter()
        try:
            out = {"row": row.label, **dataclasses.asdict(row), **run_row(row, ctx.device, eager_tokens, ceilings)}
            res["rows"].append(out)
            ctx.log(f"  {row.label:45s} {out['decode_tok_s']:8.1f} tok/s {out['weight_gb_s']:7.0f} GB/s "
                    f"({out['pct_of_h200']:4.1f}% of 4.8 TB/s) compile {out['compile_s']:5.1f} s "
                    f"agree {out['tokens_agree_with_eager']}/{out['new_tokens']}")
        except Exception as exc:  # noqa: BLE001 - a failing row is recorded; the next one runs
            res["failed"].append({"row": row.label, "error": f"{type(exc).__name__}: {exc}"})
            ctx.log(f"  {row.label:45s} FAILED {type(exc).__name__}: {exc}")
        finally:
            key = (row.model, row.backend != "eager")
            costs[key] = max(costs.get(key, 0.0), time.perf_counter() - t0)
            _release()
            ctx.save({"status": "running", "result": res})
    res["measured_read_gbs"] = {m: round(v, 1) for m, v in ceilings.items()}
    res["ok"] = not res["failed"]
    return res
