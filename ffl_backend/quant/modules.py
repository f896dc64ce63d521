"""Quantized replacements for nn.Linear. Each forward is exactly one `torch.ops.fastflow.*` call, so
a compiled graph holds one opaque-to-Dynamo, visible-to-Inductor op per linear.

Persistent buffers are the canonical layouts (numerics.py) and are what gets saved.
Non-persistent `cpu_*` buffers hold what torch's CPU kernels want instead (a bf16 scale, torch's
own int4 packing); `finalize()` derives them once, after quantizing or loading, never per step.
On CPU an int4 module keeps its codes only in torch's packing where they can be read back from it
exactly: its `qweight` is then a stand-in (`is_stand_in`), and `state_dict()` still saves the codes.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from .. import numerics as P
from ..kernels import cpu_quantize as Q
from ..kernels import quant_linear as K
from .file_pages import by_row_blocks
from .int4_fit import quantize_int4_fitted
from .schemes import QuantConfig

ALIGN = 64  # bytes: a cache line, and what torch's CPU allocator gives
SAVED_LAYOUT = "int4_gemv"  # Int4Linear.codes_layout of codes saved in fastflow's kernel layout


class QuantizedModule(nn.Module):
    """What save/load and finalize need of any quantized module: `scheme`, `spec()`, `finalize()`."""

    scheme = ""

    def spec(self) -> dict:
        raise NotImplementedError

    def form(self) -> str:
        """What the CLIs count this module as, in their layers-per-form summaries."""
        return self.scheme

    # Buffers no kernel reads in place on CPU (they are read through a CPU form made from them, or by
    # torch ops that take any address): left where they are, even in a file mapping at an odd offset.
    any_address: tuple = ()

    def finalize(self) -> "QuantizedModule":
        """Align the buffers and derive the non-persistent CPU forms from the canonical ones.

        Buffers assigned from a file mapping (safetensors' safe_open, torch.load(mmap=True)) sit at
        arbitrary offsets; `torch._weight_int8pack_mm` (torch 2.13) segfaults on an unaligned weight
        for M > 1. `load_quantized` maps files it wrote at aligned offsets and copies what is not;
        this guards every other route."""
        for name in self.unaligned_buffers():
            self._buffers[name] = self._buffers[name].clone()
        return self

    def unaligned_buffers(self) -> list:
        """Names of the CPU buffers a kernel needs aligned that are not."""
        return [name for name, buf in self._buffers.items() if buf is not None and buf.device.type == "cpu"
                and name not in self.any_address and buf.data_ptr() % ALIGN]


class QuantizedLinear(QuantizedModule):
    """Common shape bookkeeping; subclasses define `scheme`, their buffers and `forward`."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, has_bias: bool, device=None):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if has_bias else None)

    def spec(self) -> dict:
        """Everything `build_module` needs to recreate this module empty (saved in the manifest)."""
        return {"scheme": self.scheme, "in_features": self.in_features, "out_features": self.out_features,
                "dtype": str(self.dtype).removeprefix("torch."), "has_bias": self.bias is not None}

    def dequantized_weight(self) -> Tensor:
        """The (N, K) weight this module multiplies by, in fp32 (for error reports)."""
        raise NotImplementedError

    def _set_bias(self, linear: nn.Linear) -> None:
        if linear.bias is not None:
            self.bias = linear.bias.detach().clone()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, "
                f"bias={self.bias is not None}")


class Int8Linear(QuantizedLinear):
    scheme = "int8"

    def __init__(self, in_features, out_features, dtype, has_bias, device=None):
        super().__init__(in_features, out_features, dtype, has_bias, device)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.empty(out_features, dtype=dtype, device=device))
        self.register_buffer("cpu_scale", None, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantConfig, quantized=None) -> "Int8Linear":
        """quantized: precomputed (q int8 (N, K), scale (N,)), e.g. from GPTQ; default round-to-nearest."""
        w = linear.weight.detach()
        m = cls(linear.in_features, linear.out_features, w.dtype, linear.bias is not None, "meta")
        m.qweight, m.scale = quantized if quantized is not None else by_row_blocks(Q.quantize_int8, w)
        m._set_bias(linear)
        return m.finalize()

    def finalize(self):
        super().finalize()
        needs_copy = self.scale.device.type == "cpu" and self.scale.dtype != torch.bfloat16
        self.cpu_scale = self.scale.to(torch.bfloat16) if needs_copy else None
        return self

    def dequantized_weight(self):
        return P.dequantize_int8(self.qweight, self.scale)

    def forward(self, x: Tensor) -> Tensor:
        if K.calls_cpu_body(x):
            return K.int8_linear_cpu(x, self.qweight, self.scale, self.bias, self.cpu_scale)
        return torch.ops.fastflow.int8_linear(x, self.qweight, self.scale, self.bias, self.cpu_scale)


