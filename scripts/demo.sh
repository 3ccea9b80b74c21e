#!/usr/bin/env bash
# Sets up (idempotent) and runs the main job: the hybridpipe demo on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hybridpipe demo "$@"
