#!/usr/bin/env bash
# Set up, lint, and run the whole test suite on the embedded profile.
#
# Two pytest workers (pytest-xdist), each with its own SparkSession and broker, one test file
# at a time: alone, the suite keeps only ~1.3 of these 2 cores busy (a test runs small Spark
# jobs one after another), so a second worker fills the gaps (README, Tests). Arguments come
# after and win: `bash scripts/test.sh -n 0 tests/jobs` runs in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
