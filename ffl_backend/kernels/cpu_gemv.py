"""`torch.ops.fastflow_cpu.gemv` and `int4_gemv`: hand-written CPU GEMVs for decode steps, built on first use.

    gemv(x, [w_1..w_n], [s_1..s_n] or [], [b_1..b_n] or []) = cat([(x @ w_i.T) * s_i + b_i for each i], -1)
    int4_gemv(x, packed, scale_zeros, bias or None, G) = x @ W.T + bias, W group-wise int4

`int4_gemv` reads its own layout (`int4_layout`: 16 rows to a vector, torch's CPU int4 grid
w = (q - 8) * s + z') with AVX512-VNNI (on AVX2-only CPUs: vpmaddubsw + vpmaddwd), x read as int16
per group; cpu_gemv.cpp says why. Int4 modules hold their CPU weights in that layout and call it for
every row count (kernels/quant_linear.py `int4_cpu_form`).

`gemv` multiplies one row x. Its weights are int8 (weight-only quantized, `s_i` per output channel) or bf16, all
of one dtype and width; products and sums in fp32, one rounding to x's dtype. Siblings that read the
same x (q/k/v, gate/up) go in one call: one parallel loop streams all their rows. The decode_gemv pattern family calls it for single-row linears when
it is available (option `cpu_gemv`), instead of letting Inductor generate the loop: on SmolLM2-135M's
weights it streams ~2x faster, because it prefetches ahead (cpu_gemv.cpp says why).

The C++ source ships with the package and is compiled here, once per machine and source version,
with the compiler and flags Inductor itself uses (g++ or $CXX, -O3 -march=native -fopenmp -std=c++20;
FFL_CPU_MARCH replaces `native`), into
FFL_CACHE_DIR (default ~/.cache/ffl_backend)/cpu_kernels/. That takes ~5-10 s the first time. Where
it cannot be built (no compiler, no torch headers, not x86/Linux) `load()` returns False once with a
logged warning and callers keep Inductor's loop, which is correct, only slower.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import paths

logger = logging.getLogger(__name__)

# One library, fastflow_cpu: the GEMVs, decode attention (cpu_attention.cpp, the reference is
# attention/reference.py) and the greedy token's argmax (cpu_argmax.cpp); cpu_kernels.h is what the
# sources share.
SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_gemv.cpp", "cpu_attention.cpp", "cpu_argmax.cpp"))
HEADERS = (Path(__file__).with_name("cpu_kernels.h"),)
OP_NAMESPACE = "fastflow_cpu"
WEIGHT_DTYPES = (torch.int8, torch.bfloat16)
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_state: dict = {}  # "loaded": bool, "error": str


def gemv_ref(x: Tensor, weights: Sequence[Tensor], scales: Sequence[Tensor] = (),
             biases: Sequence[Tensor] = ()) -> Tensor:
    """Pure-torch reference of the op: fp32 products and sums, one rounding to x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)  # float64 inputs: an exact reference
    outs = []
    for i, w in enumerate(weights):
        y = x.to(acc) @ w.to(acc).T
        if scales:
            y = y * scales[i].to(acc)
        if biases:
            y = y + biases[i].to(acc)
        outs.append(y.to(x.dtype))
    return torch.cat(outs, -1)


def takes(x, weight, *vectors) -> bool:
    """Whether the op accepts these operands (real or fake tensors; None vectors are absent): one row
    of a supported dtype, a contiguous (N, K) int8/bf16 weight, floating (N,) scale/bias vectors, and
    no gradient to compute -- the op has no backward. The one definition both callers use."""
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor) or x.dim() < 1:
        return False
    if x.dtype not in ACTIVATION_DTYPES or x.numel() != x.shape[-1]:
        return False
    if weight.dtype not in WEIGHT_DTYPES or weight.dim() != 2 or not weight.is_contiguous():
        return False
    vectors = [v for v in vectors if v is not None]
    if any(not isinstance(v, Tensor) or tuple(v.shape) != (weight.shape[0],) or not v.is_floating_point()
           for v in vectors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, *vectors)))


# int4_gemv's layout (cpu_gemv.cpp): rows in blocks of 16 (the lanes of one vector), K in chunks of 8
INT4_ROWS, INT4_CHUNK = 16, 8


def int4_layout_fits(n: int, k: int, group_size: int) -> bool:
    """Whether an (n, k) int4 matrix with this group size has an `int4_gemv` layout."""
    return n % INT4_ROWS == 0 and group_size % INT4_CHUNK == 0 and k % group_size == 0 and n > 0


