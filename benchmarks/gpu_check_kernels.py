"""The GPU check's `kernels` stage (benchmarks/gpu_check.py): every Triton kernel alone, on the shapes
of a Llama-3-8B layer in bf16, timed with CUDA events after an L2 flush (median of 25 calls). Its
achieved bandwidth is the bytes it must move (inputs read once, outputs written once) over that time,
against the H200's 4.8 TB/s and the read rate torch.sum reaches on this GPU. Correctness is the tests
stage's job; here each output is only checked to be finite."""
from __future__ import annotations

import statistics

H200_GBS = 4800.0  # HBM3e, NVIDIA's figure
FLUSH_BYTES = 256 << 20  # well past the H200's 50 MB L2
HIDDEN, INTER, TOKENS = 4096, 14336, 8192  # Llama-3-8B's widths; the rows of a long prefill
HQ, HKV, HEAD = 32, 8, 128
# What this stage imports, checked by the dry run (modules move: a stale name fails there, not on the GPU)
NEEDS = {"torch.cuda": ["_sleep"], "ffl_backend.kernels.rms_norm": ["rms_norm_triton", "add_rms_norm_triton"],
         "ffl_backend.kernels.layer_norm": ["layer_norm_triton"],
         "ffl_backend.kernels.gated_act": ["silu_mul_triton", "gelu_mul_triton"],
         "ffl_backend.kernels.gelu_residual": ["gelu_residual_triton"], "ffl_backend.kernels.rotary": ["rotary_triton"],
         "ffl_backend.kernels.triton_quant": ["int8_linear_triton", "int4_linear_triton", "w8a8_linear_triton",
                                              "fp8_linear_triton", "quantize_per_token_triton"],
         "ffl_backend.numerics": ["quantize_int8", "quantize_int4", "pack_int4", "quantize_fp8"],
         "ffl_backend.attention.prefill": ["attention_prefill_triton"],
         "ffl_backend.attention.decode": ["attention_decode_triton"],
         "ffl_backend.attention.paged": ["paged_decode_triton"], "ffl_backend.bench.bandwidth": ["read_gbs"]}


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# Cycles the GPU spins (torch.cuda._sleep) before each timed call, ~1 ms: the CPU enqueues the start
# event, the call's kernels and the end event meanwhile, so the Python dispatch of the call (measured
# apart, as launch_us) is off the GPU clock. Run a's row kernels all took ~0.4 ms whatever their size.
GPU_SLEEP_CYCLES = 2_000_000


def time_ms(fn, flush, iters: int = 25) -> tuple[float, float]:
    """(median GPU ms, median CPU launch us) of `iters` calls, each on a cold L2 (a 256 MB write before
    it), by CUDA events behind a GPU sleep."""
    import time

    import torch

    fn()  # compiles the kernel for these arguments
    torch.cuda.synchronize()
    times, launches = [], []
    for _ in range(iters):
        flush.zero_()
        torch.cuda._sleep(GPU_SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        launches.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), statistics.median(launches)


def _norm_cases(r):
    from ffl_backend.kernels import layer_norm, rms_norm

    x, res, w, b = r(TOKENS, HIDDEN), r(TOKENS, HIDDEN), r(HIDDEN), r(HIDDEN)
    yield ("rms_norm", f"{TOKENS}x{HIDDEN}", lambda: rms_norm.rms_norm_triton(x, w, 1e-5), nbytes(x, x, w), 0)
    yield ("add_rms_norm", f"{TOKENS}x{HIDDEN}", lambda: rms_norm.add_rms_norm_triton(x, res, w, 1e-5),
           nbytes(x, res, w, x, x), 0)
    yield ("layer_norm", f"{TOKENS}x{HIDDEN}", lambda: layer_norm.layer_norm_triton(x, w, b, 1e-5),
           nbytes(x, w, b, x), 0)


