"""ffl_backend ("fastflow"): make Hugging Face causal LMs generate faster with the code users have.

`import ffl_backend` is cheap and side-effect free: no transformers import, no Inductor setting
changed, no op registered. The backend itself is found by `torch.compile(..., backend="fastflow")`
through an entry point; the names below load their modules on first use.
"""
from ._lazy import lazy_getattr

__version__ = "0.1.0"

__all__ = [
    "fastflow",
    "BackendOptions",
    "PATTERN_FAMILIES",
    "pattern_families",
    "register_op",
    "register_pattern",
    "unregister_pattern",
    "PatternMatch",
    "GraphReport",
    "fusion_reports",
    "last_report",
    "clear_reports",
    "recompiles",
    "load_gemma3",
    "load_smollm2",
    "gemma3_path",
    "smollm2_path",
    "optimize",
    "restore",
    "kv_cache_bytes",
    "quantize",
    "load_quantized",
    "QuantConfig",
    "OptimizedInferenceEngine",
    "export_onnx",
]

_LAZY = {
    "fastflow": "backend",
    "BackendOptions": "config",
    "PATTERN_FAMILIES": "patterns.registry",
    "pattern_families": "patterns.registry",
    "register_op": "kernels.user_ops",
    "register_pattern": "patterns.extension",
    "unregister_pattern": "patterns.extension",
    "PatternMatch": "patterns.extension",
    "GraphReport": "report",
    "fusion_reports": "report",
    "last_report": "report",
    "clear_reports": "report",
    "recompiles": "report",
    "load_gemma3": "models",
    "load_smollm2": "models",
    "gemma3_path": "models",
    "smollm2_path": "models",
    "optimize": "api",
    "restore": "api",
    "kv_cache_bytes": "api",
    "quantize": "quant.quantizer",
    "load_quantized": "quant.serialization",
    "QuantConfig": "quant.schemes",
    "OptimizedInferenceEngine": "engine.engine",
    "export_onnx": "onnx.export",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


def __dir__():
    return sorted(list(globals()) + __all__)
