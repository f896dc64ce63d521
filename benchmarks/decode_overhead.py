"""How much of a fastflow decode step is the weight GEMVs, measured without a profiler: the same
compiled model times greedy generate() with its `fastflow_cpu` GEMV kernels (real) and with those
kernels swapped for stubs that return a preallocated output (null), in alternation, in one process.
null is everything else -- HF generate()'s loop, Dynamo's guards, the compiled graph's wrapper and
its other kernels (norms, rotary, attention, SwiGLU); real - null is the GEMVs with their dispatch.

torch.profiler adds a fixed cost to every op it records, which on a CPU where an op call costs ~5 us
(the 2-core AMD EPYC) inflates the small ops several-fold and makes them look like most of the step.

    python benchmarks/decode_overhead.py [--quant int4-all] [--dtype bfloat16] [--rounds 8]
        [--out benchmarks/results/decode_overhead_cpu.json]   (appends a row)

The stubs make the generated tokens meaningless; the step's work does not depend on their values.
"""
from __future__ import annotations

import argparse
import statistics

import torch


class _StubKernel:
    """Stands in for one fastflow_cpu op: a zero output of the right shape, made once per shape."""

    def __init__(self, rows_of):
        self._rows_of, self._outputs, self.calls = rows_of, {}, 0

    def default(self, x, *args):
        self.calls += 1
        key = (tuple(x.shape), self._rows_of(*args), x.dtype)
        if key not in self._outputs:
            self._outputs[key] = torch.zeros(*x.shape[:-1], key[1], dtype=x.dtype)
        return self._outputs[key]

    __call__ = default


def _kernel_sets() -> dict:
    ops = torch.ops.fastflow_cpu
    stubs = (_StubKernel(lambda weights, *_: sum(w.shape[0] for w in weights)),
             _StubKernel(lambda packed, *_: packed.shape[0] * 16))
    return {"real": (ops.gemv, ops.int4_gemv), "null": stubs}


def _use(kernels) -> None:
    torch.ops.fastflow_cpu.gemv, torch.ops.fastflow_cpu.int4_gemv = kernels


def split_step(model, ids, rounds: int, new_tokens: int, sets: dict | None = None) -> dict:
    """ms per decode step of `model` (configured to generate() with fastflow) with real and with
    stub GEMV kernels, alternating for `rounds` rounds; the real kernels are back in place after."""
    from ffl_backend.bench.worker import time_generate

    sets = sets or _kernel_sets()
    try:
        for name in ("real", "real", "null"):  # compile, warm, warm the stubs' outputs
            _use(sets[name])
            time_generate(model, ids, new_tokens)
        steps = {name: [] for name in sets}
        for r in range(rounds):
            for name in (("real", "null") if r % 2 else ("null", "real")):
                _use(sets[name])
                steps[name].append(1e3 / time_generate(model, ids, new_tokens)["decode_tok_s"])
    finally:
        _use(sets["real"])
    real, null = statistics.median(steps["real"]), statistics.median(steps["null"])
    gemv_share = [r - n for r, n in zip(steps["real"], steps["null"])]
    return {"rounds": rounds, "new_tokens": new_tokens,
            "ms_per_step": {"real": round(real, 2), "null (all but the GEMVs)": round(null, 2),
                            "GEMVs (paired real - null, median)": round(statistics.median(gemv_share), 2)},
            "ms_per_step_all": {k: [round(v, 2) for v in vs] for k, vs in steps.items()}}


def measure(quant: str, dtype: str, rounds: int, new_tokens: int) -> dict:
    from ffl_backend.bench.worker import load_model, prompt_ids
    from ffl_backend.generation import configure_generate
    from ffl_backend.kernels import cpu_gemv
    from ffl_backend.models import smollm2_path

    if not cpu_gemv.load():
        raise SystemExit(f"CPU kernels not built: {cpu_gemv.load_error()}")
    model, tok, _, _ = load_model({"model": str(smollm2_path()), "dtype": dtype, "quant": quant})
    configure_generate(model, backend="fastflow", max_cache_len=16 + new_tokens)
    return {"quant": quant, "dtype": dtype, **split_step(model, prompt_ids(tok, 16), rounds, new_tokens)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quant", default="int4-all")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", help="JSON file to append this row to")
    args = p.parse_args(argv)
    from ffl_backend.bench.grid import report_row

    report_row(measure(args.quant, args.dtype, args.rounds, args.new_tokens), args.out)


if __name__ == "__main__":
    main()
