"""Attention over a static or paged KV cache: the fused ops and their Triton kernels.

    prefill.py  `torch.ops.fastflow.attention_prefill(q, k, v, scale, window)`: causal self-attention
                over exactly the given keys (FlashAttention-style Triton kernel on CUDA)
    decode.py   `torch.ops.fastflow.attention_decode(q, k_cache, v_cache, filled, scale, window, mask)`:
                a few queries against a static cache, reading only its first `filled` (a tensor) slots
                (split-K / flash-decoding Triton kernels on CUDA, slice + SDPA on CPU)
    paged.py    `torch.ops.fastflow.paged_decode(...)`: decode attention over a paged KV cache (the engine's)
    kv_quant.py the int8 / fp8 KV-cache row format every attention op reads
    reference.py  the pure-torch definition the ops are tested against

The "fastflow" attention + mask functions for transformers, and the per-model install/restore, are in
ffl_backend/hf_attention.py (integration layer, above this package).

Importing prefill/decode/paged registers its op; importing this package registers nothing.
"""