def _elementwise_cases(r):
    from ffl_backend.kernels import gated_act, gelu_residual, rotary

    gate, up = r(2048, INTER), r(2048, INTER)
    yield ("silu_mul", f"2048x{INTER}", lambda: gated_act.silu_mul_triton(gate, up), nbytes(gate, up, up), 0)
    yield ("gelu_mul(tanh)", f"2048x{INTER}", lambda: gated_act.gelu_mul_triton(gate, up, "tanh"),
           nbytes(gate, up, up), 0)
    x, bias, res = r(TOKENS, HIDDEN), r(HIDDEN), r(TOKENS, HIDDEN)
    yield ("gelu_residual", f"{TOKENS}x{HIDDEN}", lambda: gelu_residual.gelu_residual_triton(x, bias, res, "tanh"),
           nbytes(x, bias, res, x), 0)
    q, k = r(1, 4096, HQ, HEAD).transpose(1, 2), r(1, 4096, HKV, HEAD).transpose(1, 2)
    cos, sin = r(1, 4096, HEAD), r(1, 4096, HEAD)
    yield ("rotary", f"q {HQ}x4096x{HEAD}, k {HKV}x4096x{HEAD}",
           lambda: rotary.rotary_triton(q, k, cos, sin, HEAD), 2 * nbytes(q, k) + nbytes(cos, sin), 0)


def _quant_cases(r, fp8: bool):
    import torch

    from ffl_backend import numerics as N
    from ffl_backend.kernels import triton_quant as Q

    w = r(INTER, HIDDEN, dtype=torch.float32) * 0.05
    q8, s8 = N.quantize_int8(w, torch.bfloat16)
    codes, s4, z4 = N.quantize_int4(w, 128, scale_dtype=torch.bfloat16)
    q4 = N.pack_int4(codes)
    qa, sa = N.quantize_int8(w, torch.float32)
    for m in (1, 512):  # a decode GEMV; a prefill GEMM
        x = r(m, HIDDEN)
        out = torch.empty(m, INTER, dtype=torch.bfloat16, device=x.device)
        flops = 2 * m * INTER * HIDDEN
        yield (f"w8a16 M={m}", f"{INTER}x{HIDDEN}", lambda x=x: Q.int8_linear_triton(x, q8, s8),
               nbytes(x, q8, s8, out), flops)
        yield (f"w4a16 g128 M={m}", f"{INTER}x{HIDDEN}", lambda x=x: Q.int4_linear_triton(x, q4, s4, z4, 128),
               nbytes(x, q4, s4, z4, out), flops)
        yield (f"w8a8 M={m}", f"{INTER}x{HIDDEN}", lambda x=x: Q.w8a8_linear_triton(x, qa, sa),
               nbytes(x, qa, sa, out), flops)
    if fp8:
        qf, sf = N.quantize_fp8(w)
        x = r(1, HIDDEN)
        yield ("fp8 M=1", f"{INTER}x{HIDDEN}", lambda: Q.fp8_linear_triton(x, qf, sf), nbytes(x, qf, sf) + 2 * INTER, 0)
    x = r(TOKENS, HIDDEN)
    yield ("quantize_per_token int8", f"{TOKENS}x{HIDDEN}", lambda: Q.quantize_per_token_triton(x),
           nbytes(x) + x.numel() + 4 * TOKENS, 0)


def _attention_cases(r):
    import torch

    from ffl_backend.attention import decode, paged, prefill

    q, k, v = r(1, HQ, 4096, HEAD), r(1, HKV, 4096, HEAD), r(1, HKV, 4096, HEAD)
    flops = 4 * HQ * 4096 * 4096 * HEAD // 2  # causal: half the score matrix
    yield ("attention_prefill (flash)", f"1x{HQ}/{HKV}x4096x{HEAD} causal",
           lambda: prefill.attention_prefill_triton(q, k, v, HEAD ** -0.5), 2 * nbytes(q) + nbytes(k, v), flops)
    for batch in (1, 8):
        q1 = r(batch, HQ, 1, HEAD)
        kc, vc = r(batch, HKV, 8192, HEAD), r(batch, HKV, 8192, HEAD)
        filled = torch.tensor(8192, device=q1.device)
        yield (f"attention_decode split-K B={batch}", f"{HQ}/{HKV} heads, 8192 filled",
               lambda q1=q1, kc=kc, vc=vc, filled=filled: decode.attention_decode_triton(q1, kc, vc, filled,
                                                                                         HEAD ** -0.5),
               nbytes(kc, vc) + 2 * nbytes(q1), 0)
    lens, block = [4096] * 8, 16
    blocks = 8 * 4096 // block
    kp, vp = r(blocks + 1, block, HKV, HEAD), r(blocks + 1, block, HKV, HEAD)
    table = (torch.arange(blocks, dtype=torch.int32, device=kp.device) + 1).reshape(8, -1)
    table = table[:, torch.randperm(table.shape[1], device=kp.device)]  # scattered blocks, as a pool holds them
    seq_lens, qp = torch.tensor(lens, dtype=torch.int32, device=kp.device), r(8, HQ, HEAD)
    yield ("paged_decode B=8", f"{HQ}/{HKV} heads, 4096 each, block {block}",
           lambda: paged.paged_decode_triton(qp, kp, vp, table, seq_lens, HEAD ** -0.5),
           nbytes(kp[1:], vp[1:]) + 2 * nbytes(qp), 0)


