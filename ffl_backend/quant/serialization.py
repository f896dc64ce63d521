"""Save a quantized model and load it back quantized, without re-quantizing.

A saved folder holds `config.json` (the HF config, with a `quantization_config` that lets
`AutoModelForCausalLM.from_pretrained(folder)` load it quantized: quant/hf_integration.py),
`model.safetensors` (the quantized buffers -- int4 codes portable or in the kernel layout, below --
and the high-precision rest) and `ffl_quant.json` (the quant config and each quantized module's spec).

Loading builds the architecture on the meta device, swaps in empty quantized modules, and assigns the
saved tensors as views of one private memory mapping of the file: the high-precision model is never
materialized and nothing is read until used. int4 linears whose CPU form is fastflow's kernel layout
save their codes in that layout (the same bytes as the portable codes, permuted; their specs say
`codes_layout`, manifest version 2), siblings' (q/k/v, gate/up) back to back: loaded, those mapped
bytes are the kernels' form as they stand -- one slice for a sibling group, the fused form compiled
graphs read -- and only the scale/zero table is made (kernels/int4_layout.py). Codes saved portable
(version 1 files, or a form the layout does not take) are laid out in one C++ pass from their mapped
pages, which are then unmapped again (file_pages.drop_pages: they stay in the page cache). int8 tables
are used in place: `save_quantized` writes every tensor whose size allows at a 64-byte-aligned offset
(torch's int8 kernel needs aligned weights); older files' unaligned ones are copied. What no kernel
reads -- an int4 module's portable scale and zero point -- stays in the file until something does. So
a load's peak memory is what the kernels read, once, and most of it only when first read.
A checkpoint is replaced by writing a new file and renaming it over the old one: a model loaded from
the old file keeps reading the old file's pages (the mapping holds its inode), so saving over the
folder a model was loaded from is safe. Modifying the file in place under a loaded model is not.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from .file_pages import copy_dropping_pages, drop_pages, file_mappings
from .handlers import build_module, replaced_type
from .modules import ALIGN, SAVED_LAYOUT, Int4Linear, QuantizedModule
from .quantizer import STATE_ATTR, _set_module, quantized_modules, share_cpu_forms
from .weight_layout import finalization_units, finalize_unit, sibling_groups


def register_with_transformers() -> None:
    """See hf_integration: imported here, on use, because it imports transformers."""
    from .hf_integration import register_with_transformers as register

    register()

logger = logging.getLogger("ffl_backend")

MANIFEST = "ffl_quant.json"
WEIGHTS = "model.safetensors"
FORMAT = "ffl_backend.quant"
# 1: every int4 module's codes portable (numerics.pack_int4). 2: some saved in fastflow's kernel layout,
# their specs saying so (`codes_layout`); a reader of version 1 refuses such a file instead of misreading it.
VERSION = 2
READS = (1, 2)


def save_quantized(model: nn.Module, directory) -> Path:
    """Write `model` (after `ffl_backend.quantize`) to `directory`; returns the folder."""
    modules = quantized_modules(model)
    if not modules:
        raise ValueError("save_quantized: the model has no quantized layers; call ffl_backend.quantize first")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, aliases = _dedup(model.state_dict())
    tied = _write_tied_tables(model, tensors, aliases)
    laid_out = _codes_in_kernel_layout(model, tensors)
    tensors = _siblings_adjacent(model, tensors, laid_out)
    specs = {name: {**m.spec(), **({"codes_layout": SAVED_LAYOUT} if name in laid_out else {})}
             for name, m in modules.items()}
    state = getattr(model, STATE_ATTR, {})
    manifest = {"format": FORMAT, "version": VERSION if laid_out else 1, "quant_config": state.get("config"),
                "kept": state.get("kept", {}), "dtype": str(_dtype(model)).removeprefix("torch."),
                "modules": specs, "aliases": aliases, "tied": tied, "num_tensors": len(tensors)}
    _write_weights(tensors, folder / WEIGHTS, metadata={"format": FORMAT, "num_tensors": str(len(tensors))})
    from .hf_integration import config_entry  # imports transformers: on use only

    register_with_transformers()
    config = copy.deepcopy(model.config)
    config.quantization_config = config_entry(model, tied, specs)  # what from_pretrained(folder) needs
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return folder


def _codes_in_kernel_layout(model: nn.Module, tensors: dict) -> set:
    """int4 linears whose CPU form is fastflow's layout save their codes in it (the same bytes, viewed
    as the portable (N, K/2)): a load maps them and the kernels read them where they are, with no
    layout to make and no memory of its own (`Int4Linear.codes_layout`). Returns their names."""
    laid_out = set()
    for name, m in quantized_modules(model).items():
        form = getattr(m, "cpu_packed", None)
        if isinstance(m, Int4Linear) and form is not None and form.dim() == 3 and form.device.type == "cpu":
            tensors[f"{name}.qweight"] = form.contiguous().view(m.out_features, m.in_features // 2)
            laid_out.add(name)
    return laid_out


def _siblings_adjacent(model: nn.Module, tensors: dict, laid_out: set) -> dict:
    """`tensors` reordered so that each sibling group's (q/k/v, gate/up) kernel-layout codes follow one
    another in the file: mapped back, they are consecutive slices of one mapping, the fused form the
    compiled graph reads (weight_layout.shared_base), and nothing is copied to fuse them."""
    names = {id(m): name for name, m in quantized_modules(model).items()}
    order = list(tensors)
    for members in sibling_groups(model, Int4Linear):
        group = [names[id(m)] for m in members]
        if not all(name in laid_out for name in group):
            continue
        keys = [f"{name}.qweight" for name in group]
        first = min(order.index(k) for k in keys)
        rest = [k for k in order if k not in keys]
        order = rest[:first] + keys + rest[first:]
    return {k: tensors[k] for k in order}


def _dtype(model: nn.Module) -> torch.dtype:
    """The compute dtype: that of the first floating-point parameter (embeddings stay high precision)."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _dedup(state_dict: dict) -> tuple[dict, dict]:
    """Safetensors refuses shared storage (tied embeddings): keep one name per tensor, alias the rest."""
    tensors, aliases, seen = {}, {}, {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = t.detach().contiguous()
    return tensors, aliases


def _quantized_buffer_names(model: nn.Module) -> set:
    """State-dict names of every saved buffer of the quantized modules."""
    return {f"{name}.{b}" for name, m in quantized_modules(model).items() for b, t in m._buffers.items()
            if t is not None and b not in m._non_persistent_buffers_set}


def _write_tied_tables(model: nn.Module, tensors: dict, aliases: dict) -> dict:
    """Quantized buffers shared by two modules (a tied int8 embedding and lm_head) are written under
    both names: `from_pretrained` knows nothing of our aliases and must find every buffer it loads.
    They are returned as {alias: target}, so `load_quantized` reads one copy and shares it."""
    names = _quantized_buffer_names(model)
    tied = {alias: target for alias, target in aliases.items() if alias in names and target in names}
    for alias, target in tied.items():
        del aliases[alias]
        tensors[alias] = tensors[target].clone()
    return tied


def _read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{folder} is not a saved quantized model: {MANIFEST} is missing "
                                "(save it with ffl_backend.quant.save_quantized)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is truncated or corrupt: {exc}") from exc
    if manifest.get("format") != FORMAT or manifest.get("version") not in READS:
        raise ValueError(f"{path}: unsupported format {manifest.get('format')!r} v{manifest.get('version')}")
    return manifest


