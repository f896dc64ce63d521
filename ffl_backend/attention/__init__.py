"""Attention over a static KV cache: fused ops, Triton kernels, and the transformers registration.

    prefill.py  `torch.ops.fastflow.attention_prefill(q, k, v, scale, window)`: causal self-attention
                over exactly the given keys (FlashAttention-style Triton kernel on CUDA)
    decode.py   `torch.ops.fastflow.attention_decode(q, k_cache, v_cache, filled, scale, window, mask)`:
                a few queries against a static cache, reading only its first `filled` (a tensor) slots
                (split-K / flash-decoding Triton kernels on CUDA, slice + SDPA on CPU)
    reference.py  the pure-torch definition both ops are tested against
    hf.py       the "fastflow" attention + mask functions for transformers, and per-model install/restore

Importing prefill/decode registers their op; importing this package registers nothing.
"""
