"""The guard-free replay of a decode step: everything fastflow does beside Dynamo, in one module.

The decode loop (decode_loop.py) hands every decode step the same objects -- the weights, the
cache and its own input tensors, which it updates in place -- so after Dynamo has checked its full
guards on the first `GUARDED_STEPS` steps of a generate() call, the later steps can skip what Dynamo
does per call:
- on CPU, when the step is one fastflow graph with no break, whose outputs are the step's results
  and after which Dynamo replays no side effect that changes anything, the recorded graph is called
  directly with the recorded arguments (no frame evaluation, guards or argument gathering: SmolLM2
  int4-all hands the graph 1,300 tensors);
- elsewhere (CUDA, side effects) the steps run through Dynamo with only the guards that tell cache
  entries apart (`skip_guard_eval_unsafe`), unless the model holds many buffers: those
  "differentiating" guards keep every non-Parameter tensor and an aliasing check quadratic in their
  number, which costs more than the full guards.

`FFL_GUARDED=1` in the environment turns all of it off: every step runs through Dynamo with its full
guards, as plain torch.compile would run it -- the switch to flip when bisecting a wrong result.
This module leans on Dynamo internals (side effects, cache entries, stances); where they moved, the
checks answer "not safe" and the steps stay guarded.
"""
from __future__ import annotations

import contextlib
import os

import torch

GUARDED_STEPS = 2  # decode steps per generate() call run with Dynamo's full guards
MAX_BUFFERS_TO_SKIP_GUARDS = 64  # above this many module buffers, skipping guards costs more (docstring)


def guarded() -> bool:
    """Whether FFL_GUARDED=1 asks for every decode step to go through Dynamo's full guards."""
    return os.environ.get("FFL_GUARDED", "0") == "1"


def replays_nothing() -> bool:
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
    """What the backend returns to Dynamo: the compiled graph, able to record its calls
    (`recorded_calls`) so that DecodeSteps can call it again without Dynamo."""

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


class _Unguarded:
    """`skip_guard_eval_unsafe` as a reusable context: building torch.compiler.set_stance costs ten
    times what entering a built one does. Built per generate() call, so it restores that call's stance."""

    def __init__(self):
        import torch._dynamo.eval_frame as eval_frame

        self._stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        eval_frame._set_stance(self._stance.prev)  # building it applied it; only `with` should

    def __enter__(self):
        self._stance.__enter__()

    def __exit__(self, *exc):
        self._stance.__exit__(*exc)


class DecodeSteps:
    """The decode steps of one generate() call: `steps(index)` runs step `index` (1-based) of
    `step(model, **inputs)` and returns its (logits, argmax). Steps 1 and 2 run through Dynamo with its
    full guards; if neither compiled, step 2's call is recorded and the later steps replay it as the
    module docstring says. `may_skip_guards`: the model holds few enough buffers for the
    differentiating guards to pay."""

    def __init__(self, model, step, inputs: dict, may_skip_guards: bool):
        self.model, self.step, self.inputs = model, step, inputs
        self.guarded = guarded()
        self.may_skip_guards = may_skip_guards and not self.guarded
        self.settled = True  # no guarded step compiled
        self.direct = None  # (graph, args, index of logits, index of argmax) once recorded
        self.unguarded = None

    def __call__(self, index: int):
        if self.direct is not None:
            graph, args, i, j = self.direct
            out = graph(*args)
            return out[i], out[j]
        if self.inputs["input_ids"].is_cuda:  # CUDA graphs: the previous step's outputs are consumed
            torch.compiler.cudagraph_mark_step_begin()
        if index > GUARDED_STEPS or self.guarded:
            if not (self.settled and self.may_skip_guards):
                return self.step(self.model, **self.inputs)
            self.unguarded = self.unguarded or _Unguarded()
            with self.unguarded:
                return self.step(self.model, **self.inputs)
        from torch._dynamo import convert_frame

        before = sum(convert_frame.FRAME_COMPILE_COUNTER.values())
        with recorded_calls() as calls:
            out = self.step(self.model, **self.inputs)
        self.settled &= sum(convert_frame.FRAME_COMPILE_COUNTER.values()) == before
        if index == GUARDED_STEPS and self.settled and not self.inputs["input_ids"].is_cuda and one_graph(self.step):
            self.direct = direct_call(calls, out)
        return out


def one_graph(step) -> bool:
    """Whether every compiled version of `step` is one graph with no graph break: Python that
    Dynamo runs around a graph (a resume function after a break) would be skipped by a direct call."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    code = getattr(getattr(step, "_torchdynamo_orig_callable", step), "__code__", None)
    entries = _debug_get_cache_entry_list(code) if code is not None else []
    return bool(entries) and not any(name.startswith("__resume_at") for e in entries for name in e.code.co_names)


def direct_call(calls: list, out: tuple):
    """(graph function, args, i, j) when the step was one fastflow graph call whose outputs i and j
    are the step's two results and after which Dynamo replays nothing; else None."""
    if len(calls) != 1:
        return None
    graph, args, graph_out = calls[0]
    if not graph.replays_nothing or not isinstance(graph_out, (list, tuple)):
        return None
    where = [next((k for k, t in enumerate(graph_out) if t is result), None) for result in out]
    return None if None in where else (graph.fn, args, *where)