def int4_layout(codes: Tensor, scale_zeros: Tensor, group_size: int) -> tuple:
    """(packed, scale_zeros) for `int4_gemv` from (N, K) codes 0..15 and torch's CPU int4 scale/zero
    table ((K/G, N, 2) bf16, w = (q - 8) * s + z'): the same values, laid out 16 rows to a vector."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).reshape(n // INT4_ROWS, INT4_ROWS, k // INT4_CHUNK, 2, INT4_CHUNK // 2)
    packed = (blocks[:, :, :, 0] | (blocks[:, :, :, 1] << 4)).permute(0, 2, 1, 3)
    groups = scale_zeros.reshape(k // group_size, n // INT4_ROWS, INT4_ROWS, 2).permute(1, 0, 3, 2)
    return (packed.reshape(n // INT4_ROWS, k // INT4_CHUNK, 4 * INT4_ROWS).contiguous(),
            groups.to(torch.bfloat16).contiguous())


def int4_layout_codes(packed: Tensor) -> Tensor:
    """The (N, K) codes of an `int4_gemv` packed tensor (the inverse of `int4_layout`'s first half)."""
    nb, chunks, _ = packed.shape
    b = packed.reshape(nb, chunks, INT4_ROWS, INT4_CHUNK // 2).permute(0, 2, 1, 3)
    return torch.stack([b & 0xF, b >> 4], dim=3).reshape(nb * INT4_ROWS, chunks * INT4_CHUNK)


def int4_gemv_ref(x: Tensor, packed: Tensor, scale_zeros: Tensor, bias: Optional[Tensor], group_size: int) -> Tensor:
    """Pure-torch reference of `int4_gemv`: the dequantized weight (q - 8) * s + z' in fp32, x @ w.T
    (+ bias) in fp32, x's dtype out. (The kernel reads x as int16 per group: relative error ~1e-5.)"""
    codes = int4_layout_codes(packed).float()
    sz = scale_zeros.float().permute(0, 3, 1, 2).reshape(codes.shape[0], -1, 2)  # (N, K/G, 2)
    s, zp = (sz[..., i].repeat_interleave(group_size, dim=1) for i in (0, 1))
    acc = torch.promote_types(x.dtype, torch.float32)
    y = x.to(acc) @ ((codes - 8) * s + zp).to(acc).T
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def _cache_dir() -> Path:
    return paths.cache_dir() / "cpu_kernels"


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def target_arch() -> str:
    """The -march the library is built for: this CPU unless FFL_CPU_MARCH names another (e.g.
    x86-64-v3 for the AVX2 path on an AVX-512 machine, x86-64 for the portable one; tests use it)."""
    return os.environ.get("FFL_CPU_MARCH", "native")


def _compile_command(out: Path) -> list:
    # torch's own headers and libraries (what torch.utils.cpp_extension would find, without importing it)
    root = Path(torch.__file__).parent
    includes = (root / "include", root / "include" / "torch" / "csrc" / "api" / "include")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [_compiler(), "-O3", f"-march={target_arch()}", "-fopenmp", "-shared", "-fPIC", "-std=c++20",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{p}" for p in includes], *map(str, SOURCES), "-o", str(out),
            f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path() -> Path:
    """Where the built library for this source, torch, compile command and CPU lives."""
    key = hashlib.sha256()
    flags = " ".join(_compile_command(Path("out.so")))
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS), torch.__version__.encode(), flags.encode(), _cpu_flags().encode(),
                 sys.version.encode()):
        key.update(part)
    return _cache_dir() / f"cpu_gemv_{key.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: a concurrent process never loads a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        logger.info("fastflow: compiling the CPU GEMV kernel (once per machine, ~5-10 s) into %s", target)
        result = subprocess.run(_compile_command(Path(tmp)), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiler failed ({result.returncode}): {result.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> bool:
    """Build (if needed) and load the kernel; True when `torch.ops.fastflow_cpu.gemv` is usable."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _try_load()
        return _state["loaded"]


def _try_load() -> bool:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        _state["error"] = f"not built on {sys.platform}/{platform.machine()} (x86-64 Linux only)"
        logger.info("fastflow: CPU GEMV kernel %s; decode GEMVs stay Inductor loops", _state["error"])
        return False
    try:
        target = library_path()
        if not target.exists():
            _build(target)
        torch.ops.load_library(str(target))
        torch.library.register_fake(f"{OP_NAMESPACE}::gemv")(_fake_gemv)
        torch.library.register_fake(f"{OP_NAMESPACE}::int4_gemv")(_fake_int4_gemv)
        torch.library.register_fake(f"{OP_NAMESPACE}::decode_attention")(_fake_decode_attention)
        torch.library.register_fake(f"{OP_NAMESPACE}::argmax")(_fake_argmax)
        return True
    except Exception as exc:  # no compiler, no headers, a link error: keep the (correct) Inductor loop
        _state["error"] = str(exc)
        logger.warning("fastflow: CPU GEMV kernel unavailable (%s); decode GEMVs stay Inductor loops", exc)
        return False


def load_error() -> Optional[str]:
    """Why `load()` returned False (None if it did not, or was not called)."""
    return _state.get("error")


def _fake_gemv(x: Tensor, weights, scales, biases) -> Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def _fake_int4_gemv(x: Tensor, packed, scale_zeros, bias, group_size: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0] * INT4_ROWS))


def _fake_decode_attention(q: Tensor, k_cache, v_cache, filled, scale, window, mask) -> Tensor:
    # (B, Lq, Hq, D) memory seen as (B, Hq, Lq, D), as the kernel returns it
    b, hq, lq, d = q.shape
    return q.new_empty((b, lq, hq, d)).transpose(1, 2)


def _fake_argmax(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[:-1], dtype=torch.long)


@contextlib.contextmanager
def null_kernels():
    """Within this block the library's kernels return zeros without computing (a benchmark of what
    a decode step costs outside them: benchmarks/decode_overhead.py). Needs `load()`."""
    previous = torch.ops.fastflow_cpu.set_null_kernels(True)
    try:
        yield
    finally:
        torch.ops.fastflow_cpu.set_null_kernels(previous)
