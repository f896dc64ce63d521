"""Quantization: configs, pure-torch primitives (the reference), quantized linear modules,
calibration and SmoothQuant, the per-layer error report, save and load.

    ffl_backend.quantize(model, "int8")                      # or a QuantConfig: QuantConfig("int4", group_size=32)
    ffl_backend.quant.report(model, "int4", calibration_data)
    ffl_backend.quant.save_quantized(model, "out/"); ffl_backend.load_quantized("out/")
    ffl_backend.quant.register_with_transformers(); AutoModelForCausalLM.from_pretrained("out/")
    ffl_backend.quant.register_scheme(MyConfig, MyHandler(MyLinear))  # a scheme of your own (docs/extending.md)

Names load their modules on first use: importing this package imports neither transformers nor triton.
"""
from .._lazy import lazy_getattr

__all__ = ["QuantConfig", "Int8Config", "Int4Config", "W8A8Config", "Fp8Config", "resolve", "quantize", "report",
           "save_quantized", "load_quantized", "quantized_modules", "register_with_transformers",
           "SchemeHandler", "register_scheme", "unregister_scheme"]

_LAZY = {
    "QuantConfig": "schemes",
    "Int8Config": "schemes",
    "Int4Config": "schemes",
    "W8A8Config": "schemes",
    "Fp8Config": "schemes",
    "resolve": "schemes",
    "SchemeHandler": "handlers",
    "register_scheme": "handlers",
    "unregister_scheme": "handlers",
    "quantize": "quantizer",
    "quantized_modules": "quantizer",
    "report": "layer_report",
    "save_quantized": "serialization",
    "load_quantized": "serialization",
    "register_with_transformers": "serialization",
}


__getattr__ = lazy_getattr(__name__, _LAZY)
