"""A prompt's bf16 / fp16 linears on CPUs without bf16 matrix instructions: fastflow's GEMM.

A model's nn.Linear layers call F.linear, and on such CPUs (AVX2 machines: AMD Zen 2/3, Intel before
Ice Lake) torch's bf16 GEMM is emulated, many times slower than `fastflow_cpu::gemm` (kernels/cpu_gemm.py;
docs/performance.md#decode-attention-packed-linears-and-prompts), which made a bf16 prompt the slowest
part of generating there. `install(model)` gives each plain bf16 / fp16 CPU `nn.Linear` of the model
the class `PromptLinear`, whose forward takes the GEMM for eager calls with enough rows (a prompt; the
threshold is searched per machine and shape) and F.linear otherwise. Traced calls (compiled decode
steps, `model.compile`) see plain F.linear, so graphs and the pattern families that match them are
unchanged. Per instance and reversible (`uninstall`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import progress
from .kernels import cpu_gemm

_KINDS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class PromptLinear(nn.Linear):
    """nn.Linear whose eager prompts on CPUs without native bf16 matmul run fastflow's GEMM."""

    # quantize() selects plain linears by exact type; this one is still one (quant/schemes.py)
    is_plain_linear = True

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if (not torch.compiler.is_compiling() and w.dtype in _KINDS and cpu_gemm.takes(x, w)
                and cpu_gemm.use_gemm(x, _KINDS[w.dtype], *w.shape)):
            return torch.ops.fastflow_cpu.gemm(x, w, None, self.bias)
        return F.linear(x, w, self.bias)


def applies_to_device(model) -> bool:
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cpu"


def applies(model) -> bool:
    """Whether `install` would change anything: a CPU model, a CPU without native bf16 matmul, and
    the C++ library built (cpu_gemm.replaces_bf16_matmul)."""
    return applies_to_device(model) and cpu_gemm.replaces_bf16_matmul()


def install(model) -> list:
    """Give the model's plain bf16 / fp16 linears `PromptLinear`; returns their names (for `uninstall`)."""
    if not applies(model):
        return []
    names = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and module.weight.dtype in _KINDS:
            module.__class__ = PromptLinear
            names.append(name)
    return names


def pretune(model) -> None:
    """Search, now rather than in the first prompt, the rows from which each linear shape of the model
    takes the GEMM (cached per machine: a no-op after the first time)."""
    from .kernels import quant_linear

    if not applies_to_device(model) or not cpu_gemm.available():
        return
    shapes = set()
    for module in model.modules():
        if type(module) is PromptLinear:
            shapes.add((_KINDS[module.weight.dtype], *module.weight.shape))
        elif getattr(module, "scheme", None) == "int8" and module.qweight.dim() == 2:
            shapes.add(("int8", *module.qweight.shape))
        elif getattr(module, "scheme", None) == "int4" and getattr(module, "cpu_packed", None) is not None \
                and module.cpu_packed.dim() == 3:
            shapes.add(("int4", module.out_features, module.in_features))
    # A search runs once per machine and shape; cached, the loop is instant and the delay shows nothing
    with progress.bar(len(shapes), "autotune prompt GEMM", "shape", delay=1.0) as bar:
        for kind, n, k in sorted(shapes):
            make = None if kind in ("bf16", "fp16") else quant_linear._gemm_paths(kind, n, k)
            cpu_gemm.prompt_gemm_min_rows(kind, n, k, make)
            bar.update(1)


def uninstall(model, names: list) -> None:
    modules = dict(model.named_modules())
    for name in names:
        if type(modules.get(name)) is PromptLinear:
            modules[name].__class__ = nn.Linear
