"""CPU decode attention: which path should `fastflow::attention_decode` take? (decode.py docstring)

SmolLM2-135M shapes: 9 q heads, 3 kv heads, head dim 64; one query against a static cache of 2048
slots of which 600 are filled, boolean HF mask. Compared, 2 threads, median of 5 x 300 calls:
  opaque:   a custom op that slices the cache to `filled` (data-dependent, legal inside an opaque op)
            and calls SDPA with enable_gqa; called eagerly and inside a compiled graph
  masked:   SDPA over the full cache with the mask (what HF's sdpa + static cache does), eager and
            compiled by Inductor

    python benchmarks/attention_cpu_paths.py
"""
import time

import torch
import torch.nn.functional as F

from ffl_backend.attention import decode  # noqa: F401  (registers the op)


def opaque(q, k, v, filled, mask):
    return torch.ops.fastflow.attention_decode(q, k, v, filled, 0.125, 0, mask)


def masked(q, k, v, filled, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)


def bench(fn, args, calls=300, rounds=5):
    for _ in range(20):
        fn(*args)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(times)


def main():
    torch.set_num_threads(2)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, 9, 1, 64, dtype=dtype)
        k, v = torch.randn(1, 3, 2048, 64, dtype=dtype), torch.randn(1, 3, 2048, 64, dtype=dtype)
        mask = torch.zeros(1, 1, 1, 2048, dtype=torch.bool)
        mask[..., :600] = True
        args = (q, k, v, torch.tensor(600), mask)
        torch.testing.assert_close(opaque(*args), masked(*args))  # outputs first, then time
        for name, fn in (("opaque slice + SDPA, eager", opaque), ("opaque, in a compiled graph", torch.compile(opaque)),
                         ("masked full-cache SDPA, eager", masked),
                         ("masked full-cache SDPA, Inductor", torch.compile(masked))):
            t = bench(fn, args)
            print(f"{str(dtype):15s} {name:34s} median {t[2]:7.1f} us (min {t[0]:.1f}, max {t[-1]:.1f})")


if __name__ == "__main__":
    main()
