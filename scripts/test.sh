#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider "$@"