class Int4Linear(QuantizedLinear):
    scheme = "int4"
    any_address = ("qweight", "scale", "zero")  # the kernels read cpu_packed / cpu_scale_zeros, made here

    def __init__(self, in_features, out_features, dtype, has_bias, device=None, group_size=128,
                 codes_layout="portable"):
        """codes_layout: how the codes about to be loaded into `qweight` are laid out: "portable"
        (numerics.pack_int4), or SAVED_LAYOUT (fastflow's kernel layout, (N/16, K/8, 64) bytes viewed as
        (N, K/2): a checkpoint saved so). `finalize()` reads it once; the module then holds its codes
        as any other."""
        super().__init__(in_features, out_features, dtype, has_bias, device)
        if codes_layout not in ("portable", SAVED_LAYOUT):
            raise ValueError(f"int4 codes_layout {codes_layout!r}: 'portable' or {SAVED_LAYOUT!r}")
        self.group_size, self.codes_layout = group_size, codes_layout
        groups = in_features // group_size
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scale", torch.empty(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("zero", torch.empty(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("cpu_packed", None, persistent=False)
        self.register_buffer("cpu_scale_zeros", None, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantConfig, quantized=None,
                    importance: Tensor | None = None) -> "Int4Linear":
        """quantized: precomputed (codes uint8 (N, K) in 0..15, scale, zero (N, K//G)) on the group
        size `config` gives this layer, e.g. from GPTQ; default round-to-nearest on the grid
        `config.grid` names. importance: (K,) mean square of each input channel on calibration data."""
        w = linear.weight.detach()
        group = config.group_for(linear.in_features)
        m = cls(linear.in_features, linear.out_features, w.dtype, linear.bias is not None, "meta", group)
        if quantized is not None:
            q, m.scale, m.zero = quantized
            m.qweight = P.pack_int4(q)
        elif config.fits_grid:  # packed by the quantizer, in the same pass
            m.qweight, m.scale, m.zero = by_row_blocks(quantize_int4_fitted, w, group, config.is_symmetric,
                                                       importance=importance, packed=True)
        else:
            m.qweight, m.scale, m.zero = by_row_blocks(Q.quantize_int4, w, group, config.is_symmetric, packed=True)
        if m.scale.shape != (linear.out_features, linear.in_features // group):
            raise ValueError(f"int4 scale shape {tuple(m.scale.shape)} does not match group size {group}")
        m._set_bias(linear)
        return m.finalize()

    def finalize(self):
        Int4Linear.finalize_siblings([self])
        return self

    def _start_finalize(self):
        """Real codes in `qweight`, buffers aligned where a kernel needs it; returns the codes as saved
        in fastflow's layout ((N/16, K/8, 64), a view of `qweight`) when they came so, else None."""
        if is_stand_in(self.qweight):  # finalized before: start again from the real codes
            self.qweight = self.portable_qweight()
        super().finalize()
        if self.codes_layout != SAVED_LAYOUT:
            return None
        self.codes_layout = "portable"  # read once: from here on `qweight` is what it says, or a stand-in
        rows, chunk = K.int4_layout.INT4_ROWS, K.int4_layout.INT4_CHUNK
        return self.qweight.reshape(self.out_features // rows, self.in_features // chunk, 4 * rows)

    @staticmethod
    def finalize_siblings(members: list) -> None:
        """Finalize int4 linears -- one alone, or siblings (one input: q/k/v, gate/up; one in_features
        and group size) -- with one CPU form for all: the layout of their row concatenation, made in one
        pass, each member's form a slice of it (what `weight_layout.share_sibling_packs` would otherwise
        copy their separate forms into: a loaded checkpoint's largest copy). Codes saved in that layout
        (`codes_layout`) are the form themselves: only the scale/zero table is made. Where the layout
        does not take every member, each gets its own form (`int4_cpu_form`: torch's pack, or none)."""
        saved = [m._start_finalize() for m in members]
        group = members[0].group_size
        scales, zeros = [m.scale for m in members], [m.zero for m in members]
        if all(s is not None and K.int4_layout_applies(m.qweight, group) for s, m in zip(saved, members)):
            # a mapped checkpoint's codes: used where they are (the writer puts them at 64-byte offsets)
            packs = [s if s.data_ptr() % ALIGN == 0 else s.clone() for s in saved]
            table = K.int4_layout.int4_layout_tables(scales, zeros, group)
            forms = zip(packs, _row_blocks(table, members))
        else:
            for m, s in zip(members, saved):
                if s is not None:  # saved in the layout, but its form here is another: portable codes
                    m.qweight = K.int4_layout.portable_codes(s)
            fused = K.int4_cpu_form_fused([m.qweight for m in members], scales, zeros, group)
            forms = (zip(*(_row_blocks(t, members) for t in fused)) if fused is not None
                     else (K.int4_cpu_form(m.qweight, m.scale, m.zero, group) for m in members))
        for m, s, (packed, table) in zip(members, saved, forms):
            m.cpu_packed, m.cpu_scale_zeros = packed, table
            if s is not None and packed is not None and packed.dim() == 3:
                m.qweight = _stand_in(m)  # the form is the saved codes: nothing to check
            else:
                m._keep_codes_in_pack()

    def _keep_codes_in_pack(self) -> None:
        """Keep one copy of the codes on CPU. The CPU kernels read only their own form (fastflow's
        layout or torch's pack), so where unpacking it gives back exactly `qweight`, `qweight` becomes
        a stand-in of its shape (stride 0, one byte) and `portable_qweight()` rebuilds the codes for
        saving, reports and moves to another device. Halves an int4 model's CPU memory.

        How "exactly" is known: fastflow's layout is made by `int4_layout_pack`, a fixed permutation of
        nibbles whose round trip its tests prove byte for byte against the pure-torch layout, on every
        -march level (tests/kernels/test_cpu_int4_gemv.py); here its first and last block of 16 rows
        are read back, which catches a form that is not this weight's at no cost (reading all of it
        back cost as much as making it). torch's pack (where fastflow's kernel is not built) differs
        between CPUs and is recognised by a probe (`torch_pack_block_rows`): read back whole."""
        if self.cpu_packed is None:
            return
        n, k = self.out_features, self.in_features
        if self.cpu_packed.dim() == 3:
            rows = K.int4_layout.INT4_ROWS
            # compared in numpy: torch.equal starts a parallel region, ~5 ms beside a busy process
            same = all(np.array_equal(K.int4_cpu_codes(self.cpu_packed[b], rows, k).numpy(), self.qweight[r].numpy())
                       for b, r in ((slice(0, 1), slice(0, rows)), (slice(-1, None), slice(n - rows, n))))
        else:
            rebuilt = K.int4_cpu_codes(self.cpu_packed, n, k)
            same = rebuilt is not None and torch.equal(rebuilt, self.qweight)
        if same:
            self.qweight = _stand_in(self)

    def portable_qweight(self) -> Tensor:
        """The (N, K/2) codes in the portable layout (numerics.py), wherever they are kept."""
        if is_stand_in(self.qweight):
            return K.int4_cpu_codes(self.cpu_packed, self.out_features, self.in_features)
        return self.qweight

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if is_stand_in(self.qweight):
            destination[prefix + "qweight"] = self.portable_qweight()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if is_stand_in(self.qweight):  # a stand-in cannot be copied into: give it its own storage
            self.qweight = torch.empty(self.qweight.shape, dtype=torch.uint8)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse=True):
        """Moves and casts see the real codes; back on CPU, one copy is kept again."""
        held = is_stand_in(self.qweight)
        if held:
            self.qweight = self.portable_qweight()
        super()._apply(fn, recurse)
        if held and self.qweight.device.type == "cpu" and self.cpu_packed is not None:
            self._keep_codes_in_pack()
        return self

    def spec(self):
        return {**super().spec(), "group_size": self.group_size}

    def dequantized_weight(self):
        return P.dequantize_int4(self.portable_qweight(), self.scale, self.zero, self.group_size)

    def forward(self, x: Tensor) -> Tensor:
        args = (x, self.qweight, self.scale, self.zero, self.group_size, self.bias, self.cpu_packed,
                self.cpu_scale_zeros)
        if K.calls_cpu_body(x):
            return K.int4_linear_cpu(*args)
        return torch.ops.fastflow.int4_linear(*args)


def _stand_in(m: Int4Linear) -> Tensor:
    return torch.zeros((), dtype=torch.uint8).expand(m.out_features, m.in_features // 2)


def _row_blocks(t: Tensor, members: list) -> list:
    """Each member's slice of a fused form (dim 0 in blocks of 16 rows)."""
    parts, first = [], 0
    for m in members:
        blocks = m.out_features // K.int4_layout.INT4_ROWS
        parts.append(t[first:first + blocks])
        first += blocks
    return parts


def is_stand_in(t) -> bool:
    """Whether an int4 `qweight` is the stride-0 stand-in of codes kept only in a CPU kernel's form."""
    return isinstance(t, Tensor) and t.dim() == 2 and t.numel() > 1 and t.stride() == (0, 0)


class W8A8Linear(QuantizedLinear):
    """`x_scale` (static, per tensor) and `smooth` (SmoothQuant 1/s not foldable into a norm) are
    present only when the config asked for them."""

    scheme = "w8a8"

    def __init__(self, in_features, out_features, dtype, has_bias, device=None, static=False, smooth=False):
        super().__init__(in_features, out_features, dtype, has_bias, device)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("w_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.register_buffer("x_scale", torch.empty((), dtype=torch.float32, device=device) if static else None)
        self.register_buffer("smooth", torch.empty(in_features, dtype=torch.float32, device=device) if smooth else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantConfig, x_absmax: float | None = None,
                    smooth: Tensor | None = None) -> "W8A8Linear":
        """`linear.weight` must already carry the smoothing factors; `x_absmax` is the calibrated
        range of the (smoothed) input for a static scale (None: per-token scales at run time)."""
        w = linear.weight.detach()
        m = cls(linear.in_features, linear.out_features, w.dtype, linear.bias is not None, "meta",
                x_absmax is not None, smooth is not None)
        m.qweight, m.w_scale = Q.quantize_int8(w, torch.float32)
        if x_absmax is not None:
            m.x_scale = torch.tensor(max(float(x_absmax), P.SCALE_EPS) / P.INT8_MAX, device=w.device)
        if smooth is not None:
            m.smooth = smooth.float().to(w.device)
        m._set_bias(linear)
        return m

    def spec(self):
        return {**super().spec(), "static": self.x_scale is not None, "smooth": self.smooth is not None}

    def form(self):
        return "w8a8 static" if self.x_scale is not None else "w8a8 dynamic"

    def dequantized_weight(self):
        """Of the smoothed weight when the module smooths its own input (W * s)."""
        return P.dequantize_int8(self.qweight, self.w_scale)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.fastflow.w8a8_linear(x, self.qweight, self.w_scale, self.x_scale, self.bias, self.smooth)


class Fp8Linear(QuantizedLinear):
    scheme = "fp8"

    def __init__(self, in_features, out_features, dtype, has_bias, device=None):
        super().__init__(in_features, out_features, dtype, has_bias, device)
        self.register_buffer("qweight",
                             torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("w_scale", torch.empty(out_features, dtype=torch.float32, device=device))

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantConfig) -> "Fp8Linear":
        w = linear.weight.detach()
        m = cls(linear.in_features, linear.out_features, w.dtype, linear.bias is not None, "meta")
        m.qweight, m.w_scale = P.quantize_fp8(w)
        m._set_bias(linear)
        return m

    def dequantized_weight(self):
        return P.dequantize_fp8(self.qweight, self.w_scale)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.fastflow.fp8_linear(x, self.qweight, self.w_scale, self.bias)


class Int8Embedding(QuantizedModule):
    """nn.Embedding over int8 rows with one scale per row: exactly the layout of an int8 lm_head
    (one scale per output channel = per vocabulary row), so a tied head and embedding share one
    int8 table (`Int8Embedding.tied_to(head)`)."""

    scheme = "int8_embedding"

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.register_buffer("qweight", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.empty(num_embeddings, dtype=dtype, device=device))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> "Int8Embedding":
        w = embedding.weight.detach()
        m = cls(w.shape[0], w.shape[1], w.dtype, "meta")
        m.qweight, m.scale = by_row_blocks(Q.quantize_int8, w)
        return m.finalize()

    @classmethod
    def tied_to(cls, head: Int8Linear) -> "Int8Embedding":
        """An embedding reading `head`'s own buffers (no copy): for tied input/output embeddings."""
        m = cls(head.out_features, head.in_features, head.dtype, "meta")
        m.qweight, m.scale = head.qweight, head.scale
        return m

    def spec(self) -> dict:
        return {"scheme": self.scheme, "num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim,
                "dtype": str(self.dtype).removeprefix("torch.")}

    def dequantized_weight(self) -> Tensor:
        return P.dequantize_int8(self.qweight, self.scale)

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        rows = P.dequantize_int8(self.qweight[flat], self.scale[flat], self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}"


def pretune_linears(model: nn.Module, rows: int) -> int:
    """Run every quantized linear of `model` that sits on a GPU once, eagerly, on `rows` random rows:
    the Triton kernels' tile search (kernels/triton_tuning.py) then has its choice for that shape
    cached before torch.compile bakes a config into a graph. Returns how many ran (0 on CPU)."""
    ran = 0
    with torch.inference_mode():
        for module in model.modules():
            buffer = next(module.buffers(recurse=False), None) if isinstance(module, QuantizedLinear) else None
            if buffer is not None and buffer.device.type == "cuda":
                module(torch.randn(rows, module.in_features, dtype=module.dtype, device=buffer.device))
                ran += 1
    return ran
