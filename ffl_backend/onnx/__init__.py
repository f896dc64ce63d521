"""ONNX export: fastflow's (optionally quantized) model as one ONNX Runtime decoder with KV-cache I/O
(docs/onnx.md). `export_onnx` writes the folder; `OnnxCausalLM` runs it in plain ONNX Runtime."""
from .._lazy import lazy_getattr

__all__ = ["export_onnx", "check_export", "OnnxCausalLM"]

__getattr__ = lazy_getattr(__name__, {"export_onnx": "export", "check_export": "check",
                                      "OnnxCausalLM": "runtime"})
