#!/usr/bin/env bash
# Creates .venv (idempotent) and installs hybridpipe with its test tools. torch 2.14.1 and
# torchvision 0.29.1 are pinned so pip never reaches for a newer, multi-GB build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check \
  torch==2.14.1 torchvision==0.29.1 -e ".[dev]"
