#!/usr/bin/env bash
# Sets up (idempotent) and runs the whole test suite; exits non-zero when any test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
