#!/usr/bin/env bash
# The GPU check (docs/gpu.md): the `cuda` tests, then a short benchmark, in <= 8 minutes.
#   bash scripts/gpu_check.sh OUT [--skip STAGE ...] [--only STAGE ...]    # OUT/gpu_check.{json,log}
#   bash scripts/gpu_check.sh --dry-run [OUT]                               # no GPU needed
# Runs with the machine's own torch / triton / transformers (python3, or $PYTHON) and this tree on
# PYTHONPATH: nothing is installed and nothing is downloaded.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ -z "${PYTHON:-}" ] && [[ " $* " == *" --dry-run "* ]] && [ -x "$ROOT/.venv/bin/python" ]; then
  PY="$ROOT/.venv/bin/python"  # a development machine's dry run: its venv has what the stages import
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Compiled kernels, not the interpreter: tests/conftest.py leaves TRITON_INTERPRET unset under this.
export FFL_NATIVE_TRITON=1
unset TRITON_INTERPRET
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$ROOT"
exec "$PY" benchmarks/gpu_check.py "$@"
