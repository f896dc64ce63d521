"""Fusion and compile reports: what the backend did to each graph, for logs, tools and tests.

Every graph the `fastflow` backend compiles appends a `GraphReport`; `fusion_reports()` returns them,
`last_report()` the newest, `clear_reports()` starts over. Reports are also logged on logger
`ffl_backend` (INFO: one line per graph; DEBUG: every declined match with its reason).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter

logger = logging.getLogger("ffl_backend")
_lock = threading.Lock()
_reports: list["GraphReport"] = []


@dataclasses.dataclass
class GraphReport:
    """One compiled graph.

    matches:    pattern family (built-in or registered) -> number of subgraphs rewritten to fastflow ops
    declined:   pattern family -> number of candidate sites left as they were (see `reasons`)
    fallbacks:  families whose pass raised; the graph kept its pre-pass form (never a wrong result)
    ops:        fastflow op name -> count in the final graph ("fastflow_user::<name>" for register_op's)
    unfused:    anchor op (rsqrt, silu, gelu, layer_norm, tanh) -> count left in the final graph
    compile_id: Dynamo's "frame/compile-of-that-frame" id
    recompile:  True when Dynamo compiled this graph again for a code object it had already seen
    guard_failure: the guard that failed for that recompile, when Dynamo reported one
    mode:       the torch.compile mode it was compiled under (None = default)
    inductor_config: the Inductor settings fastflow compiled it with (defaults, the mode's, the user's)
    """

    graph_id: int
    device: str
    dtype: str
    num_nodes_before: int
    num_nodes_after: int = 0
    matches: Counter = dataclasses.field(default_factory=Counter)
    declined: Counter = dataclasses.field(default_factory=Counter)
    reasons: list = dataclasses.field(default_factory=list)
    fallbacks: dict = dataclasses.field(default_factory=dict)
    ops: Counter = dataclasses.field(default_factory=Counter)
    unfused: Counter = dataclasses.field(default_factory=Counter)
    compile_seconds: float = 0.0
    compile_id: str | None = None
    recompile: bool = False
    guard_failure: str | None = None
    mode: str | None = None
    inductor_config: dict = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        matched = ", ".join(f"{k}={v}" for k, v in sorted(self.matches.items()) if v) or "none"
        mode = f", mode={self.mode}" if self.mode else ""
        text = (f"fastflow graph {self.graph_id} ({self.device}, {self.dtype}{mode}): {matched}; "
                f"nodes {self.num_nodes_before}->{self.num_nodes_after}; {self.compile_seconds:.1f}s")
        if self.fallbacks:
            text += f"; FELL BACK: {self.fallbacks}"
        if self.recompile:
            text += f"; recompile ({self.guard_failure or 'guard unknown'})"
        return text

    def as_dict(self) -> dict:
        # asdict rebuilds a Counter from its (key, count) pairs, which counts the pairs: plain dicts first
        counters = {key: dict(getattr(self, key)) for key in ("matches", "declined", "ops", "unfused")}
        return dataclasses.asdict(dataclasses.replace(self, **counters))


def record(report: GraphReport) -> None:
    with _lock:
        _reports.append(report)
    logger.info(report.summary())
    for family, where, why in report.reasons:
        logger.debug("fastflow: %s declined at %s: %s", family, where, why)


def fusion_reports() -> list[GraphReport]:
    """Reports of every graph compiled by `fastflow` in this process, oldest first."""
    with _lock:
        return list(_reports)


def last_report() -> GraphReport | None:
    with _lock:
        return _reports[-1] if _reports else None


def clear_reports() -> None:
    with _lock:
        _reports.clear()


def recompiles() -> list[GraphReport]:
    """The reports of graphs that were recompiles (each says which guard failed)."""
    return [r for r in fusion_reports() if r.recompile]


def next_graph_id() -> int:
    with _lock:
        return len(_reports)
