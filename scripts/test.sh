#!/usr/bin/env bash
# Set up, lint, and run the whole test suite on the embedded profile.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