# safetensors dtype names <-> torch dtypes, for the reader and writer below.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _write_weights(tensors: dict, path: Path, metadata: dict) -> None:
    """Write `tensors` as a safetensors file (the format: a little-endian u64 header size, a JSON
    header, the tensors' bytes back to back) with every tensor whose size is a multiple of 64 bytes
    at a 64-byte-aligned offset: the header is padded with spaces (as the format allows) to end on a
    64-byte boundary, those tensors come first, then the rest by element size, largest first (each
    then starts at a multiple of its element size, as safetensors' own writer arranges). Into a
    temporary file renamed over `path`: a model mapping the old file keeps its pages."""
    def order(item):  # aligned sizes first, in the order given; the rest by element size
        index, (name, t) = item
        unaligned = t.numel() * t.element_size() % ALIGN != 0
        return (unaligned, -t.element_size() if unaligned else 0, index)

    entries, offset = {}, 0
    ordered = [item for _, item in sorted(enumerate(tensors.items()), key=order)]
    for name, t in ordered:
        if t.dtype not in _NAMES:
            raise TypeError(f"save_quantized: {name} has dtype {t.dtype}, which this writer does not store")
        nbytes = t.numel() * t.element_size()
        entries[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % ALIGN)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(len(header).to_bytes(8, "little"))
            fh.write(header)
            for name, t in ordered:
                fh.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _read_weights(folder: Path, device, skip=()) -> dict:
    """model.safetensors' tensors as views of one private, read-only-in-practice memory mapping of the
    file (`torch.UntypedStorage.from_file`, MAP_PRIVATE): nothing is read until used, and pages read
    are the page cache's, not a copy (on another device: copied there). Views sit where the file puts
    them; `load_quantized` copies what a kernel needs aligned and is not (files of older versions)."""
    path = folder / WEIGHTS
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        try:
            if header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a {size}-byte file")
            header = json.loads(fh.read(header_len))
        except ValueError as exc:
            raise ValueError(f"{path} is truncated or corrupt ({exc}); save the model again") from exc
    header.pop("__metadata__", None)
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    tensors = {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        if name in skip:
            continue
        t = _tensor_view(storage, path, name, info, 8 + header_len, size)
        tensors[name] = t if torch.device(device).type == "cpu" else t.to(device)
    return tensors


def _tensor_view(storage, path: Path, name: str, info: dict, base: int, size: int) -> torch.Tensor:
    start, end = info["data_offsets"]
    if base + end > size or not 0 <= start <= end:
        raise ValueError(f"{path} is truncated or corrupt: {name} ends at byte {base + end} of {size}")
    if info["dtype"] not in _DTYPES:
        raise ValueError(f"{path}: {name} has unsupported dtype {info['dtype']}")
    dtype = _DTYPES[info["dtype"]]
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, base + start, (end - start,))
    if (base + start) % dtype.itemsize:  # not safetensors' own order: a private copy, element-aligned
        raw = raw.clone()
    return raw.view(dtype).reshape(info["shape"])


