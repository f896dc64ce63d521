"""Ahead-of-time compile of every Triton kernel launch config to cubins, with no GPU present.

Run as `python -m ffl_backend.kernels.aot --arch 80 90 [--json out.json]`. It must run in a process
without TRITON_INTERPRET: the interpreter swaps `triton.jit` for an interpreted function that cannot
be lowered. The compile catches what the interpreter forgives: illegal block shapes, tl.dot sizes
under 16, dtype mismatches, register and shared-memory blow-ups.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import import_module

from . import triton_modules

# Hopper allows 227 KiB of shared memory per block, Ampere (A100) 163 KiB.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


def compile_spec(spec, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=spec.kernel, signature=spec.signature, constexprs=spec.constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": spec.num_warps})
    shared = compiled.metadata.shared
    return {"name": spec.name, "arch": arch, "cubin_bytes": len(compiled.asm["cubin"]),
            "shared": shared, "num_warps": compiled.metadata.num_warps,
            "ok": shared <= SHARED_LIMIT[arch], "wgmma": "wgmma" in compiled.asm["ptx"]}


def collect_specs(modules=None):
    specs = []
    modules = triton_modules() if modules is None else modules
    for name in modules:
        specs.extend(import_module(name).aot_specs())
    return specs


def _compile_job(job) -> dict:
    """Compile spec `index` of `module` for `arch` (worker-side: specs are rebuilt, not pickled)."""
    module, index, arch = job
    spec = import_module(module).aot_specs()[index]
    try:
        return compile_spec(spec, arch)
    except Exception as exc:  # report every failing config, not just the first
        return {"name": spec.name, "arch": arch, "ok": False, "error": f"{type(exc).__name__}: {exc}"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--module", nargs="*", help="op modules (default: every one with Triton kernels)")
    parser.add_argument("--json", help="write one record per compiled config here")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    jobs = [(module, i, arch) for module in (args.module or triton_modules())
            for i, spec in enumerate(import_module(module).aot_specs())
            for arch in args.arch if arch >= spec.min_arch]
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs) as pool:
            records = list(pool.map(_compile_job, jobs, chunksize=8))
    else:
        records = [_compile_job(job) for job in jobs]
    failures = [rec for rec in records if not rec["ok"]]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
    print(f"aot: {len(records) - len(failures)} compiled, {len(failures)} failed")
    for rec in failures:
        print("FAILED", rec, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
