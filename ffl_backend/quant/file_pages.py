"""Let go of the checkpoint file's memory mapping once quantization has replaced its weights.

`from_pretrained` memory-maps the safetensors file and its tensors are views into that mapping.
Quantizing reads every weight it replaces, so those pages become resident; the mapping, and with it
every page read, stays alive as long as any tensor of the model still points into it -- and the
layers kept in high precision (norm weights, a kept embedding) do, for the model's lifetime. On
SmolLM2-135M that left RSS after `quantize(model, "int8")` and a forward above bf16's. Copying the
kept tensors out of the mapping (tiny norms; a kept embedding is read once) releases it, and RSS
falls below bf16's (`python benchmarks/quant_cpu.py rss --model int8-quantize`; figures:
docs/performance.md#quantization-memory-and-fitting). Linux only (/proc/self/maps);
elsewhere nothing changes.

Until that copy, every weight quantization has read is resident too: the whole checkpoint by the
last layer, on top of the new int8 tables (the peak: docs/performance.md#quantization-memory-and-fitting).
`release_pages` takes a replaced weight's pages out of RSS as soon as its layer is done, and
`by_row_blocks` a large weight's (a 128k-vocabulary embedding) block by block while it is quantized, so
at most a layer's worth of the file is resident at a time. Neither changes what the tensor reads: pages
no one wrote are unmapped (MADV_DONTNEED; they stay in the page cache for the next load, dirty ones of a
file just written too), a tensor with written pages is paged out (`page_out`, MADV_PAGEOUT: a hint that
keeps written pages; it also evicts the file's pages from the page cache, and cannot take pages not yet
written back to disk).

Horizontal fusion's shared storage (weight_layout.share_fused_storage) reads q/k/v and gate/up out of
the mapping into one new tensor per group; the mapping lives on (o_proj, down_proj, the embedding are
still in it), and so would every page the copy read: the checkpoint's largest half resident twice (3B
bf16: 3.7 GB). `release_pages` takes those pages out of RSS group by group as they are copied.

Loading a saved quantized checkpoint maps its file too (quant/serialization.py); there the pages a
module's CPU form was made from are `drop_pages`d -- unmapped from this process, kept in the page cache
for the next load -- and int8 tables a kernel needs aligned are copied out a block at a time
(`copy_dropping_pages`) where an older file left them unaligned.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

import numpy as np
import torch
from torch import nn

logger = logging.getLogger("ffl_backend")


def file_mappings() -> list[tuple[int, int]]:
    """(start, end) of every file-backed mapping of this process; [] where /proc is unavailable."""
    try:
        lines = open("/proc/self/maps").read().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        if path.startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def _in_mapping(t: torch.Tensor, ranges) -> bool:
    if t.device.type != "cpu" or t.untyped_storage().nbytes() == 0:
        return False
    ptr = t.untyped_storage().data_ptr()
    return any(start <= ptr < end for start, end in ranges)


MADV_DONTNEED = 4  # this process's mapping of the pages goes; the page cache keeps them
MADV_PAGEOUT = 21  # Linux >= 5.4; older kernels answer EINVAL and nothing happens
COPY_BLOCK_BYTES = 8 << 20  # copy-out granularity: the most of a tensor resident twice at once
_libc_functions = {}


def _libc(name: str, argtypes: list, restype):
    """A libc function through ctypes with its signature set (cached), or None off Linux / where it
    is missing."""
    if name not in _libc_functions:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = getattr(ctypes.CDLL(None, use_errno=True), name)
                fn.argtypes, fn.restype = argtypes, restype
            except (OSError, AttributeError):
                fn = None
        _libc_functions[name] = fn
    return _libc_functions[name]


def page_out(t: torch.Tensor, ranges=None, advice: int = MADV_PAGEOUT) -> int:
    """Ask the kernel to drop the resident pages under contiguous `t` if it lives in a file mapping
    (whole pages inside its bytes only: neighbours' edge pages stay). Returns the bytes advised, 0
    if none were (not a mapped contiguous CPU tensor, not Linux, the kernel refused).
    advice: MADV_PAGEOUT reclaims the pages (a checkpoint no longer needed); MADV_DONTNEED only
    unmaps them from this process (`drop_pages`)."""
    ranges = file_mappings() if ranges is None else ranges
    madvise = _libc("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)
    if madvise is None or not t.is_contiguous() or not _in_mapping(t, ranges):
        return 0
    start, end = _page_span(t)
    if end <= start:
        return 0
    if madvise(start, end - start, advice) != 0:
        logger.debug("madvise(%d) failed: errno %d", advice, ctypes.get_errno())
        return 0
    return end - start


def _page_span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the whole pages inside contiguous `t`'s bytes (empty where there are none)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-t.data_ptr() // page) * page
    return start, max(start, (t.data_ptr() + t.numel() * t.element_size()) // page * page)


PAGEMAP_PRESENT, PAGEMAP_SWAPPED, PAGEMAP_FILE = 1 << 63, 1 << 62, 1 << 61


def written_pages(t: torch.Tensor) -> int | None:
    """How many of the whole pages under contiguous `t` hold this process's own data rather than the
    file's: in a private file mapping a page written since mapping is an anonymous copy (present or
    swapped without /proc/self/pagemap's file bit); a page read only is the page cache's. None where
    the page map cannot be read (not Linux, no /proc)."""
    start, end = _page_span(t)
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/pagemap", "rb") as fh:
            fh.seek(start // page * 8)
            raw = fh.read((end - start) // page * 8)
    except OSError:
        return None
    entries = np.frombuffer(raw, dtype=np.uint64)
    own = ((entries & np.uint64(PAGEMAP_PRESENT | PAGEMAP_SWAPPED)) != 0) & ((entries & np.uint64(PAGEMAP_FILE)) == 0)
    return int(own.sum())


def release_pages(t: torch.Tensor, ranges=None) -> int:
    """Take the pages under `t`, a view of a file mapping whose values now live elsewhere (fused into
    another tensor), out of this process's RSS without changing what `t` reads: unmapped
    (MADV_DONTNEED: they stay in the page cache for the next load) when none was written since
    mapping -- a later read of `t` then maps the file's identical pages again --, else paged out
    (MADV_PAGEOUT keeps written pages). Returns the bytes advised (0: not a mapped tensor)."""
    ranges = file_mappings() if ranges is None else ranges
    if not t.is_contiguous() or not _in_mapping(t, ranges):
        return 0
    return page_out(t, ranges, MADV_DONTNEED if written_pages(t) == 0 else MADV_PAGEOUT)


ROW_BLOCK_BYTES = 16 << 20  # by_row_blocks: the most of a mapped weight resident at once while quantized


@torch.no_grad()
def by_row_blocks(fn, t: torch.Tensor, *args, **kwargs):
    """`fn(t, *args, **kwargs)` for a row-separable quantizer `fn` (each output row made from the same
    input row alone; its outputs: tensors with t's rows on dim 0). Where `t` is a file mapping's view
    larger than ROW_BLOCK_BYTES, run on blocks of rows, each block's pages released once quantized
    (`release_pages`), the results written into tensors made for all rows: the source is never resident
    whole (a tied 128k-vocabulary embedding is 0.8 GB of bf16 beside its 0.4 GB of int8). Results
    are those of one call (rows are independent); elsewhere one call."""
    if t.dim() != 2 or not t.is_contiguous() or t.numel() * t.element_size() <= ROW_BLOCK_BYTES:
        return fn(t, *args, **kwargs)
    ranges = file_mappings()
    if not _in_mapping(t, ranges):
        return fn(t, *args, **kwargs)
    rows = max(16, ROW_BLOCK_BYTES // (t.shape[1] * t.element_size()) // 16 * 16)
    outs = None
    for start in range(0, t.shape[0], rows):
        block = t[start:start + rows]
        part = fn(block, *args, **kwargs)
        if outs is None:
            outs = tuple(p.new_empty((t.shape[0], *p.shape[1:])) for p in part)
        for out, p in zip(outs, part):
            out[start:start + rows] = p
        del part
        release_pages(block, ranges)
    return outs


def drop_pages(t: torch.Tensor, ranges=None) -> int:
    """Unmap the pages under `t`, a read-only view of a private file mapping (`load_quantized`'s), from
    this process: they stop counting in its RSS and stay in the page cache, so a later read (or the next
    process to load the same file) finds them there. Never on pages written since mapping: MADV_DONTNEED
    would discard the writes (load_quantized calls it only on tensors nothing has written)."""
    return page_out(t, ranges, MADV_DONTNEED)


def release_free_heap() -> None:
    """Return the C heap's free pages to the OS (glibc malloc_trim). Quantizing frees many
    temporaries and whole weights; glibc keeps such memory for reuse, which reads as RSS
    (SmolLM2 int8: tens of MiB after quantize, depending on the run;
    docs/performance.md#quantization-memory-and-fitting). Nothing happens where it is missing."""
    trim = _libc("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
    if trim is not None:
        trim(0)


@torch.no_grad()
def _copy_paging_out(t: torch.Tensor, ranges, advice: int = MADV_PAGEOUT) -> torch.Tensor:
    """A private copy of mapped `t`, block by block, each source block paged out once copied: the
    tensor is never resident twice (a kept 57 MB embedding would otherwise add 57 MB to the peak)."""
    if not t.is_contiguous() or t.dim() == 0:
        return t.clone()
    copy = torch.empty_like(t)
    rows = max(1, COPY_BLOCK_BYTES // max(1, t[0].numel() * t.element_size()))
    for start in range(0, t.shape[0], rows):
        copy[start:start + rows] = t[start:start + rows]
        page_out(t[start:start + rows], ranges, advice)
    return copy


def copy_dropping_pages(t: torch.Tensor, ranges=None) -> torch.Tensor:
    """An aligned private copy of `t`; where `t` is a view of a file mapping, copied block by block
    and each block's pages dropped from this process once copied (`drop_pages`): never resident twice."""
    ranges = file_mappings() if ranges is None else ranges
    return _copy_paging_out(t, ranges, MADV_DONTNEED) if _in_mapping(t, ranges) else t.clone()


def copy_out_of_file_mappings(model: nn.Module, skip: tuple[type, ...] = ()) -> int:
    """Give every CPU parameter and buffer of `model` that lives in a file mapping its own memory
    (same Parameter objects, so ties and references to them hold). Tensors of `skip` modules stay
    (a loaded quantized checkpoint's tables: all in use, a copy would only double them).
    Returns how many were copied."""
    ranges = file_mappings()
    if not ranges:
        return 0
    copied, seen = 0, set()
    for module in model.modules():
        if isinstance(module, skip):
            continue
        for tensors in (module._parameters, module._buffers):
            for t in tensors.values():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                if _in_mapping(t, ranges):
                    t.data = _copy_paging_out(t.data, ranges)
                    copied += 1
    if copied:
        logger.info("quantize: copied %d kept tensors out of the checkpoint's memory mapping", copied)
    return copied
