"""The `fastflow` torch.compile backend.

Found by name through the `torch_dynamo_backends` entry point (pyproject.toml), so
`torch.compile(m, backend="fastflow")` works without importing ffl_backend first. It is not also
registered with `register_backend`: Dynamo would then see the name twice and refuse it.

    Dynamo FX graph -> patterns/ (subgraphs -> torch.ops.fastflow.*) -> Inductor compile_fx

Whatever the patterns do not recognise is left as the model wrote it and compiled by Inductor. The
compiled graph goes back to Dynamo wrapped for the decode loop's guard-free replay (replay.py).
"""
from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from .config import BackendOptions
from .replay import CompiledGraph, replays_nothing
from .report import GraphReport, next_graph_id, record

logger = logging.getLogger("ffl_backend")


def _describe_inputs(example_inputs) -> tuple[str, str]:
    """(device, dominant floating dtype of the parameters) of a graph, for the report."""
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    device = tensors[0].device.type if tensors else "cpu"
    dtypes = Counter(str(t.dtype).replace("torch.", "") for t in tensors
                     if isinstance(t, torch.nn.Parameter) and t.is_floating_point())
    return device, dtypes.most_common(1)[0][0] if dtypes else "none"


_seen_failures: dict = {}


def _recompile_info() -> tuple[str | None, bool, str | None]:
    """(compile id, is this a recompile of an already-compiled frame, the guard that failed).

    Dynamo numbers compiles per frame (`frame_compile_id`); > 0 means an earlier graph for the same
    code was rejected by a guard. Its reason is the newest entry Dynamo appended to
    `guard_failures` since the last look."""
    from torch._dynamo.utils import guard_failures

    cid = torch._guards.CompileContext.current_compile_id()
    reason = None
    for code, reasons in list(guard_failures.items()):
        if len(reasons) > _seen_failures.get(code, 0):
            reason = str(reasons[-1])
        _seen_failures[code] = len(reasons)
    recompile = cid is not None and (cid.frame_compile_id or 0) > 0
    return (str(cid) if cid is not None else None), recompile, (reason if recompile else None)


def fastflow(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None):
    """Rewrite `gm` with the fastflow pattern families, then compile it with Inductor.

    `options`: see ffl_backend.config.BackendOptions. The per-graph outcome is in
    `ffl_backend.fusion_reports()` and logged on logger `ffl_backend`.
    """
    from . import kernels
    from .patterns.manager import fastflow_op_counts, run_passes, unfused_anchor_counts

    opts = BackendOptions.parse(mode, options)
    kernels.load_all()
    device, dtype = _describe_inputs(example_inputs)
    compile_id, recompile, guard = _recompile_info()
    report = GraphReport(graph_id=next_graph_id(), device=device, dtype=dtype,
                         num_nodes_before=len(gm.graph.nodes), compile_id=compile_id,
                         recompile=recompile, guard_failure=guard, mode=opts.mode,
                         inductor_config=opts.inductor_patches(device) if opts.inductor else {})
    start = time.perf_counter()
    gm = run_passes(gm, example_inputs, report, opts)
    report.ops = fastflow_op_counts(gm)
    report.unfused = unfused_anchor_counts(gm)
    report.num_nodes_after = len(gm.graph.nodes)
    if opts.inductor:
        from torch._inductor.compile_fx import compile_fx

        from .cache_key import cache_config

        compiled = compile_fx(gm, example_inputs, config_patches=cache_config(report.inductor_config))
    else:
        compiled = gm.forward
    report.compile_seconds = time.perf_counter() - start
    record(report)
    return CompiledGraph(compiled, replays_nothing())


def register_without_install() -> bool:
    """Register `fastflow` with Dynamo by hand where the package runs from a source tree (PYTHONPATH,
    no pip install: scripts/gpu_check.sh on a machine with its own torch), which has no entry point
    to be found by. An installed package is found through its entry point and is left alone:
    registering beside it fails with a duplicate name. Returns whether it registered."""
    if "fastflow" in torch._dynamo.list_backends(exclude_tags=()):
        return False
    torch._dynamo.register_backend(fastflow, name="fastflow")
    return True
