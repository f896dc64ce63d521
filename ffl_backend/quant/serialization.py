"""Save a quantized model and load it back quantized, without re-quantizing.

A saved folder holds `config.json` (the HF config, with a `quantization_config` that lets
`AutoModelForCausalLM.from_pretrained(folder)` load it quantized: quant/hf_integration.py),
`model.safetensors` (canonical quantized buffers and the high-precision rest) and `ffl_quant.json`
(the quant config and each quantized module's
spec). Loading builds the architecture on the meta device, swaps in empty quantized modules, and
assigns the saved tensors: the high-precision model is never materialized, so peak memory is the
quantized model's.
"""
from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
from torch import nn

from .handlers import build_module, replaced_type
from .modules import QuantizedModule
from .quantizer import STATE_ATTR, _set_module, quantized_modules, share_cpu_forms


def register_with_transformers() -> None:
    """See hf_integration: imported here, on use, because it imports transformers."""
    from .hf_integration import register_with_transformers as register

    register()

logger = logging.getLogger("ffl_backend")

MANIFEST = "ffl_quant.json"
WEIGHTS = "model.safetensors"
FORMAT = "ffl_backend.quant"
VERSION = 1


def save_quantized(model: nn.Module, directory) -> Path:
    """Write `model` (after `ffl_backend.quantize`) to `directory`; returns the folder."""
    from safetensors.torch import save_file

    modules = quantized_modules(model)
    if not modules:
        raise ValueError("save_quantized: the model has no quantized layers; call ffl_backend.quantize first")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, aliases = _dedup(model.state_dict())
    tied = _write_tied_tables(model, tensors, aliases)
    state = getattr(model, STATE_ATTR, {})
    manifest = {"format": FORMAT, "version": VERSION, "quant_config": state.get("config"),
                "kept": state.get("kept", {}), "dtype": str(_dtype(model)).removeprefix("torch."),
                "modules": {name: m.spec() for name, m in modules.items()}, "aliases": aliases,
                "tied": tied, "num_tensors": len(tensors)}
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": FORMAT, "num_tensors": str(len(tensors))})
    from .hf_integration import config_entry  # imports transformers: on use only

    register_with_transformers()
    config = copy.deepcopy(model.config)
    config.quantization_config = config_entry(model, tied)  # what from_pretrained(folder) needs
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return folder


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
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path}: unsupported format {manifest.get('format')!r} v{manifest.get('version')}")
    return manifest


# safetensors dtype names -> torch dtypes, for the reader below.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}


def _read_weights(folder: Path, device, skip=()) -> dict:
    """Read model.safetensors into fresh, aligned tensors, one plain read each.

    Not `safetensors.safe_open`: its tensors are views of a file mapping at unaligned offsets, which
    torch's int8 kernel cannot take (a segfault for M > 1), and aligning them means a second copy
    next to the mapped pages. This reads the (simple, documented) format straight into torch memory,
    so peak RSS is the quantized model plus one tensor's worth."""
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
        tensors = {}
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if name in skip:
                continue
            tensors[name] = _read_tensor(fh, path, name, info, 8 + header_len, size).to(device)
    return tensors


def _read_tensor(fh, path: Path, name: str, info: dict, base: int, size: int) -> torch.Tensor:
    start, end = info["data_offsets"]
    if base + end > size:
        raise ValueError(f"{path} is truncated or corrupt: {name} ends at byte {base + end} of {size}")
    if info["dtype"] not in _DTYPES:
        raise ValueError(f"{path}: {name} has unsupported dtype {info['dtype']}")
    buf = torch.empty(end - start, dtype=torch.uint8)
    fh.seek(base + start)
    if fh.readinto(memoryview(buf.numpy())) != end - start:
        raise ValueError(f"{path} is truncated or corrupt: short read of {name}")
    return buf.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


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
    _materialize_buffers(model, device)
    for m in quantized_modules(model).values():
        m.finalize()
    share_cpu_forms(model)
    setattr(model, STATE_ATTR, {"config": manifest["quant_config"], "kept": manifest["kept"]})
    _load_generation_config(model, folder)
    return model.eval()


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
