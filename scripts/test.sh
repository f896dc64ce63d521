#!/usr/bin/env bash
# Install (idempotent), lint (ruff: pyflakes, pycodestyle, import order) and run the whole test suite.
# CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m ruff check --quiet ffl_backend tests benchmarks examples
python -m pytest -q -p no:cacheprovider "$@"
