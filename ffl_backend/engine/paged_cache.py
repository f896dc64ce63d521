"""The paged KV cache: a block allocator, and a `transformers` Cache whose `update` scatters new
keys/values into a pool of fixed-size blocks.

Layout: per layer one K and one V pool of shape (num_blocks, block_size, Hkv, D), allocated once
and never grown. Block 0 is a dummy: padded decode rows (batch buckets) write their garbage there
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
                    dtype: torch.dtype, device) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.step_slots, self.step_paged = None, False  # set by the runner before every step
        shape = (num_blocks, block_size, kv_heads, head_dim)
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
        _, kv_heads, _, head_dim = key_states.shape
        flat_k = k_pool.view(-1, kv_heads, head_dim)
        flat_v = v_pool.view(-1, kv_heads, head_dim)
        flat_k.index_copy_(0, slots, key_states.transpose(1, 2).reshape(-1, kv_heads, head_dim).to(k_pool.dtype))
        flat_v.index_copy_(0, slots, value_states.transpose(1, 2).reshape(-1, kv_heads, head_dim).to(v_pool.dtype))
        if paged:
            return k_pool, v_pool
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


def make_paged_cache(config, num_blocks: int, block_size: int, dtype: torch.dtype, device=None):
    """A `transformers.cache_utils.Cache` subclass instance with pools for every layer of `config`."""
    global _CLASS
    if _CLASS is None:
        _CLASS = type("PagedKVCache", (PagedCacheMixin, _cache_base()), {})
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    cache = _CLASS(layers=[])
    cache._init_pools(cfg.num_hidden_layers, num_blocks, block_size, kv_heads, head_dim, dtype, device)
    return cache
