"""Options of the `fastflow` backend.

Pass them as `torch.compile(model, backend="fastflow", options={...})` or through
`CompileConfig(backend="fastflow", options={...})`. Unknown keys are an error, so a typo never
silently disables a feature.

patterns      families to run (default: every family known when the graph is compiled: the built-in
              PATTERN_FAMILIES and those added with ffl_backend.register_pattern, docs/extending.md).
              They run in the registry's order (pattern_families()), not in the order listed.
              Unlisted families are skipped; their subgraphs stay as the model wrote them.
disable_patterns  families not to run, built-in or registered alike, e.g. ("rotary", "my_act"):
              taken out of `patterns` (which then lists what runs). Unknown names in either option
              are an error.
on_error      "fallback" (default): a family whose pass raises is skipped for that graph, with a
              warning and an entry in the report; the graph keeps its pre-pass form.
              "raise": re-raise (for development).
inductor      True (default): compile the rewritten graph with Inductor. False: run it as is
              (eager), to debug a pattern without Inductor in the way.
bf16_exact_weights  True (default): on CPU, single-row (decode) fp32 linears whose weights are all
              exact bf16 values (a bf16 checkpoint loaded in fp32) read a bf16 copy of the weight:
              half the bytes, identical products, fp32 accumulation. Costs the copy's memory (half
              the fp32 weights it covers). False: fp32 weights are always read as fp32.
cpu_gemv      how the decode_gemv family computes single-row CPU linears (int8 weight-only and bf16
              weights, incl. the bf16 copy above): "auto" (default) calls the hand-written kernel
              `fastflow_cpu::gemv` (kernels/cpu_gemv.cpp, compiled once per machine on first use; it
              streams weights faster than Inductor's loop) and falls back to "loops" with a warning
              where it cannot be built; "kernel" requires it (an error where it cannot be built);
              "loops" lets Inductor generate the multiply + sum loop.
int8_activations  how that kernel multiplies int8 weights: "float" in fp32 FMAs on the activations
              as they are; "int16" quantizes each activation row once per call to int16 (one scale
              per row: error at most 2^-16 of the row's largest |x|, below bf16's rounding for values
              above 1/128 of it) and sums exact integer products (`fastflow_cpu::gemv_q16`): less
              arithmetic per weight, faster for small batches. "auto" (default): "int16" on CPUs with
              AVX512-VNNI, where it was measured faster at batch 1 and 4 (docs/performance.md), else
              "float".
inductor_config  extra `torch._inductor.config` patches over DEFAULT_INDUCTOR_CONFIG, applied to
              this compile only, e.g. {"cpp_wrapper": True} (what mode "reduce-overhead" sets on CPU,
              docs/modes.md).
              Inductor's `freezing` cannot be set here: Dynamo decides it at trace time, and with
              HF's static cache it would fold the KV cache into constants. The `packed_linear`
              family gives the CPU weight pre-packing that freezing would have given.
"""
from __future__ import annotations

import dataclasses

from .patterns.registry import current_name, pattern_families, unknown_families

CPU_GEMV_CHOICES = ("auto", "kernel", "loops")
INT8_ACTIVATION_CHOICES = ("auto", "float", "int16")

# Inductor settings fastflow changes by default. size_asserts: the compiled wrapper re-checks the size
# and stride of every input on every call (hundreds of asserts per decode step); Dynamo's tensor
# guards have already checked the same static sizes and strides before the call.
# cpp.enable_floating_point_contract_flag: Inductor compiles its C++ with -ffp-contract=off, so every
# `acc + x * w` of a decode GEMV is a multiply and a dependent add; "fast" lets the compiler emit one
# FMA (one rounding instead of two); the decode A/B is benchmarks/results/fp_contract_ab_cpu.json.
DEFAULT_INDUCTOR_CONFIG = {"size_asserts": False, "cpp.enable_floating_point_contract_flag": "fast"}


# What "reduce-overhead" adds on CPU, where there are no CUDA graphs: see docs/modes.md.
# Built in two parts (kernels, wrapper): a much shorter cold compile at the same decode speed
# (docs/modes.md).
CPU_REDUCE_OVERHEAD_CONFIG = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}

# torch.compile's modes (torch._inductor.list_mode_options). Each brings Inductor's own settings for it
# ("reduce-overhead": CUDA graphs; "max-autotune": autotuned kernels, and CUDA graphs); on CPU
# "reduce-overhead" also brings CPU_REDUCE_OVERHEAD_CONFIG.
MODES = ("default", "lite", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def mode_config(mode: str | None, device: str) -> dict:
    """Inductor settings a torch.compile `mode` stands for on `device` (cpu, cuda, ...)."""
    if mode in (None, "default"):
        return {}
    from torch._inductor import list_mode_options

    patches = dict(list_mode_options(mode))
    if device == "cpu":
        patches.pop("triton.cudagraphs", None)  # no CUDA graphs of a CPU graph (Inductor would warn)
        if mode == "reduce-overhead":
            patches.update(CPU_REDUCE_OVERHEAD_CONFIG)
    return patches


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    mode: str | None = None
    patterns: tuple = dataclasses.field(default_factory=pattern_families)
    disable_patterns: tuple = ()
    on_error: str = "fallback"
    inductor: bool = True
    bf16_exact_weights: bool = True
    cpu_gemv: str = "auto"
    int8_activations: str = "auto"
    inductor_config: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        # `patterns` is what runs: every reader of it (the pass manager, decode_gemv's look at its
        # siblings) then sees the same set
        object.__setattr__(self, "patterns", tuple(f for f in self.patterns if f not in self.disable_patterns))

    @classmethod
    def parse(cls, mode=None, options=None) -> "BackendOptions":
        """`mode` as torch.compile passes it, or as options["mode"] (torch.compile refuses mode= and
        options= together, so that is how both are given)."""
        options = dict(options or {})
        if mode is not None and options.get("mode", mode) != mode:
            raise ValueError(f"fastflow: mode={mode!r} and options['mode']={options['mode']!r} disagree")
        options["mode"] = options.get("mode", mode)
        if options["mode"] not in (None, *MODES):
            raise ValueError(f"fastflow: unknown mode {options['mode']!r}; known: {MODES}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"fastflow: unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
        for key in ("patterns", "disable_patterns"):
            if key in options:
                options[key] = _families(key, options[key])
        if options.get("on_error", "fallback") not in ("fallback", "raise"):
            raise ValueError("fastflow: on_error must be 'fallback' or 'raise'")
        if options.get("cpu_gemv", "auto") not in CPU_GEMV_CHOICES:
            raise ValueError(f"fastflow: cpu_gemv must be one of {CPU_GEMV_CHOICES}")
        if options.get("int8_activations", "auto") not in INT8_ACTIVATION_CHOICES:
            raise ValueError(f"fastflow: int8_activations must be one of {INT8_ACTIVATION_CHOICES}")
        return cls(**options)

    def inductor_patches(self, device: str) -> dict:
        """fastflow's Inductor defaults, then what the mode stands for, then the user's own patches."""
        return {**DEFAULT_INDUCTOR_CONFIG, **mode_config(self.mode, device), **self.inductor_config}


def _families(key: str, names) -> tuple:
    """A `patterns`/`disable_patterns` value as a tuple of known families (a lone string is one name)."""
    names = tuple(map(current_name, (names,) if isinstance(names, str) else names))
    bad = unknown_families(names)
    if bad:
        raise ValueError(f"fastflow: {key}: unknown pattern families {bad}; known: {pattern_families()}")
    return names