def _check_tensors(model: nn.Module, tensors: dict, folder: Path) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{k}: saved {tuple(tensors[k].shape)} {tensors[k].dtype}, expected {tuple(v.shape)} {v.dtype}"
             for k, v in expected.items()
             if k in tensors and (tensors[k].shape != v.shape or tensors[k].dtype != v.dtype)]
    if missing or unexpected or wrong:
        raise ValueError(f"{folder / WEIGHTS} does not match {MANIFEST} and config.json: "
                         f"missing {missing[:3]}, unexpected {unexpected[:3]}, mismatched {wrong[:3]}")


def load_quantized(directory, device="cpu") -> nn.Module:
    """Rebuild a model saved by `save_quantized`, quantized, in eval mode, on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(directory)
    manifest = _read_manifest(folder)
    register_with_transformers()
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, manifest["dtype"]))
    for name, spec in manifest["modules"].items():
        if not isinstance(_get(model, name, folder), replaced_type(spec)):
            raise ValueError(f"{MANIFEST} names {name}, which is not a {replaced_type(spec).__name__} of "
                             f"{type(model).__name__}")
        _set_module(model, name, build_module(spec, device="meta"))
    tied = manifest.get("tied", {})
    tensors = _read_weights(folder, device, skip=set(tied))
    links = {**manifest["aliases"], **tied}
    tensors.update({alias: tensors[target] for alias, target in links.items() if target in tensors})
    _check_tensors(model, tensors, folder)
    model.load_state_dict(tensors, strict=True, assign=True)
    del tensors
    _materialize_buffers(model, device)
    _finalize_from_mapping(model)
    share_cpu_forms(model)
    setattr(model, STATE_ATTR, {"config": manifest["quant_config"], "kept": manifest["kept"]})
    _load_generation_config(model, folder)
    return model.eval()


def _finalize_from_mapping(model: nn.Module) -> None:
    """Finalize every quantized module whose buffers are views of the file mapping: the buffers a
    kernel needs aligned and are not copied out block by block (never resident twice), the CPU forms
    made, then the pages that read unmapped from this process (they stay in the page cache), so at
    most one module's pages of the file are resident beside the forms at any time."""
    ranges = file_mappings()
    copies = {}  # id of a mapped tensor -> its aligned copy: a tied embedding and head keep one table
    for unit in finalization_units(model):  # sibling int4 linears: one CPU form, no copy into it later
        for m in unit:
            for name in m.unaligned_buffers():
                buf = m._buffers[name]
                if id(buf) not in copies:
                    copies[id(buf)] = copy_dropping_pages(buf, ranges)
                m._buffers[name] = copies[id(buf)]
        read = [b for m in unit for b in m._buffers.values() if b is not None]
        finalize_unit(unit)
        for b in read:
            drop_pages(b, ranges)


def _get(model: nn.Module, name: str, folder: Path) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError as exc:
        raise ValueError(f"{folder / MANIFEST} names {name}, absent from the model in config.json") from exc


@torch.no_grad()
def _materialize_buffers(model: nn.Module, device) -> None:
    """Non-persistent buffers (rotary inv_freq) are not saved: allocate and recompute them with the
    model's own initializer. Anything else left on meta is an error, not a silent garbage tensor."""
    for name, module in model.named_modules():
        if isinstance(module, QuantizedModule):
            continue
        if any(b is not None and b.is_meta for b in module.buffers(recurse=False)):
            module.to_empty(device=device, recurse=False)
            model._init_weights(module)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"load_quantized: tensors {left[:3]} were neither saved nor re-creatable")


def _load_generation_config(model: nn.Module, folder: Path) -> None:
    if (folder / "generation_config.json").exists():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
