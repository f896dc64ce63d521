"""The `fastflow` torch.compile backend.

Found by name through the `torch_dynamo_backends` entry point (pyproject.toml), so
`torch.compile(m, backend="fastflow")` works without importing ffl_backend first. It is not also
registered with `register_backend`: Dynamo would then see the name twice and refuse it.

    Dynamo FX graph -> patterns/ (subgraphs -> torch.ops.fastflow.*) -> Inductor compile_fx

Whatever the patterns do not recognise is left as the model wrote it and compiled by Inductor.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter

import torch

from .config import BackendOptions
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
    return CompiledGraph(compiled, _replays_nothing())


def _replays_nothing() -> bool:
    """Whether what Dynamo replays after the graph of the frame being compiled changes nothing: the
    graph alone is then the frame's work. Mutated objects made inside the frame are invisible after
    it; an attribute store counts as nothing only when it writes back the value the attribute holds
    now, before the frame runs (transformers' forward sets a global output collector and restores
    it). Anything else -- other stores, container mutations, hooks -- or Dynamo internals that moved:
    False."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        effects = InstructionTranslator.current_tx().output.side_effects
        if effects.tensor_hooks or effects.save_for_backward:
            return False
        for var in effects._get_modified_vars():
            if var.source is None:  # made inside the frame
                continue
            stores = effects.store_attr_mutations.get(var)
            if not stores or not all(_writes_back(var.value, name, value) for name, value in stores.items()):
                return False
        return True
    except Exception:  # not under Dynamo (a direct call), or its internals moved: assume effects
        return False


def _writes_back(obj, name: str, value) -> bool:
    """Whether storing the traced constant `value` into obj.`name` leaves it as it is now."""
    if not value.is_python_constant():
        return False
    current, new = getattr(obj, name), value.as_python_constant()
    return current is new or (type(current) in (int, float, bool, str) and current == new)


_recorder: list | None = None


class CompiledGraph:
    """What the backend returns to Dynamo: the compiled graph, able to record its calls.

    ffl_backend's decode loop records one decode step's call (`recorded_calls`) and then runs the
    steps after it by calling the graph itself with the same arguments -- its inputs are tensors it
    updates in place, the model's weights and the cache -- without Dynamo's frame evaluation, guards
    and argument gathering (decode_loop.py says when that is allowed)."""

    def __init__(self, fn, replays_nothing: bool):
        self.fn, self.replays_nothing = fn, replays_nothing

    def __call__(self, *args):
        out = self.fn(*args)
        if _recorder is not None:
            _recorder.append((self, args, out))
        return out


@contextlib.contextmanager
def recorded_calls():
    """Collect (graph, args, outputs) of every fastflow-compiled graph called in this block."""
    global _recorder
    previous, _recorder = _recorder, []
    try:
        yield _recorder
    finally:
        _recorder = previous


def register_without_install() -> bool:
    """Register `fastflow` with Dynamo by hand where the package runs from a source tree (PYTHONPATH,
    no pip install: scripts/gpu_check.sh on a machine with its own torch), which has no entry point
    to be found by. An installed package is found through its entry point and is left alone:
    registering beside it fails with a duplicate name. Returns whether it registered."""
    if "fastflow" in torch._dynamo.list_backends(exclude_tags=()):
        return False
    torch._dynamo.register_backend(fastflow, name="fastflow")
    return True
