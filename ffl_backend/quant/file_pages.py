"""Let go of the checkpoint file's memory mapping once quantization has replaced its weights.

`from_pretrained` memory-maps the safetensors file and its tensors are views into that mapping.
Quantizing reads every weight it replaces, so those pages become resident; the mapping, and with it
every page read, stays alive as long as any tensor of the model still points into it -- and the
layers kept in high precision (norm weights, a kept embedding) do, for the model's lifetime. On
SmolLM2-135M that left RSS after `quantize(model, "int8")` and a forward at 824 MiB (bf16: 688).
Copying the kept tensors out of the mapping (tiny norms; a kept embedding is read once) releases it:
615 MiB (`python benchmarks/quant_cpu.py rss --model int8-quantize`). Linux only (/proc/self/maps);
elsewhere nothing changes.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("ffl_backend")


def _file_mappings() -> list[tuple[int, int]]:
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


def copy_out_of_file_mappings(model: nn.Module, skip: tuple[type, ...] = ()) -> int:
    """Give every CPU parameter and buffer of `model` that lives in a file mapping its own memory
    (same Parameter objects, so ties and references to them hold). Tensors of `skip` modules stay
    (a loaded quantized checkpoint's tables: all in use, a copy would only double them).
    Returns how many were copied."""
    ranges = _file_mappings()
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
                    t.data = t.data.clone()
                    copied += 1
    if copied:
        logger.info("quantize: copied %d kept tensors out of the checkpoint's memory mapping", copied)
    return copied