def _row(name, shape, fn, moved, flops, flush, measured_gbs) -> dict:
    import torch

    out = fn()
    outs = out if isinstance(out, tuple) else (out,)
    if not all(torch.isfinite(t.float()).all() for t in outs if t.is_floating_point()):
        raise RuntimeError("non-finite output")
    ms, launch_us = time_ms(fn, flush)
    gbs = moved / ms / 1e6
    row = {"kernel": name, "shape": shape, "ms": round(ms, 4), "launch_us": round(launch_us, 1), "bytes": moved,
           "gb_s": round(gbs, 1),
           "pct_of_h200": round(100 * gbs / H200_GBS, 1), "pct_of_measured_read": round(100 * gbs / measured_gbs, 1)}
    if flops:
        row["tflop_s"] = round(flops / ms / 1e9, 1)
    return row


def stage_kernels(ctx) -> dict:
    import torch

    from ffl_backend.bench.bandwidth import read_gbs

    if ctx.device != "cuda" or not torch.cuda.is_available():
        return {"skipped": "the kernel timings need a CUDA GPU"}
    dev = "cuda"

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, device=dev, dtype=dtype)

    measured = read_gbs(1 << 30, dev, seconds=0.3)
    ctx.log(f"  torch.sum reads a 1 GiB buffer at {measured:.0f} GB/s ({100 * measured / H200_GBS:.0f}% of 4.8 TB/s)")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    fp8 = torch.cuda.get_device_capability() >= (9, 0)
    res = {"h200_gbs": H200_GBS, "measured_read_gbs": round(measured, 1), "rows": [], "skipped": [], "failed": []}
    if not fp8:
        res["skipped"].append({"kernel": "fp8", "reason": "FP8 kernels need sm_90"})
    groups = (_norm_cases(r), _elementwise_cases(r), _quant_cases(r, fp8), _attention_cases(r))
    for group in groups:
        try:
            for name, shape, fn, moved, flops in group:
                if ctx.left() < 4:
                    res["skipped"].append({"kernel": name, "reason": "stage budget spent"})
                    continue
                try:
                    row = _row(name, shape, fn, moved, flops, flush, measured)
                    res["rows"].append(row)
                    extra = f", {row['tflop_s']} TFLOP/s" if "tflop_s" in row else ""
                    ctx.log(f"  {name:28s} {shape:34s} {row['ms']:9.4f} ms {row['gb_s']:7.0f} GB/s "
                            f"({row['pct_of_h200']:4.1f}% of 4.8 TB/s){extra}; launch {row['launch_us']:.0f} us")
                except Exception as exc:  # noqa: BLE001 - one kernel failing must not hide the rest
                    res["failed"].append({"kernel": name, "error": f"{type(exc).__name__}: {exc}"})
                    ctx.log(f"  {name}: FAILED {type(exc).__name__}: {exc}")
                ctx.save({"status": "running", "result": res})
        except Exception as exc:  # noqa: BLE001 - building a group's inputs failed
            res["failed"].append({"kernel": "(setup)", "error": f"{type(exc).__name__}: {exc}"})
            ctx.log(f"  setup FAILED {type(exc).__name__}: {exc}")
    res["ok"] = not res["failed"]
    return res
