"""The paged KV cache: a block allocator, and a `transformers` Cache whose `update` scatters new
keys/values into a pool of fixed-size blocks.

Layout: per layer one K and one V pool of shape (num_blocks, block_size, Hkv, D), allocated once
and never grown; with a quantized cache (kv_dtype int8 / fp8 e4m3) D is attention/kv_quant.py's
packed row (values + fp32 scale): new keys/values are quantized as they are written, and attention
reads them as stored, dequantizing inside the op (a prefill too: the same numbers decode will see).
Block 0 is a dummy: padded decode rows (batch buckets) write their garbage there
and unused block-table entries point at it, so no real sequence's data is ever touched by padding.
A token's slot is `block * block_size + offset`; `slot_mapping` (one int64 per new token) is a
tensor given per step, so the write is the same graph whatever the slots are.

The model's own forward runs unchanged: LlamaAttention calls
`cache.update(key_states, value_states, layer_idx, kwargs=kwargs)` with the forward's extra keyword
arguments, which is how `slot_mapping` reaches the cache and `block_tables`/`seq_lens` reach the
attention function (attention.py) without copying any model code. Models whose attention calls
`update(k, v, layer_idx)` without them (GPT-NeoX) read the same step state from the cache itself
(`step_slots`, `step_paged`, set by the runner before each forward).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..attention.kv_quant import packed_width, quantize_kv_bytes

DUMMY_BLOCK = 0


class BlockAllocator:
    """Free list of block ids 1..num_blocks-1 (0 is the dummy). LIFO: recently freed blocks are
    reused first (warm in cache)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError("a paged cache needs at least 2 blocks (one is the dummy)")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} blocks requested, {len(self._free)} free")
        out = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        return out[::-1]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _cache_base():
    from transformers.cache_utils import Cache

    return Cache


class PagedCacheMixin:
    """Implementation shared by the Cache subclass built in `make_paged_cache` (transformers is
    imported lazily, so the class is created on first use)."""

    def _init_pools(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype, device, kv_dtype: torch.dtype | None = None) -> None:
        self.num_blocks, self.block_size, self.kv_dtype = num_blocks, block_size, kv_dtype
        self.step_slots, self.step_paged = None, False  # set by the runner before every step
        width, dtype = (packed_width(head_dim), kv_dtype) if kv_dtype is not None else (head_dim, dtype)
        shape = (num_blocks, block_size, kv_heads, width)
        self.k_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in self.k_pools + self.v_pools:
            torch._dynamo.mark_static_address(t)  # the same storage every step (CUDA graphs, no guards)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_pools + self.v_pools)

    def data_ptrs(self) -> list[int]:
        return [t.data_ptr() for t in self.k_pools + self.v_pools]

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, kwargs=None, **kw):
        """Write the new k/v (B, Hkv, L, D) at `slot_mapping` (B*L,); return what the attention
        function reads: the whole pools when decoding over block tables, else the new k/v."""
        kwargs = kwargs if kwargs is not None else kw
        if "slot_mapping" in kwargs:
            slots, paged = kwargs["slot_mapping"], kwargs.get("block_tables") is not None
        else:  # a model that calls update(k, v, layer_idx) without the forward's kwargs (GPT-NeoX)
            slots, paged = self.step_slots, self.step_paged
        k_pool, v_pool = self.k_pools[layer_idx], self.v_pools[layer_idx]
        if self.kv_dtype is not None:  # byte rows through an int8 view: CPU has no fp8 index_copy_
            key_states = quantize_kv_bytes(key_states, self.kv_dtype)
            value_states = quantize_kv_bytes(value_states, self.kv_dtype)
        for pool, states in ((k_pool, key_states), (v_pool, value_states)):
            rows = states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[-1])  # (B*L, Hkv, width)
            pool = pool.view(torch.int8) if self.kv_dtype is not None else pool
            pool.view(-1, *rows.shape[1:]).index_copy_(0, slots, rows.to(pool.dtype))
        if paged:
            return k_pool, v_pool
        if self.kv_dtype is not None:
            return key_states.view(self.kv_dtype), value_states.view(self.kv_dtype)
        return key_states, value_states

    # What transformers may ask of any cache; positions are always given explicitly, and the
    # attention implementation has no mask function, so none of these shape a computation.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.num_blocks * self.block_size

    @property
    def is_compileable(self) -> bool:
        return True


_CLASS = None


def make_paged_cache(config, num_blocks: int, block_size: int, dtype: torch.dtype, device=None,
                     kv_dtype: torch.dtype | None = None):
    """A `transformers.cache_utils.Cache` subclass instance with pools for every layer of `config`;
    `kv_dtype` (torch.int8 / torch.float8_e4m3fn) stores them quantized (module docstring)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = type("PagedKVCache", (PagedCacheMixin, _cache_base()), {})
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    cache = _CLASS(layers=[])
    cache._init_pools(cfg.num_hidden_layers, num_blocks, block_size, kv_heads, head_dim, dtype, device, kv_dtype)
    return cache
