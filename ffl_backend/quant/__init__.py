"""Quantization: configs, pure-torch primitives (the reference), quantized linear modules,
calibration and SmoothQuant, the per-layer error report, save and load.

    ffl_backend.quantize(model, "int8")                      # or a QuantConfig
    ffl_backend.quant.report(model, "int4", calibration_data)
    ffl_backend.quant.save_quantized(model, "out/"); ffl_backend.load_quantized("out/")

Names load their modules on first use: importing this package imports neither transformers nor triton.
"""
from importlib import import_module

__all__ = ["QuantConfig", "resolve", "quantize", "report", "save_quantized", "load_quantized",
           "quantized_modules"]

_LAZY = {
    "QuantConfig": "config",
    "resolve": "config",
    "quantize": "api",
    "quantized_modules": "api",
    "report": "layer_report",
    "save_quantized": "serialization",
    "load_quantized": "serialization",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ffl_backend.quant' has no attribute {name!r}")
